#!/bin/bash
# As run for docs/PERFORMANCE.md "Data at scale" (under flock -x /work/bench.lock): $1 is the
# row count's name (2m); /tmp/wt28c/snap was a copy of the worktree at its HEAD with .venv and
# .cache linked. First run (tokenize) then the cached run of the quickstart on chat-$1.jsonl, 2
# steps, with train.eval_batches=null; then a cached run with the quickstart's own eval_batches.
set -u
cd /tmp/wt28c/snap; export PYTHONPATH=$PWD
N=$1
D=/work/wt-28c/.bench-data
C=$D/dc-$N; rm -rf $C $D/r-$N-*
B=".venv/bin/python -m cpudist.bench.chat_data --time-run -- .venv/bin/cpudist train configs/quickstart.yaml data.path=$D/chat-$N.jsonl data.cache_dir=$C train.max_steps=2 train.save_every=0"
echo "$B train.eval_batches=null output.dir=$D/r-$N-{first,cached}; then cached-quickstart-eval without train.eval_batches=null"
for run in first cached cached-quickstart-eval; do
  echo "== $run $(date -u +%T)"
  extra="train.eval_batches=null"; [ $run = cached-quickstart-eval ] && extra=""
  $B $extra output.dir=$D/r-$N-$run > /tmp/wt28c/$N-$run.log 2>&1
  grep -E "^time|^time-run|tokenizing .* rows in|baseline evaluation|validation:|done:" /tmp/wt28c/$N-$run.log
  .venv/bin/python -c "import json,sys; s=json.load(open(sys.argv[1])); print(json.dumps({k: s.get(k) for k in ('peak_rss_gb','time','val_loss_before')}))" $D/r-$N-$run/summary.json
done
du -sh $C
echo "== end $(date -u +%T)"
