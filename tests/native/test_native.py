"""pagedllm.native: C kernels compiled once, cached on disk, and run on torch's OpenMP threads."""

import ctypes
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from pagedllm import envs, native

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc").split()[0]) is None,
                                reason="no C compiler")

_SOURCE = """
#ifdef _OPENMP
#include <omp.h>
#endif
int answer(void) { return ANSWER; }
int team_size(int n) {
    int size = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(n)
    {
#pragma omp single
        size = omp_get_num_threads();
    }
#endif
    (void)n;
    return size;
}
"""


@pytest.fixture
def source(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(envs.CACHE_DIR.name, str(tmp_path / "cache"))
    path = tmp_path / "tiny.c"
    path.write_text(_SOURCE)
    return path


def _answer(path: Path) -> int:
    return ctypes.CDLL(str(path)).answer()


def test_built_once_and_cached(source):
    path = native.build_library(source, ("-DANSWER=42",))
    assert path.parent == native.cache_dir() and path.name.startswith("tiny_") and path.suffix == ".so"
    mtime = path.stat().st_mtime_ns
    assert native.build_library(source, ("-DANSWER=42",)) == path and path.stat().st_mtime_ns == mtime
    assert [p.name for p in native.cache_dir().iterdir()] == [path.name]  # no temporary files left
    assert _answer(path) == 42


def test_rebuilt_when_source_or_flags_change(source):
    first = native.build_library(source, ("-DANSWER=1",))
    by_flags = native.build_library(source, ("-DANSWER=2",))
    source.write_text(_SOURCE.replace("ANSWER;", "ANSWER + 100;"))
    by_source = native.build_library(source, ("-DANSWER=2",))
    assert len({first, by_flags, by_source}) == 3
    assert (_answer(first), _answer(by_flags), _answer(by_source)) == (1, 2, 102)


def test_rebuilt_when_a_shared_header_changes(source, tmp_path, monkeypatch):
    include = tmp_path / "include"
    include.mkdir()
    (include / "shared.h").write_text("#define OFFSET 10\n")
    monkeypatch.setattr(native, "INCLUDE_DIR", include)
    source.write_text('#include "shared.h"\n' + _SOURCE.replace("ANSWER;", "ANSWER + OFFSET;"))
    first = native.build_library(source, ("-DANSWER=1",))
    (include / "shared.h").write_text("#define OFFSET 20\n")  # the source and the flags unchanged
    second = native.build_library(source, ("-DANSWER=1",))
    assert first != second and (_answer(first), _answer(second)) == (11, 21)


def test_kernels_include_the_shared_header():
    header = native.INCLUDE_DIR / "native_simd.h"
    assert header.is_file()
    for source in ("cpu_paged.c", "cpu_ops.c", "skinny_gemm.c"):
        assert '#include "native_simd.h"' in (native.INCLUDE_DIR / source).read_text()


@pytest.mark.parametrize("compiler", ["pagedllm-no-such-compiler", "false"])
def test_broken_compiler_warns_once_and_returns_none(source, monkeypatch, caplog, compiler):
    monkeypatch.setenv("CC", compiler)
    monkeypatch.setattr(native, "_loaded", {})
    with caplog.at_level(logging.WARNING, logger="pagedllm.native"):
        assert native.load_library(source, ("-DANSWER=1",), what="tiny kernel") is None
        assert native.load_library(source, ("-DANSWER=1",), what="tiny kernel") is None
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["tiny kernel unavailable"]
    with pytest.raises(OSError):
        native.build_library(source, ("-DANSWER=1",))


def test_load_library_is_memoised(source, monkeypatch):
    monkeypatch.setattr(native, "_loaded", {})
    lib = native.load_library(source, ("-DANSWER=7",))
    assert lib is not None and lib.answer() == 7
    assert native.load_library(source, ("-DANSWER=7",)) is lib


def _mapped_openmp_runtimes() -> set[str]:
    with open("/proc/self/maps") as f:
        paths = {line.split(maxsplit=5)[5].strip() for line in f if len(line.split(maxsplit=5)) == 6}
    return {p for p in paths if os.path.basename(p).startswith(("libgomp", "libiomp", "libomp"))}


@pytest.mark.skipif(not native.openmp_available(), reason="torch does not run on libgomp here")
def test_openmp_runs_on_torch_libgomp_thread_pool(source):
    """The kernel's parallel regions use the libgomp torch loaded (loading it maps no other runtime) and
    the worker threads torch's own parallel ops already started (no new thread appears). Other packages a
    test imported (scikit-learn, under sentence-transformers) may have mapped their own copy beforehand."""
    before = _mapped_openmp_runtimes()
    lib = ctypes.CDLL(str(native.build_library(source, ("-DANSWER=0",), openmp=True)))
    assert _mapped_openmp_runtimes() == before
    assert [path for path in before if "/torch/lib/" in path], before
    n = torch.get_num_threads()
    torch.ones(1 << 20).exp_().sum()  # a torch parallel op: its thread team exists now
    threads = len(os.listdir("/proc/self/task"))
    assert lib.team_size(n) == n
    assert len(os.listdir("/proc/self/task")) == threads
    assert lib.team_size(1) == 1


def test_without_openmp_runs_on_the_calling_thread(source):
    lib = ctypes.CDLL(str(native.build_library(source, ("-DANSWER=0",), openmp=False)))
    assert lib.team_size(4) == 1
