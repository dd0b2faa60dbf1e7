"""`cpudist plan`: memory per rank and per node from config.json alone, how each setting moves it,
where the node's memory comes from, and the advice when a run does not fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cpudist.config import load_config
from cpudist.runtime import memory
from cpudist.train.plan import estimate, make_plan, model_parts
from tests.helpers import cli_in_process

NODE = (24.0, "MemTotal")


def _config(model: Path, *overrides: str):  # noqa: ANN202
    return load_config(None, [f"model.path={model}", "data.max_length=256", "train.batch_size=4",
                              *overrides])


def test_parts_count_the_parameters(tiny_qwen: Path) -> None:
    from transformers import AutoModelForCausalLM

    parts = model_parts(_config(tiny_qwen))
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen)
    assert parts.tied and parts.head == 0
    total = sum(p.numel() for p in model.parameters())
    assert parts.linears + parts.embedding + parts.other == total
    assert len(parts.linear_shapes) == 2 * 7 and (parts.hidden, parts.layers) == (64, 2)


def test_each_setting_moves_the_plan_where_it_should(tiny_qwen: Path) -> None:
    parts = model_parts(_config(tiny_qwen))

    def peak(*overrides: str, ranks: int = 1) -> tuple[float, float]:
        plan = estimate(_config(tiny_qwen, *overrides), parts, ranks, NODE, "bfloat16")
        return sum(plan.frozen_gb.values()), plan.node_peak_gb

    frozen, base = peak()
    assert peak("model.gradient_checkpointing=true")[1] < base
    assert peak("model.quantize=int8")[0] < frozen and peak("model.quantize=int4")[0] < peak(
        "model.quantize=int8")[0]
    assert peak("train.batch_size=8")[1] > base
    # Mapped frozen weights count once per node; each rank adds only its own part.
    two = estimate(_config(tiny_qwen), parts, 2, NODE, "bfloat16")
    assert two.frozen_shared
    assert two.node_peak_gb == pytest.approx(sum(two.frozen_gb.values())
                                             + 2 * sum(two.rank_gb.values()))
    unshared = estimate(_config(tiny_qwen, "model.share_frozen_weights=false"), parts, 2, NODE,
                        "bfloat16")
    assert unshared.node_peak_gb > two.node_peak_gb


def test_eager_attention_counts_its_score_matrices(tiny_gemma2: Path, tiny_qwen: Path) -> None:
    # Gemma 2 runs eager attention (no sdpa path): 8 bytes per score and layer kept, plus the
    # layer being computed; checked against bench peaks in docs/PERFORMANCE.md ("Will it fit").
    parts = model_parts(_config(tiny_gemma2))
    assert parts.eager_attention and parts.heads == 4
    assert not model_parts(_config(tiny_qwen)).eager_attention

    def scores(*overrides: str) -> float:
        plan = estimate(_config(tiny_gemma2, *overrides), parts, 1, NODE, "bfloat16")
        return plan.rank_gb["attention scores (eager)"] * 1024**3

    assert scores() == 8 * 4 * 4 * 256**2 * (parts.layers + 1)  # batch 4, 4 heads, 256 tokens
    assert scores("data.max_length=512") == 4 * scores()
    assert scores("model.gradient_checkpointing=true") == 8 * 4 * 4 * 256**2 * 2


def test_node_memory_is_the_smallest_limit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("SLURM_MEM_PER_NODE", "SLURM_MEM_PER_CPU"):
        monkeypatch.delenv(name, raising=False)
    total, source = memory.node_memory_gb()
    assert total > 0 and (source in ("MemTotal", "psutil") or source.startswith("cgroup limit "))
    # "max" is no limit; a cgroup limit below the machine's memory is the node's.
    limit = tmp_path / "memory.max"
    limit.write_text("max\n")
    monkeypatch.setattr(memory, "CGROUP_LIMITS", (tmp_path / "absent", limit))
    machine, where = memory.node_memory_gb()
    assert where in ("MemTotal", "psutil") and machine >= total
    limit.write_text(f"{1 << 28}\n")
    assert memory.node_memory_gb() == (0.25, f"cgroup limit {limit}")
    monkeypatch.setenv("SLURM_MEM_PER_NODE", "128")
    assert memory.node_memory_gb() == (0.125, "Slurm memory per node")


def test_a_plan_that_does_not_fit_says_what_would(tiny_qwen: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(tiny_qwen, "data.max_length=2048", "train.batch_size=64")
    fits = make_plan(config, 1)
    assert fits.fits and not fits.advice
    # A node just too small for it: checkpointing (the smallest change) makes it fit.
    monkeypatch.setenv("SLURM_MEM_PER_NODE", str(int(fits.node_peak_gb * 1024 * 0.9)))
    plan = make_plan(config, 1)
    assert not plan.fits and plan.advice[0] == "model.gradient_checkpointing=true"


def test_a_gguf_file_is_planned_from_its_metadata_without_converting_it(tiny_gemma2: Path,
                                                                          tmp_path: Path) -> None:
    """A GGUF base is planned as the model it converts to (Gemma 2 here: eager attention, tied
    head), with nothing written into the model cache."""
    from cpudist.cli import main

    file = tmp_path / "gemma2.gguf"
    assert main(["export", "--base", str(tiny_gemma2), "--out", str(file), "--type", "q8_0"]) == 0
    cache = tmp_path / "cache"
    from_file = model_parts(_config(file, f"model.cache_dir={cache}"))
    assert not cache.exists()
    assert from_file == model_parts(_config(tiny_gemma2))
    assert from_file.eager_attention and from_file.tied


def test_plan_command_prints_and_writes_json(tiny_qwen: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    done = cli_in_process(capsys, ["plan", f"model.path={tiny_qwen}", "--ranks-per-node", "2",
                                   "--json", "-"])
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures["ranks_per_node"] == 2 and figures["fits"] is True
    assert figures["node_peak_gb"] > figures["rank_peak_gb"] > 0
    printed = cli_in_process(capsys, ["plan", f"model.path={tiny_qwen}", "model.quantize=int4"])
    assert printed.returncode == 0 and "decoder linears (int4)" in printed.stdout
    assert "node peak" in printed.stdout and printed.stdout.strip().endswith("fits")


def test_a_7b_on_24_gib_without_fast_bf16_needs_a_quantized_base(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    """Qwen2.5-7B's config.json alone (plan reads no weight): in fp32 (what an AVX2-only CPU
    computes in) it cannot fit 24 GiB and plan says which bases would; in bf16 or int4 it fits."""
    from transformers import AutoConfig

    from cpudist.bench.presets import PRESETS

    preset = PRESETS["qwen2.5-7b"]
    AutoConfig.for_model(preset.model_type, **preset.config).save_pretrained(tmp_path)
    monkeypatch.setenv("SLURM_MEM_PER_NODE", str(24 * 1024))
    common = [f"model.path={tmp_path}", "model.gradient_checkpointing=true", "lora.r=16",
              "data.max_length=512", "train.batch_size=1"]
    fp32 = make_plan(load_config(None, [*common, "model.dtype=float32"]), 1)
    assert not fp32.fits and fp32.frozen_gb["decoder linears"] > 24
    assert any("model.quantize=int8" in advice for advice in fp32.advice)
    assert make_plan(load_config(None, [*common, "model.dtype=float32", "model.quantize=int4"]),
                     1).fits
    assert make_plan(load_config(None, [*common, "model.dtype=bfloat16"]), 1).fits


def test_global_batch_sets_the_accumulation_and_is_never_changed(tiny_qwen: Path) -> None:
    from cpudist.errors import UserError
    from cpudist.train.plan import resolve_batch

    resolved, line = resolve_batch(_config(tiny_qwen, "train.global_batch=16"), 2, 2)
    assert (resolved.train.batch_size, resolved.train.grad_accum) == (4, 2)
    assert "global batch 16 = 2 rank(s) x micro-batch 4 x 2" in line
    # The settings given stay the only ones marked given (no "ia3.* set but unused" warning).
    assert resolved.ia3.model_fields_set == set() == resolved.prompt.model_fields_set
    assert resolved.train.model_fields_set >= {"global_batch", "batch_size", "grad_accum"}
    unchanged, line = resolve_batch(_config(tiny_qwen, "train.grad_accum=3"), 2, 2)
    assert (unchanged.train.batch_size, unchanged.train.grad_accum, line) == (4, 3, "")
    for overrides, world, message in (
            (["train.global_batch=16"], 3, "does not divide among 3 ranks"),
            (["train.global_batch=12", "train.batch_size=8"], 1, "train.batch_size=8 does not divide"),
            (["train.global_batch=16", "train.grad_accum=3"], 1, "train.grad_accum=3 contradicts"),
            (["train.batch_size=auto"], 1, "train.batch_size=auto needs train.global_batch")):
        with pytest.raises(UserError, match=message):
            resolve_batch(_config(tiny_qwen, *overrides), world, 1)


def test_auto_batch_is_the_largest_that_the_plan_fits(tiny_qwen: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from cpudist.train.plan import HEADROOM, MAX_AUTO_BATCH, resolve_batch

    auto = ["data.max_length=2048", "train.batch_size=auto", "train.global_batch=16"]
    roomy, line = resolve_batch(_config(tiny_qwen, *auto), 1, 1)
    assert roomy.train.batch_size == MAX_AUTO_BATCH == 4 and roomy.train.grad_accum == 4
    assert "auto: the largest of [4, 2, 1]" in line
    peak = {b: make_plan(_config(tiny_qwen, "data.max_length=2048", f"train.batch_size={b}"),
                         1).node_peak_gb for b in (2, 4)}
    # A node between the two: 4 rows would not fit, 2 do; the global batch stays 16.
    node_gb = (peak[2] + peak[4]) / 2 / HEADROOM
    monkeypatch.setenv("SLURM_MEM_PER_NODE", str(int(node_gb * 1024)))
    tight, _ = resolve_batch(_config(tiny_qwen, *auto), 1, 1)
    assert (tight.train.batch_size, tight.train.grad_accum) == (2, 8)
