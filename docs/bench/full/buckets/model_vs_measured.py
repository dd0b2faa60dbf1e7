"""The scaling model against the 2-fake-node rows of this folder: each row's own compute (its step
minus the exposed allreduce and waits), the 1 Gbit/s link, 2 ranks -> predicted step time. These
files predate the measured last bucket: it is taken as the tied embedding's gradient, or all the
gradients when one bucket holds them (the scaling model's figure for the shape)."""
import dataclasses
import json
from pathlib import Path

from cpudist.bench import scaling_model as m
from cpudist.records import BenchResult

here = Path(__file__).parent
for name in ("fp32", "bf16", "zero"):
    for entry in json.loads((here / f"{name}.json").read_text()):
        result = BenchResult.from_json(entry["result"])
        profile = m.profile_from_bench(result)
        wire = 2 if result.config["dist"]["grad_compression"] == "bf16" else 4
        profile = dataclasses.replace(profile, last_bucket_bytes=m.embedding_gradient_bytes(
            "smollm2-135m") * wire / 4)
        predicted = m.predict(profile, 2, 1, 1e9, 0.0)
        print(f"{name} {entry['row']['bucket_cap_mb']:g} MB: step {result.s_per_step:.2f} s, "
              f"predicted {predicted.step_s:.2f} s ({predicted.step_s / result.s_per_step - 1:+.1%}); "
              f"exposed {result.comm_exposed_s_per_step:.2f} s, predicted {predicted.exposed_comm_s:.2f} s")
