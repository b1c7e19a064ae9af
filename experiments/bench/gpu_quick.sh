#!/usr/bin/env bash
# The GPU figures that fit in about seven minutes on one GPU machine, each under its own time limit so that one
# slow or hung figure costs only its own slot. Results are appended to experiments/results/*_gpu.jsonl.
#
#   bash experiments/bench/gpu_quick.sh            # from the repository root; jax with CUDA installed
#
# In order: the cost model's calibration (`angel-jax bench io`, memory paths and the disk), the crossing paths
# between pinned host memory and the CPU backend (crossing.py), the host optimizer on this host's cores
# (host_optimizer.py), a model that fits HBM in auto mode against the in-memory engine (paged_gpu.py fits_auto),
# and a streamed step against its prediction (paged_step.py: 0.40 B parameters, a device budget of one eighth of
# the state, 32 of 34 stages streamed and updated on the host).
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
run 90 "bench io" "$PY" -m angel_jax.cli bench io --rounds 3 --jsonl experiments/results/io_gpu.jsonl
run 60 crossing "$PY" experiments/bench/crossing.py
run 80 host_optimizer "$PY" experiments/bench/host_optimizer.py --repeats 3
run 150 fits_auto "$PY" experiments/bench/paged_gpu.py --skip ladder beyond_hbm --rounds 3 --steps 3
run 200 paged_step "$PY" experiments/bench/paged_step.py experiments/gpt_1b.yaml model.d_model=1024 model.n_heads=8 \
  model.compute_dtype=bfloat16 model.seq_len=1024 train.batch_size=1 model.n_layers=32 memory.page_size=16777216 \
  --rounds 2 --steps 2 --warmup 1
