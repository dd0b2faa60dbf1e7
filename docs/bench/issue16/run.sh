#!/usr/bin/env bash
# Issue 16's measurements on one quiet machine (root; iproute2; Open MPI from the [mpi] extra):
# 4 fake nodes, Qwen2.5-0.5B shape cut to 4 layers, seq 512, batch 2 per rank, one rank per node,
# each node count against the same ranks over loopback (measured in the same invocation):
#   1. link 10gbit,1ms                       (target: >= 0.95 of loopback at 4 nodes)
#   2. link 100mbit,5ms, defaults            (25 MB buckets, fp32 gradients: one bucket, no overlap)
#   3. link 100mbit,5ms, 4 MB buckets + bf16 (overlap with backward, half the bytes)
# Each writes ROWS.json (one row per node count, with the model's prediction), ROWS/fake-nodes.md
# and ROWS/fake-nodes-raw.json (every bench figure of both sides) into docs/bench/issue16/.
#
#   bash docs/bench/issue16/run.sh              # from the repository root, with .venv installed
#   LAYERS=2 SEQ=64 STEPS=1 bash docs/bench/issue16/run.sh   # a smoke run (writes into smoke/)
#
# Without sch_netem in the kernel (delay, jitter, loss), the links run at their rate only; the
# files then say so in their names (…_nodelay) and NOTE.txt.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
LAYERS=${LAYERS:-4}; SEQ=${SEQ:-512}; BATCH=${BATCH:-2}; STEPS=${STEPS:-2}; WARMUP=${WARMUP:-1}
NODES=${NODES:-4}
OUT=docs/bench/issue16
if [ "$LAYERS/$SEQ/$STEPS" != "4/512/2" ]; then OUT=$OUT/smoke; fi
mkdir -p "$OUT"

# Does this kernel delay packets (netem)? One 2-node cluster, made and removed.
delay=yes
if ! "$PY" - <<'PY' 2>"$OUT/netem-probe.txt"
from cpudist.launch import netns
with netns.fake_cluster(2, prefix=netns.own_prefix("cpdp"), link=netns.parse_link("1gbit,1ms")):
    pass
PY
then
  delay=no
  echo "no netem on $(uname -r): links below are rate-only ($(tail -1 "$OUT/netem-probe.txt"))" \
    | tee "$OUT/NOTE.txt"
fi
link() {  # RATE DELAY -> the --link value and a file-name tag
  if [ "$delay" = yes ]; then echo "$1,$2 ${1}_$2"; else echo "$1 ${1}_nodelay"; fi
}

bench=(--preset qwen2.5-0.5b --layers "$LAYERS" --seq-len "$SEQ" --batch-size "$BATCH"
       --warmup "$WARMUP" --steps "$STEPS")
run() {  # NAME LINK [overrides...]
  local name=$1 spec=$2; shift 2
  echo "== $name: --link $spec $*"
  local started=$SECONDS
  "$PY" -m cpudist.cli scaling --fake-nodes "$NODES" --link "$spec" --predict "${bench[@]}" "$@" \
    --out "$OUT/$name" --json "$OUT/$name.json"
  echo "== $name took $((SECONDS - started)) s"
}

read -r fast fast_tag <<<"$(link 10gbit 1ms)"
read -r slow slow_tag <<<"$(link 100mbit 5ms)"
run "link_${fast_tag}" "$fast"
run "link_${slow_tag}" "$slow"
run "link_${slow_tag}_bucket4_bf16" "$slow" dist.bucket_cap_mb=4 dist.grad_compression=bf16
"$PY" -m cpudist.cli scaling --predict > "$OUT/predicted_xeon.md"
echo "written: $OUT/ (total $SECONDS s)"
