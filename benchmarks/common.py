"""Shared helpers of the benchmark scripts: the result record, the machine, the workloads.

Every benchmark is a short script with a fixed seed, a warm-up, one result line on
stdout, and a JSON record in ``benchmarks/results/`` (plus a PNG where a comparison is
easier seen than read). Scripts import this module as ``common`` (they run as
``python benchmarks/<name>.py``, which puts ``benchmarks/`` first on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
REPO_ROOT = BENCH_DIR.parent

# Token ids 0..16 of SmolLM2's vocabulary are special tokens (<|endoftext|>, <|im_start|>,
# <|im_end|>, <repo_name>, ...); synthetic prompts draw ordinary ids above them.
FIRST_ORDINARY_TOKEN_ID = 17
SMOLLM2_VOCAB_SIZE = 49152


def machine_info() -> dict[str, Any]:
    """CPU model, core count, torch version and threads, and the ISA flags that matter here."""
    cpu_model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and cpu_model in ("unknown", ""):
                    cpu_model = line.split(":", 1)[1].strip()
                elif line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu_model,
        "num_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()],
        "isa": sorted(f for f in flags if f in {"avx2", "avx512f", "avx512_bf16", "avx512_vnni",
                                                  "amx_tile", "amx_bf16", "amx_int8"}),
        # Thread settings every process of the run inherits (peers included): OMP_WAIT_POLICY
        # decides whether idle OpenMP threads spin, which matters on a shared 2-core machine.
        "thread_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "KMP_", "MKL_"))},
    }
    if "torch" in sys.modules or _can_import("torch"):
        import torch
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return info


def _can_import(name: str) -> bool:
    try:
        __import__(name)
        return True
    except ImportError:
        return False


def write_result(name: str, record: dict[str, Any], out: str | Path | None = None) -> Path:
    """Write ``record`` (plus timestamp and machine) as JSON to ``out`` or ``results/<name>.json``.

    Returns the path written. The record must be JSON-serializable (numbers, strings,
    lists, dicts).
    """
    path = Path(out) if out is not None else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    full = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine_info(), "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            **record}
    path.write_text(json.dumps(full, indent=2) + "\n")
    return path


def plot_path(json_path: Path) -> Path:
    """The PNG that goes with a JSON record (same stem)."""
    return json_path.with_suffix(".png")


# ---- workloads ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """A seeded list of requests: prompt token ids and the exact number of output tokens.

    ``prompts[i]`` is a list of token ids; ``output_lens[i]`` the tokens request i must
    generate (every system runs with EOS ignored, so each produces exactly that many).
    """

    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def summary(self) -> dict[str, Any]:
        """Counts and length statistics, for the JSON record."""
        p = np.array([len(x) for x in self.prompts])
        o = np.array(self.output_lens)
        return {"name": self.name, "num_requests": self.num_requests,
                "num_prompt_tokens": int(p.sum()), "num_output_tokens": int(o.sum()),
                "prompt_len": {"min": int(p.min()), "median": float(np.median(p)), "mean": float(p.mean()), "max": int(p.max())},
                "output_len": {"min": int(o.min()), "median": float(np.median(o)), "mean": float(o.mean()), "max": int(o.max())}}


def random_prompts(rng: np.random.Generator, lens: np.ndarray, vocab_size: int = SMOLLM2_VOCAB_SIZE) -> list[list[int]]:
    """One prompt of ordinary (non-special) random token ids per entry of ``lens``."""
    return [rng.integers(FIRST_ORDINARY_TOKEN_ID, vocab_size, size=int(n)).tolist() for n in lens]


def with_fresh_prompts(wl: "Workload", round_index: int, seed: int = 0) -> "Workload":
    """``wl`` for repeat ``round_index``: round 0 is ``wl`` itself; a later round has new random
    prompts of the same lengths (same output lengths), so no repeat finds an earlier repeat's
    prompts in an engine's prefix cache (both pagedllm and vLLM cache by default, and an engine
    kept loaded across repeats would otherwise skip every prefill after the first round)."""
    if round_index == 0:
        return wl
    rng = np.random.default_rng([seed, round_index, 0x5EED])
    return Workload(wl.name, random_prompts(rng, np.array([len(p) for p in wl.prompts])), list(wl.output_lens))


def heavy_tailed_lens(rng: np.random.Generator, n: int, lo: int, hi: int, median: float, sigma: float) -> np.ndarray:
    """``n`` lengths from a log-normal (median ``median``, shape ``sigma``), clipped to [lo, hi].

    A log-normal is the usual fit to LLM output lengths (most answers short, a long
    tail of long ones). Returns int64 array of shape (n,).
    """
    x = rng.lognormal(mean=np.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(x), lo, hi).astype(np.int64)


def high_load_workload(num_requests: int = 256, seed: int = 0, prompt_min: int = 20, prompt_max: int = 500,
                       output_min: int = 8, output_max: int = 512, output_median: float = 64.0,
                       output_sigma: float = 1.0) -> Workload:
    """The throughput benchmark's trace: prompts uniform in [20, 500] tokens, outputs
    heavy-tailed (log-normal, median 64, sigma 1.0, clipped to [8, 512]); seeded."""
    rng = np.random.default_rng(seed)
    plens = rng.integers(prompt_min, prompt_max + 1, size=num_requests)
    olens = heavy_tailed_lens(rng, num_requests, output_min, output_max, output_median, output_sigma)
    return Workload("high-load", random_prompts(rng, plens), olens.tolist())


def peers_workload(num_requests: int = 32, seed: int = 0, prompt_min: int = 20, prompt_max: int = 200,
                   output_len: int = 128) -> Workload:
    """The workload of ``/work/shared/peers.md``: 32 prompts of 20–200 tokens, 128 output tokens each."""
    rng = np.random.default_rng(seed)
    plens = rng.integers(prompt_min, prompt_max + 1, size=num_requests)
    return Workload("peers", random_prompts(rng, plens), [output_len] * num_requests)


def generate_greedy(llm, prompts: list[list[int]], max_tokens: int) -> list:
    """``llm.generate`` of token-id prompts, greedy with EOS ignored (each produces exactly
    ``max_tokens``). Returns the RequestOutputs; raises RuntimeError if any failed."""
    from pagedllm import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed in the engine, first: {errors[0]}")
    return outs


def load_hf_model(gguf: str | Path, dtype: str = "float32"):
    """transformers ``LlamaForCausalLM`` holding the GGUF's dequantized weights, eval mode.

    Uses transformers' own GGUF loader when it can (it needs ``accelerate``); otherwise
    builds the model from the GGUF's config and copies in the weights as dequantized by
    ``pagedllm.loader`` (transformers parameter names; tested against the gguf library).
    Returns ``(model, weights_source)`` with ``weights_source`` naming the path taken.
    """
    import torch
    from transformers import AutoModelForCausalLM
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gguf, tdtype = Path(gguf), getattr(torch, dtype)
    try:
        import accelerate  # noqa: F401
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=tdtype)
        return model.eval(), "transformers GGUF loader"
    except ImportError:
        pass
    sys.path.insert(0, str(REPO_ROOT))
    from pagedllm.loader import load_model_files
    files = load_model_files(str(gguf))
    model = AutoModelForCausalLM.from_config(files.hf_config, dtype=tdtype)
    state = dict(files.weights(tdtype))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not files.hf_config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"weights do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()
    return model.eval(), "pagedllm.loader dequantization (accelerate not installed)"
