#!/usr/bin/env bash
# The GPU figures that fit in under eight minutes on one GPU machine, each under its own time limit so that one
# slow or hung figure costs only its own slot. Results are appended to experiments/results/*_gpu.jsonl (each
# script's --write, or bench io's --jsonl).
#
#   bash experiments/bench/gpu_quick.sh            # from the repository root; jax with CUDA installed
#
# In order: the host optimizer on this host's cores (host_optimizer.py: the fused kernel's bytes/s, the figure
# that bounds every streamed plan), ZeRO-3 pages over a mesh of this one GPU with streamed stages against the
# unsharded paged engine (zero_gpu.py: the sharded stage functions, each rank's host updates crossing to the CPU
# backend shard by shard; the losses of both and whether they match), gpt_1b at 32 x 2048 tokens per step in
# memory and paged with a quarter of its state on the device (paged_gpu.py quarter_state: tokens/s and MFU of
# each, paged / in-memory), the cost model's calibration (`angel-jax bench io`, memory paths and the disk), and a
# model that fits HBM in auto mode against the in-memory engine (paged_gpu.py fits_auto): at most 475 s of limits. quarter_state also gives a streamed step
# against its prediction (the earlier paged_step.py and crossing.py figures: run them alone). Afterwards, on any
# machine:
#   python experiments/bench/calibration.py --write && python experiments/bench/paper_plans.py --write
# rebuild experiments/results/h200_calibration.json from these measurements and the plans on it.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export GLIBC_TUNABLES="${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1}"  # as `angel-jax launch` starts its workers
PY="${PYTHON:-python3}"
"$PY" -c "import jax, sys; sys.exit(jax.devices()[0].platform != 'gpu')" \
  || { echo "gpu_quick.sh: no GPU visible to jax (these figures go to *_gpu.jsonl)" >&2; exit 2; }
run() {  # run LIMIT_S NAME COMMAND...: one figure under its own limit
  local limit=$1 name=$2; shift 2
  echo "== $name (limit ${limit} s)"
  local t0=$SECONDS
  timeout -s KILL "$limit" "$@" 2>&1 | grep -E '^\{|Error|error' | cut -c1-400
  echo "   $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
}
run 60 host_optimizer "$PY" experiments/bench/host_optimizer.py --repeats 3 --write
run 70 zero3_one_gpu "$PY" experiments/bench/zero_gpu.py --steps 4 --write
run 200 quarter_state "$PY" experiments/bench/paged_gpu.py --skip fits_auto ladder beyond_hbm --rounds 2 --steps 1 --write
run 45 "bench io" "$PY" -m angel_jax.cli bench io --rounds 2 --jsonl experiments/results/io_gpu.jsonl
run 100 fits_auto "$PY" experiments/bench/paged_gpu.py --skip quarter_state ladder beyond_hbm --rounds 3 --steps 3 --write
