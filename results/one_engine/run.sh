#!/bin/sh
# The cost table and the demo benchmark on 51c52d1 (before: one-shot generation, the benchmark and the budget ran
# their own programs) and on this branch (after: all of them drive the engine), alternately, on one machine.
# usage: sh results/one_engine/run.sh BEFORE_CHECKOUT AFTER_CHECKOUT OUT_DIR
# PYTHON: the interpreter with the project installed (default: python)
set -e
before=$1; after=$2; out=$3; py=${PYTHON:-python}
for n in 1 2; do
  for side in before after; do
    eval dir=\$$side
    (cd "$dir" && "$py" -m instruments.cost_table --target demo/target --draft demo/eagle3 \
      --questions data/eval/mt_bench.jsonl --limit 4 --envelopes 5/4/1,4/3/1 --batches 1 --max-new-tokens 128 \
      --json "$out/cost_${side}_$n.json" > "$out/cost_${side}_$n.txt" 2>&1)
    (cd "$dir" && "$py" -m infer.benchmark --questions data/eval/mt_bench.jsonl --limit 4 \
      --target demo/target --draft demo/eagle3 --total-tokens 5 --depth 4 --tree-top-k 1 --max-new-tokens 128 \
      --quiet --json "$out/benchmark_${side}_$n.json" > "$out/benchmark_${side}_$n.txt" 2>&1)
  done
done
