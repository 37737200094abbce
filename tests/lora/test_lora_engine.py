"""Multi-LoRA in the engine against PEFT on the same random base weights and adapters: alone and in mixed
batches (base-model rows and several adapters in one step), fused q/k/v and gate/up, rsLoRA, fewer slots
than adapters, a host LRU of one; prefix-cache isolation by adapter; the error cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.lora import LoRAError, LoRAInUseError
from tests.lora.lora_utils import peft_logprobs, write_base_folder, write_random_adapter

PROMPTS = [[1, 5, 9, 33, 100, 7, 8, 11, 12, 13], [1, 42, 43, 44], [1, 5, 9, 33, 100, 7, 8, 11, 12, 13, 3],
           [1, 200, 201]]
FUSED_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # Phi-3's checkpoint names


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_llama")
    base, folder = write_base_folder("llama", d / "base")
    adapters = {"a1": write_random_adapter(base, d / "a1", seed=1, r=8, alpha=16),
                "a2": write_random_adapter(base, d / "a2", seed=2, r=4, alpha=8, use_rslora=True),
                "a3": write_random_adapter(base, d / "a3", seed=3, r=8, targets=["q_proj", "v_proj", "down_proj"])}
    return base, folder, adapters


def _llm(folder, **kw):
    kw = dict(enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=96, block_size=4, max_model_len=64) | kw
    return LLM(model=str(folder), **kw)


def _check_against_peft(base, outputs, prompts, adapters: list[Path | None]) -> None:
    """Each output's tokens are PEFT's greedy choice and their logprobs PEFT's (teacher-forced, float32)."""
    for prompt, adapter, out in zip(prompts, adapters, outputs):
        completion = out.outputs[0]
        ref = peft_logprobs(base, adapter, prompt + list(completion.token_ids))
        n = len(prompt)
        for j, token in enumerate(completion.token_ids):
            assert token == int(ref[n - 1 + j].argmax()), (adapter, j)
            assert abs(completion.logprobs[j][token].logprob - ref[n - 1 + j, token].item()) < 1e-4, (adapter, j)


def _greedy(max_tokens: int = 5) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0)


def test_mixed_batch_equals_peft(llama):
    base, folder, adapters = llama
    llm = _llm(folder, max_loras=3)
    names = ["a1", None, "a2", "a3"]
    loras = [None if n is None else LoRARequest(n, i + 1, str(adapters[n])) for i, n in enumerate(names)]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(), use_tqdm=False, lora_request=loras)
    _check_against_peft(base, outs, PROMPTS, [None if n is None else adapters[n] for n in names])


def test_merged_and_unmerged_peft_agree(llama):
    base, _, adapters = llama
    ids = PROMPTS[0]
    torch.testing.assert_close(peft_logprobs(base, adapters["a1"], ids), peft_logprobs(base, adapters["a1"], ids,
                                                                                        merged=True),
                               rtol=0, atol=1e-4)


def test_fewer_slots_than_adapters_and_host_lru_of_one(llama):
    """max_loras=1: requests of the second adapter wait for a slot; max_cpu_loras=1 reads adapters again."""
    base, folder, adapters = llama
    llm = _llm(folder, max_loras=1, max_cpu_loras=1)
    names = ["a1", "a2", "a1", "a2"]
    loras = [LoRARequest(n, int(n[1]), str(adapters[n])) for n in names]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(), use_tqdm=False, lora_request=loras)
    _check_against_peft(base, outs, PROMPTS, [adapters[n] for n in names])
    manager = llm.llm_engine.runner.lora_manager
    assert len(manager.host) == 1 and len(manager.slot_of) == 1


@pytest.mark.parametrize("family", ["qwen2", "phi3"])
def test_other_families_equal_peft(family, tmp_path):
    """Qwen 2 (q/k/v biases, a sliding layer), Phi-3 (fused q/k/v and gate/up in the checkpoint itself)."""
    base, folder = write_base_folder(family, tmp_path / "base")
    targets = FUSED_TARGETS if family == "phi3" else None
    adapter = write_random_adapter(base, tmp_path / "a", seed=5, r=8, targets=targets)
    llm = _llm(folder)
    loras = [LoRARequest("a", 1, str(adapter)), None]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], _greedy(), use_tqdm=False,
                        lora_request=loras)
    _check_against_peft(base, outs, PROMPTS[:2], [adapter, None])


