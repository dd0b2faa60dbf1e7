"""The 4-fake-node rows of a folder (this one, or the one named as the argument) against
loopback and the scaling model; writes model_vs_measured.txt and scaleout.png there.

  python model_vs_measured.py [FOLDER "MACHINE"]

One exclusive hold ran the same 4 ranks over loopback first (loopback.json): 4 ranks sharing this
machine's 2 cores, as on the fake nodes, so the efficiency (tokens/s over loopback's) is what the
link costs on top of the shared cores. Two predictions per
row: (a) from the loopback step (its compute, the row's own bucket size and compression:
the model adds the link, as `cpudist scaling --fake-nodes --predict` does), (b) from the row's own
compute (its step less the exposed allreduce and the waits: only the link is predicted).
DDP's last bucket is the one the bench measured (comm_last_bucket_mb), or in files written before
it was measured the tied embedding's gradient (the scaling model's figure for the shape)."""
import dataclasses
import json
import sys
from pathlib import Path

from cpudist.bench import scaling_model as m
from cpudist.records import BenchResult

here = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
machine = sys.argv[2] if len(sys.argv) > 2 else "Zen 4, 2 cores"
RATES = {"10gbit": 10e9, "1gbit": 1e9}
HOLDS = (("loopback.json", "10gbit.json"), ("loopback.json", "1gbit.json"))


def profile(result: BenchResult) -> m.StepProfile:
    measured = m.profile_from_bench(result)
    if measured.last_bucket_bytes:
        return measured
    wire = 2 if result.config["dist"]["grad_compression"] == "bf16" else 4
    return dataclasses.replace(measured, last_bucket_bytes=m.embedding_gradient_bytes(
        "smollm2-135m") * wire / 4)


def load(name: str) -> list[tuple[dict, BenchResult]]:
    return [(e["row"], BenchResult.from_json(e["result"]))
            for e in json.loads((here / name).read_text())]


lines, rows = [], []
for loop_name, link_name in HOLDS:
    (_, loop), = load(loop_name)
    base = profile(loop)
    if link_name == HOLDS[0][1]:
        lines.append(f"{loop_name}: loopback {loop.tokens_per_s:.1f} tokens/s, "
                     f"{loop.s_per_step:.2f} s/step, exposed {loop.comm_exposed_s_per_step:.2f} s, "
                     f"peak RSS {max(loop.peak_rss_gb):.2f} GB")
    for row, res in load(link_name):
        dist = res.config["dist"]
        wire = 2 if dist["grad_compression"] == "bf16" else 4
        own = profile(res)
        from_loop = dataclasses.replace(base, wire_bytes=own.wire_bytes,
                                        bucket_bytes=own.bucket_bytes,
                                        last_bucket_bytes=own.last_bucket_bytes)
        rate = RATES[row["link"]]
        a, b = (m.predict(p, res.world_size, 1, rate, 0.0) for p in (from_loop, own))
        eff = res.tokens_per_s / loop.tokens_per_s
        rows.append({"link": row["link"], "setting": row["setting"], "tokens_per_s": res.tokens_per_s,
                     "loopback": loop.tokens_per_s, "efficiency": eff,
                     "predicted_from_loopback": a.tokens_per_s, "predicted_own_compute": b.tokens_per_s,
                     "exposed_s": res.comm_exposed_s_per_step, "mb": res.comm_mb_per_step,
                     "peak_rss_gb": max(res.peak_rss_gb)})
        lines.append(
            f"{row['link']} {row['setting']} ({dist['bucket_cap_mb']:g} MB, {wire * 8}-bit): "
            f"{res.tokens_per_s:.1f} tokens/s = {eff:.3f} of loopback; step {res.s_per_step:.2f} s, "
            f"exposed {res.comm_exposed_s_per_step:.2f} s (model {a.exposed_comm_s:.2f}), "
            f"compute {own.compute_s:.2f} s, {res.comm_mb_per_step:.0f} MB "
            f"(last bucket {own.last_bucket_bytes / 1e6:.0f}); "
            f"model from loopback {a.tokens_per_s:.1f} ({a.tokens_per_s / res.tokens_per_s - 1:+.1%}), "
            f"from own compute {b.tokens_per_s:.1f} ({b.tokens_per_s / res.tokens_per_s - 1:+.1%}); "
            f"peak RSS {max(res.peak_rss_gb):.2f} GB")
by = {(r["link"], r["setting"]): r for r in rows}
if ("1gbit", "plain") in by:
    plain = by["1gbit", "plain"]
    loss = plain["loopback"] - plain["tokens_per_s"]
    for name in ("overlap", "bf16"):
        if ("1gbit", name) in by and loss > 0:
            got = by["1gbit", name]["tokens_per_s"] - plain["tokens_per_s"]
            lines.append(f"1gbit {name}: recovers {got / loss:.0%} of the {loss:.1f} tokens/s "
                         f"that plain fp32 buckets lose against loopback")
(here / "model_vs_measured.txt").write_text("\n".join(lines) + "\n")
print("\n".join(lines))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

fig, ax = plt.subplots(figsize=(8, 4))
labels = [f"{r['link']}\n{r['setting']}" for r in rows]
x = range(len(rows))
ax.bar([i - 0.2 for i in x], [r["tokens_per_s"] for r in rows], 0.4, label="measured")
ax.bar([i + 0.2 for i in x], [r["predicted_from_loopback"] for r in rows], 0.4,
       label="scaling model (from loopback)")
for i, r in enumerate(rows):
    ax.hlines(r["loopback"], i - 0.45, i + 0.45, colors="k", linestyles="dashed",
              label="loopback, same hold" if i == 0 else None)
ax.set_xticks(list(x), labels)
ax.set_ylabel("tokens/s, 4 ranks")
ax.set_title(f"SmolLM2-135M full fine-tuning, 4 fake nodes, 1 x 512 per rank ({machine})")
ax.legend(fontsize=8, loc="lower left")
fig.tight_layout()
fig.savefig(here / "scaleout.png", dpi=100)
