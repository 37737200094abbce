"""What an installed (non-editable) pagedllm ships: every file it reads at run time."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "pagedllm"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_package_data_matches_every_kernel_source_and_page():
    """The C kernels are compiled from their sources on first use, so a wheel without a .c or .h
    file falls back to PyTorch code (or fails to build a kernel): pyproject's package-data must
    match every one of them, and the KV-map page."""
    import tomllib

    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["pagedllm"]
    shipped = {p for pattern in patterns for p in PACKAGE.glob(pattern)}
    needed = {p for ext in ("*.c", "*.h", "*.html") for p in PACKAGE.rglob(ext)}
    assert needed and needed <= shipped, sorted(str(p.relative_to(PACKAGE)) for p in needed - shipped)
    assert {PACKAGE / "native" / name for name in ("cpu_ops.c", "cpu_paged.c", "skinny_gemm.c", "native_simd.h")} <= shipped