def test_prefix_cache_is_keyed_by_adapter(llama):
    _, folder, adapters = llama
    llm = _llm(folder)
    a1, a2 = LoRARequest("a1", 1, str(adapters["a1"])), LoRARequest("a2", 2, str(adapters["a2"]))
    prompt = {"prompt_token_ids": PROMPTS[0]}
    params = SamplingParams(temperature=0, max_tokens=1)
    cached = [llm.generate(prompt, params, use_tqdm=False, lora_request=lr)[0].num_cached_tokens
              for lr in (a1, a2, None, a1, a2, None)]
    assert cached[:3] == [0, 0, 0]  # no adapter (nor the base model) reads another's blocks
    assert min(cached[3:]) >= 8  # within one adapter: the two full blocks are hits
    llm.llm_engine.scheduler.check_integrity()


def test_unload_refuses_while_requests_run_and_ids_never_shared(llama):
    _, folder, adapters = llama
    llm = _llm(folder)
    engine = llm.llm_engine
    a1 = LoRARequest("a1", 1, str(adapters["a1"]))
    engine.add_request("r", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=3), lora_request=a1)
    with pytest.raises(LoRAInUseError):
        engine.remove_lora("a1")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.remove_lora("a1") == a1
    assert engine.list_loras() == [] and engine.runner.list_loras() == []
    with pytest.raises(LoRAError, match="no adapter named"):
        engine.remove_lora("a1")


def _broken(src: Path, dst: Path, config: dict | None = None, tensors=None) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text()) | (config or {})
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    weights = load_file(src / "adapter_model.safetensors")
    save_file(tensors(weights) if tensors else weights, dst / "adapter_model.safetensors")
    return dst


def _drop_one(w):
    return {k: v for k, v in w.items() if not k.endswith("layers.1.mlp.up_proj.lora_B.weight")}


def _wrong_shape(w):
    return {k: (v[:, :-1].contiguous() if k.endswith("layers.0.self_attn.o_proj.lora_A.weight") else v)
            for k, v in w.items()}


def _unknown_module(w):
    return {k.replace("layers.1.", "layers.7."): v for k, v in w.items()}


@pytest.mark.parametrize("case,match", [
    ("rank", "above max_lora_rank=4"), ("missing", "missing .*layers.1.mlp.up_proj.lora_B.weight"),
    ("shape", "o_proj.lora_A.weight has shape"), ("config", "r must be an integer"),
    ("unknown", "layers.7.*no LoRA-capable projection"), ("no_folder", "is not a folder"),
    ("dora", "use_dora"),
])
def test_bad_adapters_are_refused_naming_the_problem(llama, tmp_path, case, match):
    base, folder, adapters = llama
    src = adapters["a2"]  # rank 4
    paths = {"rank": lambda: adapters["a1"], "missing": lambda: _broken(src, tmp_path / "m", tensors=_drop_one),
             "shape": lambda: _broken(src, tmp_path / "s", tensors=_wrong_shape),
             "config": lambda: _broken(src, tmp_path / "c", config={"r": "eight"}),
             "unknown": lambda: _broken(src, tmp_path / "u", tensors=_unknown_module),
             "no_folder": lambda: tmp_path / "absent", "dora": lambda: _broken(src, tmp_path / "d", {"use_dora": True})}
    llm = _bad_adapter_llm(folder)
    assert llm.list_loras() == []
    path = str(paths[case]())
    with pytest.raises(ValueError, match=match):  # LLM.generate names the prompt; the engine raises LoRAError
        llm.generate({"prompt_token_ids": PROMPTS[1]}, _greedy(), use_tqdm=False,
                     lora_request=LoRARequest("bad", 9, path))
    with pytest.raises(LoRAError, match=match):
        llm.llm_engine.add_lora(LoRARequest("bad", 9, path))
    out = llm.generate({"prompt_token_ids": PROMPTS[1]}, _greedy(), use_tqdm=False,
                       lora_request=LoRARequest("a2", 2, str(adapters["a2"])))  # still serving
    _check_against_peft(base, out, PROMPTS[1:2], [adapters["a2"]])
    llm.remove_lora("a2")


_LLMS: dict = {}


def _bad_adapter_llm(folder):
    """One engine (max_lora_rank 4) shared by the error cases."""
    if folder not in _LLMS:
        _LLMS[folder] = _llm(folder, max_lora_rank=4)
    return _LLMS[folder]


