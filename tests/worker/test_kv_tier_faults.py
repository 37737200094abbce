"""The disk tier is a cache: a block file that is corrupt, truncated, foreign or missing when it is
read, and a write that fails, are logged misses counted in a metric, and every request gets the
tokens of a run without the tier; a folder holding anything but regular files is refused."""

from __future__ import annotations

import errno
import logging
import os

import pytest

from tests.worker.test_kv_offload_tiers import PROMPT, _generate, _greedy, _make, _result, _session

OTHER = [7 + (i * 31) % 40000 for i in range(40)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = _make(tiny_model_dir, enable_prefix_caching=False)
    return _result(_generate(llm, PROMPT)), _result(_generate(llm, OTHER))


def _filled_tier(tiny_model_dir, folder) -> list:
    _, again = _session(_make(tiny_model_dir, kv_offload_dir=str(folder)))
    assert again.metrics.cached_tokens_by_tier["disk"] == 64
    return sorted(folder.glob("*.safetensors"))


def _corrupt(path):  # same size, header intact: flip the last tensor bytes
    data = bytearray(path.read_bytes())
    data[-64:] = bytes(b ^ 0x5A for b in data[-64:])
    path.write_bytes(bytes(data))


DAMAGE = {
    "corrupt": lambda files: [_corrupt(f) for f in files],
    "truncated": lambda files: [f.write_bytes(f.read_bytes()[:-100]) for f in files],
    "foreign": lambda files: [f.write_bytes(files[(i + 1) % len(files)].read_bytes()) for i, f in enumerate(files)],
    "missing": lambda files: [f.unlink() for f in files],
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_block_files_read_after_start_are_misses(tiny_model_dir, tmp_path, reference, damage, caplog):
    files = _filled_tier(tiny_model_dir, tmp_path)
    restarted = _make(tiny_model_dir, kv_offload_dir=str(tmp_path))  # indexes the files it finds
    DAMAGE[damage](files)
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        outs = restarted.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": OTHER}],
                                  _greedy(), use_tqdm=False)
    assert [o.error for o in outs] == [None, None]
    assert [_result(o) for o in outs] == list(reference)
    assert "treated as a miss" in caplog.text
    stats = restarted.llm_engine.get_stats()
    assert stats.kv_offload_io_errors_total >= 1 and stats.num_used_blocks == 0
    again = _generate(restarted, PROMPT)  # the index forgot the bad blocks; nothing fails twice
    assert again.error is None and _result(again) == reference[0]
    restarted.llm_engine.scheduler.check_integrity()


def test_corrupt_file_found_at_start_is_a_miss(tiny_model_dir, tmp_path, reference):
    files = _filled_tier(tiny_model_dir, tmp_path)
    for f in files:
        _corrupt(f)
    out = _generate(_make(tiny_model_dir, kv_offload_dir=str(tmp_path)), PROMPT)
    assert out.metrics.cached_tokens_by_tier["disk"] == 0 and _result(out) == reference[0]


def test_failed_writes_are_misses_that_fail_no_request(tiny_model_dir, tmp_path, reference, monkeypatch):
    from pagedllm.worker.kv_offload import DiskKVTier

    def full_disk(self, *args):
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    monkeypatch.setattr(DiskKVTier, "save", full_disk)
    llm = _make(tiny_model_dir, kv_offload_dir=str(tmp_path))
    first, again = _session(llm)
    assert first.error is None and again.error is None
    assert _result(first) == _result(again) == reference[0]
    assert again.metrics.cached_tokens_by_tier["disk"] == 0  # nothing was stored, nothing is claimed
    assert llm.llm_engine.get_stats().kv_offload_io_errors_total > 0
    assert llm.llm_engine.scheduler.kv_cache_manager.offload.num_blocks("disk") == 0
    assert not list(tmp_path.glob("*.safetensors"))


def test_a_tier_folder_with_a_fifo_is_refused(tiny_model_dir, tmp_path):
    os.mkfifo(tmp_path / "stuck.safetensors")
    with pytest.raises(ValueError, match="kv_offload_dir .*not regular files.*stuck.safetensors"):
        _make(tiny_model_dir, kv_offload_dir=str(tmp_path))


def test_the_default_disk_bound_fits_the_folder(tmp_path):
    import shutil

    from pagedllm.config import EngineConfig

    bound = EngineConfig(kv_offload_dir=str(tmp_path)).kv_offload_disk_space_bytes
    assert bound == min(8 << 30, shutil.disk_usage(tmp_path).free // 2)
    assert EngineConfig(kv_offload_dir=str(tmp_path), kv_offload_disk_space="1MiB").kv_offload_disk_space_bytes == 1 << 20

