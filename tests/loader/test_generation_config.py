"""generation_config.json's sampling defaults: the numeric fields, do_sample false as greedy."""

import json

import pytest

from pagedllm.loader.generation_config import read_sampling_defaults


def _write(tmp_path, config):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_reads_numeric_sampling_fields_only(tmp_path):
    folder = _write(tmp_path, {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2,
                               "repetition_penalty": True, "min_p": "0.1"})
    assert read_sampling_defaults(folder) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def test_do_sample_false_is_greedy_unless_a_temperature_is_given(tmp_path):
    assert read_sampling_defaults(_write(tmp_path, {"do_sample": False})) == {"temperature": 0.0}
    assert read_sampling_defaults(_write(tmp_path, {"do_sample": False, "temperature": 0.7})) == {"temperature": 0.7}


def test_absent_file_and_bad_file(tmp_path):
    assert read_sampling_defaults(tmp_path) == {}
    with pytest.raises(ValueError, match="JSON object"):
        read_sampling_defaults(_write(tmp_path, [1, 2]))
