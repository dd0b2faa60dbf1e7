"""HF Trainer's full fine-tuning step under torch.profiler, as `cpudist bench --vs hf` runs it.

Usage (on cpudist's malloc and MKL shim, as the bench's same-malloc side):
    python docs/bench/full/zen5/hf_profile.py BENCH_JSON
BENCH_JSON: a `--method full --vs hf` result; its HF side's resolved config is reused. The
warm-up training runs unprofiled, the timed one (2 steps) under the profiler; prints the ops
table (hf_profile.txt holds the run of 2026-12-08, Zen 5).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

PROFILED = '''
import sys, torch
from cpudist.bench import hf_peer
train = hf_peer.train_peer
calls = []
def profiled(*args, **kwargs):
    calls.append(1)
    if len(calls) == 1:
        return train(*args, **kwargs)
    with torch.profiler.profile() as prof:
        clock = train(*args, **kwargs)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
    return clock
hf_peer.train_peer = profiled
sys.exit(hf_peer.main(sys.argv[1:]))
'''


def main() -> None:
    import yaml

    from cpudist.bench.child import child_env

    side = json.loads(Path(sys.argv[1]).read_text())["hf (same malloc)"]
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.yaml"
        config.write_text(yaml.safe_dump(side["config"]))
        subprocess.run([sys.executable, "-c", PROFILED, str(config), "--steps", "2",
                        "--warmup", "2"], env=child_env("auto", True), check=True)


if __name__ == "__main__":
    main()
