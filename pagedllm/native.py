"""Compile, cache and load the engine's C kernels (plain C11 sources, no torch headers).

A kernel source is compiled on first use with the system C compiler (``$CC``, default ``cc``;
it may carry words, e.g. ``"ccache gcc"``) with :data:`BASE_CFLAGS` (``-O3 -march=native
-ffp-contract=fast``, no ``-ffast-math``) and ``-I`` this package's folder (the shared headers,
:data:`INCLUDE_DIR`: ``native_simd.h``) into ``$PAGEDLLM_CACHE_DIR`` (default
``~/.cache/pagedllm``), under a name keyed by the SHA-256 of the source, every header in
:data:`INCLUDE_DIR` (an edit to one rebuilds every kernel), the flags, the compiler and the host
CPU, written atomically (concurrent builders never load a partial file), and
loaded with :mod:`ctypes` (which releases the GIL for every call).

OpenMP: a kernel built with ``openmp=True`` is compiled with ``-fopenmp`` and linked against the
very libgomp that torch has loaded (found in ``/proc/self/maps``, else ``torch/lib``), by its
file name (``-l:<name>``) and an rpath to its folder. Its SONAME then equals the loaded copy's,
so the dynamic loader reuses that copy instead of loading a second OpenMP runtime: the kernel's
``#pragma omp parallel`` regions run on the same worker threads as torch's intra-op parallelism
(libgomp keeps one thread pool per calling thread), and the two never compete for the cores
with two spinning teams. Callers pass the thread count explicitly (``num_threads(n)`` with
``n = torch.get_num_threads()``): OpenMP's per-thread settings on the engine's thread need not
be the ones of the thread that called ``torch.set_num_threads``. When torch has no libgomp
(a build on another OpenMP runtime, or none), :func:`openmp_link_flags` is None, the kernel is
built without ``-fopenmp`` (its pragmas are ignored, it runs on the calling thread) and
:func:`openmp_available` tells its caller to split the work itself.
"""

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

logger = logging.getLogger(__name__)

__all__ = ["BASE_CFLAGS", "CACHE_DIR_ENV", "INCLUDE_DIR", "build_library", "cache_dir", "load_library",
           "openmp_available", "openmp_link_flags"]

BASE_CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fPIC", "-shared", "-std=c11")
CACHE_DIR_ENV = "PAGEDLLM_CACHE_DIR"
INCLUDE_DIR = Path(__file__).parent  # the headers shared by the kernels (native_simd.h)
# A cold build of cpu_paged.c takes ~30 s of CPU; on a busy 2-core host its wall time has
# reached 70 s, so the limit only catches a hung compiler, never a slow one.
_BUILD_TIMEOUT_S = 600


def cache_dir() -> Path:
    """Where compiled libraries are kept: ``$PAGEDLLM_CACHE_DIR`` or ``~/.cache/pagedllm``, read at call time."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "pagedllm")


def build_library(source: Path, extra_flags: tuple[str, ...] = (), openmp: bool = True,
                  compiler: str | None = None) -> Path:
    """Path of ``source`` compiled into a shared library, building it if not cached yet.

    Args:
        source: a C11 source file; its bytes and those of every ``*.h`` in :data:`INCLUDE_DIR` are
            part of the cache key (an edit to either rebuilds).
        extra_flags: appended after :data:`BASE_CFLAGS` (a later ``-march=`` overrides ``native``).
        openmp: compile with ``-fopenmp`` and link torch's libgomp (see the module docstring);
            built without when :func:`openmp_link_flags` is None.
        compiler: the compiler command line; default ``$CC`` or ``cc``, read at call time.
    Returns:
        ``<cache_dir()>/<source stem>_<key>.so``; the key covers the source, the shared headers,
        every flag, the compiler and the host CPU (a ``-march=native`` library must not load on another CPU).
    Raises:
        OSError: the compiler is missing or fails (its stderr tail in the message).
        subprocess.SubprocessError: the build ran over two minutes.
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
        os.chmod(tmp, 0o755)  # mkstemp made it 0600
        os.replace(tmp, target)  # atomic: concurrent builders never see a partial file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


_load_lock = threading.Lock()
_loaded: dict[tuple, ctypes.CDLL | None] = {}


def load_library(source: Path, extra_flags: tuple[str, ...] = (), openmp: bool = True,
                 what: str | None = None) -> ctypes.CDLL | None:
    """``ctypes.CDLL`` of :func:`build_library`'s result, memoised per (source, flags, openmp, ``$CC``).

    Returns None, after logging one warning per process and key (``"<what> unavailable (...)"``,
    ``what`` defaulting to the source's name), when the compiler is missing or the build or the
    load fails; never raises for those, so callers fall back to their torch code.
    """
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


def openmp_available() -> bool:
    """Whether libraries built with ``openmp=True`` get OpenMP (torch runs on a libgomp we can link)."""
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
    """The libgomp file mapped into this process after importing torch (a wheel may ship it under a
    hashed name such as ``libgomp-a34b3233.so.1``), else ``torch/lib/libgomp.so.1`` if torch's
    OpenMP runtime is GNU's; None when torch runs on another OpenMP runtime (libiomp5, libomp)."""
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
    """Machine + CPU model + ISA flags: a library built with -march=native on one CPU must not be
    loaded on another that shares the cache directory."""
    text = ""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features"))]
        text = "".join(sorted(set(lines)))
    except OSError:
        pass
    return f"{platform.machine()}|{platform.processor()}|{text}"