def test_lora_request_needs_enable_lora(llama):
    _, folder, adapters = llama
    llm = LLM(model=str(folder), num_kv_blocks=32, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate({"prompt_token_ids": PROMPTS[1]}, _greedy(), use_tqdm=False,
                     lora_request=LoRARequest("a1", 1, str(adapters["a1"])))


def test_lora_config_errors_name_the_field():
    from pagedllm.config import EngineConfig

    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        EngineConfig(lora_modules=["a=/x"])
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="lora_modules entries must be name=path"):
        EngineConfig(enable_lora=True, lora_modules=["a"])
    with pytest.raises(ValueError, match="lora_allowed_dirs"):
        EngineConfig(enable_lora=True, allow_runtime_lora_updating=True)
    assert EngineConfig(enable_lora=True, lora_modules=["a=/x", "b=/y"]).lora_module_paths() == {"a": "/x", "b": "/y"}


def _dequantized_hf_copy(base, model):
    """``base`` (transformers) with the engine's quantized projections' dequantized weights."""
    import copy

    hf = copy.deepcopy(base)
    params = dict(hf.named_parameters())
    split = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    with torch.no_grad():
        for path, module in model.named_modules():
            if getattr(module, "quant_method", None) is None:
                continue
            weight = module.quant_method.dequantize(module).float()
            parent, _, leaf = path.rpartition(".")
            names = split.get(leaf, (leaf,))
            sizes = getattr(module, "output_sizes", [weight.shape[0]])
            for name, part in zip(names, weight.split(sizes, dim=0)):
                params[f"{parent}.{name}.weight".lstrip(".")].copy_(part)
    return hf


def test_quantized_base_keeps_the_adapter_in_activation_dtype(llama):
    """int8 base weights: the adapter runs in float32 over them; equal to PEFT over the dequantized weights."""
    base, folder, adapters = llama
    llm = _llm(folder, quantization="int8")
    loras = [LoRARequest("a1", 1, str(adapters["a1"])), None]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], _greedy(), use_tqdm=False, lora_request=loras)
    layer = llm.llm_engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.quant_method is not None and layer.lora.lora_a_t.dtype == torch.float32
    _check_against_peft(_dequantized_hf_copy(base, llm.llm_engine.runner.model), outs, PROMPTS[:2],
                        [adapters["a1"], None])


def test_cli_flags_derive_from_the_fields():
    import argparse

    from pagedllm.entrypoints.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--enable-lora", "--lora-modules", "a=/d1", "b=/d2", "--max-loras", "4",
                              "--allow-runtime-lora-updating", "--lora-allowed-dirs", "/adapters"])
    config = engine_config_from_args(args)
    assert config.lora_module_paths() == {"a": "/d1", "b": "/d2"} and config.max_loras == 4
    assert config.lora_allowed_dirs == ["/adapters"] and config.resolved_max_cpu_loras == 4


def test_planner_counts_the_adapter_slots(llama):
    from pagedllm import plan

    _, folder, _ = llama
    llm = _llm(folder, max_loras=3)
    p = plan(str(folder), enable_lora=True, max_loras=3, max_lora_rank=8, max_model_len=64)
    assert p.lora_bytes == llm.llm_engine.runner.lora_manager.slot_bytes > 0
    assert "LoRA slots" in p.render()


def test_chat_takes_the_adapter(llama):
    base, folder, adapters = llama
    llm = _llm(folder)
    a1 = LoRARequest("a1", 1, str(adapters["a1"]))
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    out = llm.chat([{"role": "user", "content": "t5 t9 t33 t100"}], _greedy(), use_tqdm=False,
                   chat_template=template, lora_request=a1)
    ids = llm.get_tokenizer().encode("t5 t9 t33 t100 ", add_special_tokens=False)
    _check_against_peft(base, out, [ids], [adapters["a1"]])


def test_speculative_decoding_with_mixed_adapters_equals_peft(llama):
    """Verify steps (1 + k rows per request) ordered by adapter keep each row's adapter: greedy tokens
    and logprobs are still PEFT's with n-gram drafts on (prompts that repeat, so drafts are made)."""
    base, folder, adapters = llama
    llm = _llm(folder, max_loras=3, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                        "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    prompts = [p * 3 for p in PROMPTS]
    names = ["a1", None, "a2", "a3"]
    loras = [None if n is None else LoRARequest(n, i + 1, str(adapters[n])) for i, n in enumerate(names)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(8), use_tqdm=False, lora_request=loras)
    _check_against_peft(base, outs, prompts, [None if n is None else adapters[n] for n in names])
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
