#!/usr/bin/env bash
# The prepared device check: on a machine with an NVIDIA GPU, in the repository root,
#
#     bash scripts/gpu_check.sh            # about 5-8 minutes
#
# A GPU machine with no registry access needs the few pure-Python packages the check uses
# that its image may lack, as wheels in .whl/: fetch them first where pip works with
#
#     bash scripts/gpu_check.sh --fetch-wheels     # writes .whl/ (git-ignored; carry it along)
#
# 1. checks the setup: a CUDA build of torch that sees the GPU, and triton (both come with
#    CUDA torch); installs nothing else beyond the project's own dependencies, and only
#    when one is missing (from wheels in .whl/ when that folder exists: machines with no
#    registry access), never touching torch;
# 2. runs the GPU-marked tests and the Triton kernel tests on the GPU;
# 3. benchmarks/gpu_attention.py: decode attention bandwidth vs peak, prefill TFLOP/s;
# 4. benchmarks/gpu_throughput.py: engine throughput, SmolLM2 and a ~1B Llama shape,
#    CUDA graphs vs eager.
# Results (JSON, logs) go to benchmarks/results/gpu/ (or $GPU_RESULTS_DIR). Each stage has
# its own time limit so the whole check ends within 8 minutes; a failing stage is reported
# and the next one still runs; the exit status is non-zero if any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
# what the check imports beyond torch/triton (the server's packages are not needed)
NEEDED="numpy transformers tokenizers gguf safetensors jinja2 tqdm pytest"
if [ "${1:-}" = "--fetch-wheels" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: -d .whl gguf && ls .whl
  exit $?
fi
OUT=${GPU_RESULTS_DIR:-benchmarks/results/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    PY=.venv/bin/python
  else
    PY=python3
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv \
  | tee "$OUT/nvidia_smi.txt" || { echo "gpu_check: nvidia-smi failed: no NVIDIA GPU here"; exit 2; }
if ! $PY -c "import torch, triton; assert torch.cuda.is_available(), 'torch does not see a GPU'; \
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"; then
  echo "gpu_check: needs a CUDA build of torch and triton in $PY"; exit 2
fi

# the project's own dependencies the check needs, only those missing (torch is never reinstalled)
missing=$($PY -c "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))" $NEEDED)
if [ -n "$missing" ]; then
  echo "gpu_check: installing missing dependencies: $missing"
  if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --target /tmp/gpu_check_site .whl/*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/gpu_check_site"
  else
    $PY -m pip install -q $missing
  fi
fi

status=0
stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || status=1
}

: > "$OUT/summary.txt"
stage tests 200 $PY -m pytest -q -p no:cacheprovider -m "gpu or not slow" \
  tests/test_gpu.py tests/test_triton_attention.py tests/test_cuda_graph.py tests/test_memory_profiler.py \
  tests/test_flashinfer_backend.py --junitxml="$OUT/tests.xml"
stage attention 100 $PY benchmarks/gpu_attention.py --out "$OUT/attention.json"
stage throughput 170 $PY benchmarks/gpu_throughput.py --out "$OUT/throughput.json"
cat "$OUT/summary.txt"
exit $status
