"""cache_salt through the engine: a prompt cached under one salt is a miss under another (and
unsalted), a hit under the same one, with the same tokens either way."""

from pagedllm import LLM, SamplingParams


def test_salted_requests_share_the_prefix_cache_only_within_their_salt(random_model_dir):
    llm = LLM(model=str(random_model_dir), max_model_len=256, num_kv_blocks=64, block_size=16)
    prompt = [5 + (j * 11) % 400 for j in range(80)]

    def run(salt=None, in_prompt=False):
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                cache_salt=None if in_prompt else salt)
        item = {"prompt_token_ids": prompt} | ({"cache_salt": salt} if in_prompt else {})
        out, = llm.generate([item], params, use_tqdm=False)
        return out.num_cached_tokens, out.outputs[0].token_ids

    cached_a, tokens = run("tenant-a")
    assert cached_a == 0
    assert run("tenant-b") == (0, tokens)
    assert run() == (0, tokens)
    assert run("tenant-a") == (64, tokens)
    assert run("tenant-b", in_prompt=True) == (64, tokens)  # vLLM's prompt-level salt: the same namespace
    assert llm.llm_engine.get_stats().num_used_blocks == 0
