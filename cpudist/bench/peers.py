"""`cpudist bench --vs PEER`: cpudist and a peer trained side by side, each in its own processes.

Both sides read one resolved config file (written here), so they cannot drift apart: same model
directory, data, sequence length, batch, accumulation, learning rate, LoRA settings, seed and
threads. Only how each side trains differs; that is what the ratios measure.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpudist.bench.child import child_env, run_json
from cpudist.bench.figures import FIGURES, PER_RANK_FIGURES
from cpudist.bench.options import BenchArgs
from cpudist.config import Config
from cpudist.errors import UserError
from cpudist.records import BenchResult
from cpudist.runtime.allocator import choose_allocator, requested

# --vs name -> the program that runs that peer on a resolved config file and BenchArgs flags.
PEERS = {"hf": ("Hugging Face Trainer + PEFT", [sys.executable, "-m", "cpudist.bench.hf_peer"]),
         "trl": ("TRL DPOTrainer + PEFT", [sys.executable, "-m", "cpudist.bench.trl_peer"])}
# The train.objective each peer trains.
PEER_OBJECTIVES = {"hf": "sft", "trl": "dpo"}


@dataclass
class VsOutcome:
    """cpudist and a peer side by side: the best run of each side (by tokens/s), every run, and
    the ratios cpudist / peer of each figure, as each ships and (when measured) on one malloc."""

    peer: str
    best: dict[str, BenchResult]  # side -> its best run: "cpudist", PEER, "PEER (same malloc)"
    rounds: dict[str, list[BenchResult]]
    ratios: dict[str, float]
    ratios_same_malloc: dict[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        outcome: dict[str, Any] = {side: r.to_json() for side, r in self.best.items()}
        outcome.update(rounds={side: [r.to_json() for r in runs] for side, runs in self.rounds.items()},
                       peer=self.peer, ratios=self.ratios)
        if self.ratios_same_malloc is not None:
            outcome["ratios_same_malloc"] = self.ratios_same_malloc
        return outcome


def ratios(ours: BenchResult, theirs: BenchResult) -> dict[str, float]:
    """ours / theirs for each figure of the table both measure."""
    return {key: ours.figure(key) / theirs.figure(key) for key, _, _ in FIGURES
            if key not in PER_RANK_FIGURES and theirs.figure(key)}


def run_vs(peer: str, config: Config, args: BenchArgs, rounds: int, allocator: str | None,
           peer_allocator: str) -> VsOutcome:
    """Alternate cpudist and peer runs; best figures of each (by tokens/s), and their ratios.

    The peer runs twice a round: on its own allocator (peer_allocator, default none: glibc
    malloc, as HF Trainer runs unless a user preloads one) and on cpudist's, so that both ratios
    (as each ships, and the same malloc on both sides) come from one command. On cpudist's malloc
    it also gets cpudist's MKL shim (cpudist.runtime.mkl_shim), as cpudist's processes do: the
    same process setup on both sides; as it ships it runs without.
    """
    from cpudist.train.plan import resolve_batch

    if config.objective_name() != PEER_OBJECTIVES[peer]:
        raise UserError(f"--vs {peer} trains train.objective={PEER_OBJECTIVES[peer]}; this bench's "
                        f"is {config.objective_name()} (--vs hf: sft; --vs trl: --objective dpo)")
    name, program = PEERS[peer]
    same = f"{peer} (same malloc)"
    ours_name, _ = choose_allocator(requested(allocator))
    peer_name, _ = choose_allocator(requested(peer_allocator))
    # side: (allocator, with cpudist's MKL shim, what it is)
    sides = {"cpudist": (allocator, True, "cpudist bench"),
             peer: (peer_allocator, peer_name == ours_name, name)}
    if peer_name != ours_name:
        sides[same] = (allocator, True, f"{name}, on cpudist's malloc")
    # The resolved config already holds every bench flag that is a setting (batch, length,
    # dtype, threads, the preset's directory); the rest is what to time.
    timing = ["--data", args.data, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    runs: dict[str, list[BenchResult]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="cpudist-vs-") as tmp:
        resolved = Path(tmp) / "config.yaml"
        # One process per side: batch_size=auto is resolved once here, for both.
        resolved.write_text(resolve_batch(config, 1, 1)[0].to_yaml())
        commands = {side: ([sys.executable, "-m", "cpudist.cli", "bench", str(resolved), *timing]
                           if side == "cpudist" else [*program, str(resolved), *timing])
                    for side in sides}
        for _ in range(rounds):
            for side, (side_allocator, shim, what) in sides.items():
                runs[side].append(run_json(commands[side], child_env(side_allocator, shim), what))
    best = {side: max(items, key=lambda r: r.tokens_per_s) for side, items in runs.items()}
    return VsOutcome(peer, best, runs, ratios(best["cpudist"], best[peer]),
                     ratios(best["cpudist"], best[same]) if same in best else None)
