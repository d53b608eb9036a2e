#!/bin/bash
# The demo runs bench/plan_check.py checks `asyncrl plan` against (docs/benchmarks.md, "The capacity planner"): the
# CPU demo as shipped (configs/demo_cpu.yaml), 60 steps, with 1 and 2 generators at eta = 0, 1, 2, for each seed
# given.
# Usage: bash bench/plan_runs.sh OUT_DIR [SEED ...]   (about 35 s a run on 2 cores)
# then:  python -m asyncrl.bench.plan_check --calibrate OUT_DIR/s0-g1-eta1 --runs OUT_DIR/s0-g*-eta*
set -u
out=${1:?usage: bash bench/plan_runs.sh OUT_DIR [SEED ...]}
shift
seeds=${*:-0}
mkdir -p "$out"
for seed in $seeds; do
  for generators in 1 2; do
    for eta in 0 1 2; do
      name=s$seed-g$generators-eta$eta
      rm -rf "${out:?}/$name"
      ASYNCRL_JOB_DIR="$out/$name" asyncrl run --generators "$generators" job.seed="$seed" \
        buffer.max_staleness="$eta" learner.total_steps=60 > "$out/$name.out" 2>&1
      echo "$name: exit $? at $(date +%T)"
    done
  done
done
