"""`cpudist bench --vs PEER`: cpudist and a peer trained side by side, each in its own processes.

Both sides read one resolved config file (written here), so they cannot drift apart: same model
directory, data, sequence length, batch, accumulation, learning rate, LoRA settings, seed and
threads. Only how each side trains differs; that is what the ratios measure.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from cpudist.bench.child import child_env, run_json
from cpudist.bench.figures import FIGURES, figure
from cpudist.bench.options import BenchArgs
from cpudist.config import Config

# --vs name -> the program that runs that peer on a resolved config file and BenchArgs flags.
PEERS = {"hf": ("Hugging Face Trainer + PEFT", [sys.executable, "-m", "cpudist.bench.hf_peer"])}


def run_vs(peer: str, config: Config, args: BenchArgs, rounds: int, allocator: str | None,
           peer_allocator: str) -> dict[str, Any]:
    """Alternate cpudist and peer runs; best figures of each (by tokens/s), and their ratios.

    Each side runs on its own allocator: cpudist's (default auto, as `cpudist train` runs) and
    peer_allocator (default none: glibc malloc, as HF Trainer runs unless a user preloads one).
    """
    name, program = PEERS[peer]
    # The resolved config already holds every bench flag that is a setting (batch, length,
    # dtype, threads, the preset's directory); the rest is what to time.
    timing = ["--data", args.data, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    runs: dict[str, list[dict[str, Any]]] = {"cpudist": [], peer: []}
    with tempfile.TemporaryDirectory(prefix="cpudist-vs-") as tmp:
        resolved = Path(tmp) / "config.yaml"
        resolved.write_text(config.to_yaml())
        ours = [sys.executable, "-m", "cpudist.cli", "bench", str(resolved), *timing]
        theirs = [*program, str(resolved), *timing]
        env, peer_env = child_env(allocator), child_env(peer_allocator)
        for _ in range(rounds):
            runs["cpudist"].append(run_json(ours, env, "cpudist bench"))
            runs[peer].append(run_json(theirs, peer_env, name))
    best = {side: max(items, key=lambda r: r["tokens_per_s"]) for side, items in runs.items()}
    ratios = {key: figure(best["cpudist"], key) / figure(best[peer], key)
              for key, _, _ in FIGURES if key in best[peer] and figure(best[peer], key)}
    return {"cpudist": best["cpudist"], peer: best[peer], "ratios": ratios, "rounds": runs}
