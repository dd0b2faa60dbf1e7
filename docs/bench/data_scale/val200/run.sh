#!/bin/bash
# Issue 28's validation-share target: a 200-step quickstart-sized run on the 2,000,000-row file,
# first run (empty data cache), train.eval_batches=null (val_max_samples=256 applies).
set -u
cd /work/main; export PYTHONPATH=$PWD
D=/tmp/val200
.venv/bin/python -m cpudist.bench.chat_data $D/chat-2m.jsonl --rows 2000000 > $D/gen.log 2>&1
echo "== start $(date -u +%T)"
.venv/bin/cpudist train configs/quickstart.yaml data.path=$D/chat-2m.jsonl data.cache_dir=$D/dc \
  train.max_steps=200 train.eval_batches=null train.save_every=0 output.dir=$D/run > $D/train.log 2>&1
echo "exit $? == end $(date -u +%T)"
grep -E "^time|tokenizing .* rows in|baseline evaluation|validation:|done:" $D/train.log
.venv/bin/python -c "import json,sys; s=json.load(open(sys.argv[1])); print(json.dumps({k: s.get(k) for k in ('peak_rss_gb','time')}))" $D/run/summary.json
