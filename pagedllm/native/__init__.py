"""Compiles, caches and loads the engine's C kernels (this folder) with ctypes. The cache key covers the
source, every header, the flags, the compiler and the host CPU (``-march=native``); with ``openmp=True``
a library links torch's own libgomp so its regions run on torch's thread team."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable, TypeVar

from pagedllm import envs

logger = logging.getLogger(__name__)

__all__ = ["BASE_CFLAGS", "INCLUDE_DIR", "SOURCE_DIR", "build_library", "cache_dir", "load_kernels", "load_library",
           "openmp_available", "openmp_link_flags"]

BASE_CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fPIC", "-shared", "-std=c11")
SOURCE_DIR = Path(__file__).parent
INCLUDE_DIR = SOURCE_DIR
_BUILD_TIMEOUT_S = 600  # catches a hung compiler, never a slow one
T = TypeVar("T")


def cache_dir() -> Path:
    """Where compiled libraries are kept (``envs.CACHE_DIR``), read at call time."""
    return envs.cache_dir()


def build_library(source: Path, extra_flags: tuple[str, ...] = (), openmp: bool = True,
                  compiler: str | None = None) -> Path:
    """``<cache_dir()>/<source stem>_<key>.so``, built if not cached yet (``compiler``: ``$CC`` or ``cc``).

    Raises OSError when the compiler is missing or fails, subprocess.SubprocessError on timeout.
    """
    compiler = compiler or os.environ.get("CC", "cc")
    link = openmp_link_flags() if openmp else None
    # Link flags go after the source: the linker resolves libraries left to right.
    command = [*BASE_CFLAGS, f"-I{INCLUDE_DIR}", *extra_flags, *(("-fopenmp",) if link is not None else ()),
               "{source}", *(link or ())]
    headers = [h.name.encode() + b"\0" + h.read_bytes() for h in sorted(INCLUDE_DIR.glob("*.h"))]
    key = hashlib.sha256(b"\0".join([source.read_bytes(), *headers, " ".join(command).encode(), compiler.encode(),
                                     _host_cpu_id().encode()])).hexdigest()[:24]
    directory = cache_dir()
    target = directory / f"{source.stem}_{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=directory)
    os.close(fd)
    try:
        args = [str(source) if a == "{source}" else a for a in command]
        result = subprocess.run([*shlex.split(compiler), "-o", tmp, *args], capture_output=True, text=True,
                                timeout=_BUILD_TIMEOUT_S)
        if result.returncode != 0:
            raise OSError(f"{compiler} exited with {result.returncode}: {result.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: concurrent builders never see a partial file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


_load_lock = threading.Lock()
_loaded: dict[tuple, ctypes.CDLL | None] = {}


def load_library(source: Path, extra_flags: tuple[str, ...] = (), openmp: bool = True,
                 what: str | None = None) -> ctypes.CDLL | None:
    """``ctypes.CDLL`` of :func:`build_library`'s result, memoised per (source, flags, openmp, ``$CC``);
    None, after one warning per key (``"<what> unavailable (...)"``), when the build or load fails."""
    compiler = os.environ.get("CC", "cc")
    key = (str(source), tuple(extra_flags), openmp, compiler)
    with _load_lock:
        if key not in _loaded:
            try:
                _loaded[key] = ctypes.CDLL(str(build_library(source, extra_flags, openmp, compiler)))
            except (OSError, subprocess.SubprocessError) as e:
                logger.warning("%s unavailable (%s); using the PyTorch code", what or source.name, e)
                _loaded[key] = None
        return _loaded[key]


def load_kernels(source: Path, wrap: Callable[[ctypes.CDLL], T], what: str, fallback: str,
                 extra_flags: tuple[str, ...] = ()) -> T | None:
    """``wrap(library)``, or None (one warning naming ``fallback``, what runs instead) when the library
    cannot be built or loaded or ``wrap`` refuses it (OSError, AttributeError: an ABI mismatch)."""
    lib = load_library(source, extra_flags, what=what)
    if lib is None:
        return None
    try:
        return wrap(lib)
    except (OSError, AttributeError) as e:
        logger.warning("%s unavailable (%s); using %s", what, e, fallback)
        return None


def openmp_available() -> bool:
    """Whether libraries built with ``openmp=True`` get OpenMP."""
    return openmp_link_flags() is not None


@functools.cache
def openmp_link_flags() -> tuple[str, ...] | None:
    """Linker flags for torch's own libgomp (``-L<dir> -l:<file> -Wl,-rpath,<dir>``), or None when
    torch does not run on GNU OpenMP (then kernels are built without ``-fopenmp``)."""
    path = _torch_libgomp()
    if path is None:
        logger.info("torch has no libgomp loaded: C kernels are built without OpenMP")
        return None
    return (f"-L{path.parent}", f"-l:{path.name}", f"-Wl,-rpath,{path.parent}")


def _torch_libgomp() -> Path | None:
    """The libgomp mapped into this process by torch, else ``torch/lib/libgomp.so.1``; None when torch
    runs on another OpenMP runtime."""
    import torch

    mapped = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
                if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith(("libgomp", "libiomp", "libomp")):
                    mapped.add(Path(fields[5].strip()))
    except OSError:
        pass
    gomp = sorted(p for p in mapped if p.name.startswith("libgomp"))
    if gomp:
        return gomp[0]
    if mapped:  # another OpenMP runtime: linking libgomp would start a second thread team
        return None
    bundled = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    return bundled if bundled.exists() else None


def _host_cpu_id() -> str:
    """Machine + CPU model + ISA flags (the cache key's host part)."""
    text = ""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features"))]
        text = "".join(sorted(set(lines)))
    except OSError:
        pass
    return f"{platform.machine()}|{platform.processor()}|{text}"
