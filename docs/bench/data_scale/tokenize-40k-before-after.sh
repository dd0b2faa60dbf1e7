set -e
F=/work/wt-28c/.bench-data/chat-40k.jsonl
for round in 1 2; do
  for code in before after; do
    if [ $code = before ]; then P=/tmp/old28; else P=/tmp/wt28c/snap; fi
    cd $P
    echo "== $code (round $round; $P, $(test -f cpudist/data/chat_spans.py && echo one-render || echo per-prefix))"
    PYTHONPATH=$P .venv/bin/python -m cpudist.bench.chat_data $F --tokenize 1 2 2>&1 | grep -v "^\s*$" | tail -2
  done
done
