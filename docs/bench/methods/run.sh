#!/usr/bin/env bash
# The PEFT methods on the quickstart data: same steps, batches and tokens; each method's own
# learning rate (prompt-learning methods need a larger one). Writes one JSON per method here.
# Usage (from the repository root): bash docs/bench/methods/run.sh [OUT_ROOT]
set -euo pipefail
out_root=${1:-/tmp/cpudist-methods}
here=$(cd "$(dirname "$0")" && pwd)
declare -A lr=([lora]=1e-3 [ia3]=1e-2 [prompt_tuning]=3e-2 [p_tuning]=1e-2 [prefix_tuning]=1e-2)
for method in lora ia3 prompt_tuning p_tuning prefix_tuning; do
  out=$out_root/$method
  rm -rf "$out"
  cpudist train configs/quickstart.yaml peft.method=$method train.lr=${lr[$method]} \
    train.sample_prompts=0 output.dir="$out" 2>&1 | tee "$out_root.$method.log" | tail -3
  python - "$out" "$method" "${lr[$method]}" "$out_root.$method.log" > "$here/$method.json" <<'PY'
import json, re, statistics, sys
from pathlib import Path
out, method, lr, log = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), Path(sys.argv[4])
summary = json.loads((out / "summary.json").read_text())
steps = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]
step_s = [s["step_s"] for s in steps if "step_s" in s and s["step"] > 1]
found = re.search(r"([\d,]+) trainable parameters", log.read_text())
print(json.dumps({
    "method": method, "lr": lr,
    "trainable_params": int(found.group(1).replace(",", "")) if found else None,
    "s_per_step_median": statistics.median(step_s), "steps": summary["steps"],
    "tokens_seen": summary["tokens_seen"], "peak_rss_gb": summary["peak_rss_gb"],
    "val_loss_before": summary["val_loss_before"], "val_loss_after": summary["val_loss_after"],
    "cpu": summary["cpu"], "dtype": summary["dtype"], "threads": summary["threads_per_rank"],
}, indent=1))
PY
  cat "$here/$method.json"
done
