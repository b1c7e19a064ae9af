#!/usr/bin/env bash
# Past HBM on one GPU, in one call of about eight minutes: the 9.7 B GPT (48 x 4096, 155 GB of state) paged over
# HBM and pinned host memory, 5 timed steps after 3 of warm-up, with its build time, plan, pinned host limit and
# peak RSS, appended to experiments/results/paged_gpu_rungs_gpu.jsonl (then gpt_13b if time is left).
#
#   bash experiments/bench/gpu_past_hbm.sh          # from the repository root; jax with CUDA installed
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export GLIBC_TUNABLES="${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1}"
PY="${PYTHON:-python3}"
"$PY" -c "import jax, sys; sys.exit(jax.devices()[0].platform != 'gpu')" \
  || { echo "gpu_past_hbm.sh: no GPU visible to jax" >&2; exit 2; }
out=experiments/results/paged_gpu_rungs_gpu.jsonl
for layers in 48; do
  echo "== paged_host $layers layers (limit 420 s)"
  t0=$SECONDS
  timeout -s KILL 420 "$PY" experiments/bench/paged_gpu.py --rung paged_host "$layers" --steps 5 2>&1 \
    | tee /dev/stderr | grep '^{' >>"$out"
  echo "   exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s; free -g: $(free -g | awk '/Mem/ {print $3 " used, " $7 " available"}')"
done
