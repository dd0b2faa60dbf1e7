#!/usr/bin/env bash
# Topic classification of chatterbot's questions with SmolLM2-135M + LoRA (configs/topics-classifier.yaml):
# the full bf16 run, then 8 fp32 steps on 1 rank and on 2 ranks (mpirun, same global batch).
# Usage (from the repository root): bash docs/bench/classification/run.sh [OUT_ROOT]
set -euo pipefail
out_root=${1:-/tmp/cpudist-topics}
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$out_root"
cpudist train configs/topics-classifier.yaml output.dir="$out_root/bf16" | tail -4
cp "$out_root/bf16/summary.json" "$here/bf16_summary.json"
cp "$out_root/bf16/adapter/classification.json" "$here/bf16_classification.json"
fp32=(model.dtype=float32 train.max_steps=8 train.eval_batches=2 train.global_batch=16
      train.batch_size=8)
cpudist train configs/topics-classifier.yaml "${fp32[@]}" output.dir="$out_root/fp32_1" | tail -2
cpudist launch -np 2 -- train configs/topics-classifier.yaml "${fp32[@]}" \
  output.dir="$out_root/fp32_2" | tail -2
python - "$out_root" > "$here/fp32_ranks.json" <<'PY'
import json, sys
from pathlib import Path
root = Path(sys.argv[1])
def losses(run):
    lines = (root / run / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]
one, two = losses("fp32_1"), losses("fp32_2")
print(json.dumps({"one_rank": one, "two_ranks": two, "max_rel_diff": max(
    abs(a - b) / abs(a) for a, b in zip(one, two, strict=True))}, indent=1))
PY
cat "$here/fp32_ranks.json"
