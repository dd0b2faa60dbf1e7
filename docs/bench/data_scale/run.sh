#!/bin/bash
# As run for docs/PERFORMANCE.md "Data at scale" (under flock -x /work/bench.lock): $1 is 200k or 2m;
# /tmp/wt28b/snap was a copy of the worktree at 9bfdbef with .venv and .cache linked.
# Data at scale: first run (tokenize) then cached run of the quickstart on chat-$1.jsonl, 2 steps.
set -u
cd /tmp/wt28b/snap; export PYTHONPATH=$PWD  # a copy of wt-28b at its HEAD (.venv, .cache linked)
N=$1
C=/tmp/wt28b/dc-$N; rm -rf $C /tmp/wt28b/r-$N-*
B=".venv/bin/python -m cpudist.bench.chat_data --time-run -- .venv/bin/cpudist train configs/quickstart.yaml data.path=/tmp/wt28b/chat-$N.jsonl data.cache_dir=$C train.max_steps=2 train.eval_batches=null train.save_every=0"
echo "$B output.dir=/tmp/wt28b/r-$N-{first,cached}"
for run in first cached; do
  echo "== $run $(date -u +%T)"
  $B output.dir=/tmp/wt28b/r-$N-$run > /tmp/wt28b/$N-$run.log 2>&1
  grep -E "^time|^time-run|tokenizing .* rows in|validation:|done:" /tmp/wt28b/$N-$run.log
  .venv/bin/python -c "import json,sys; s=json.load(open(sys.argv[1])); print(json.dumps({k: s.get(k) for k in ('peak_rss_gb','time','data')}))" /tmp/wt28b/r-$N-$run/summary.json
done
du -sh $C
echo "== end $(date -u +%T)"
