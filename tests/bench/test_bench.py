"""`cpudist bench` / `cpudist scaling` and the HF baseline, on tiny models and a few steps."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cpudist.records import BenchResult
from tests.helpers import bench_result, cli_in_process, cpudist_cmd, run

FIELDS = ("tokens_per_s", "label_tokens_per_s", "samples_per_s", "s_per_step", "peak_rss_gb",
          "node_pss_gb", "mfu", "dtype", "threads", "world_size", "config", "padding_fraction",
          "peak_tflops", "flop_model")


def _bench(model: Path, tmp_path: Path, *extra: str, name: str = "bench.json",
           capsys: pytest.CaptureFixture[str] | None = None) -> tuple[dict, str]:
    """`cpudist bench` of a few tiny steps: its own process (the CLI runs itself again on its
    malloc, the --vs peers run beside it), or this one with capsys."""
    out = tmp_path / name
    # Overrides may stand anywhere among the flags (intermixed parsing).
    args = ["bench", f"model.path={model}", "--steps", "2",
            f"data.cache_dir={tmp_path / 'data-cache'}", "--warmup", "1", "--seq-len", "32",
            "--batch-size", "2", "--dtype", "float32", "--json", out, *extra]
    result = cli_in_process(capsys, args) if capsys else run([*cpudist_cmd(), *args])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return json.loads(out.read_text()), result.stdout


def test_bench_writes_every_figure(tiny_qwen: Path, tmp_path: Path) -> None:
    figures, printed = _bench(tiny_qwen, tmp_path)
    for field in FIELDS:
        assert field in figures, field
    assert "| tokens/s |" in printed and "MFU" in printed
    # Synthetic rows: every token fed, all but the first of each row a label.
    steps, rows, width = 2, 2, 32
    assert figures["tokens_per_s"] * figures["s_per_step"] * steps == pytest.approx(steps * rows * width)
    assert figures["label_tokens_per_s"] / figures["tokens_per_s"] == pytest.approx(31 / 32)
    assert figures["samples_per_s"] == pytest.approx(rows / figures["s_per_step"])
    assert len(figures["step_s"]) == 2 and figures["warmup_steps"] == 1
    assert figures["world_size"] == 1 and figures["threads"] >= 1
    assert figures["dtype"].startswith("float32")
    assert len(figures["peak_rss_gb"]) == 1 and 0.2 < figures["peak_rss_gb"][0] < 20
    assert 0.05 < figures["node_pss_gb"] <= figures["peak_rss_gb"][0] * 1.05
    assert 0 < figures["mfu"] < 1
    assert figures["padding_fraction"] == 0.0
    assert figures["config"]["model"]["path"] == str(tiny_qwen)
    assert figures["config"]["data"]["max_length"] == 32
    from cpudist.runtime.allocator import choose_allocator

    # The CLI ran itself again on jemalloc (when installed): read back from the process's maps.
    assert figures["allocator"].split(" ")[0] == (choose_allocator("auto")[0] or "glibc")


def test_bench_allocator_none_runs_on_glibc_malloc(tiny_qwen: Path, tmp_path: Path) -> None:
    figures, _ = _bench(tiny_qwen, tmp_path, "--allocator", "none")
    assert figures["allocator"] == "glibc malloc"


def test_bench_instruct_masks_prompts_and_packing_removes_padding(
        tiny_qwen: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.helpers import write_jsonl

    # Answers of very different lengths: padded batches waste many positions.
    rows = [{"messages": [{"role": "user", "content": f"Count to {n}."},
                          {"role": "assistant", "content": " ".join(["one"] * (1 + n % 9 * 12))}]}
            for n in range(40)]
    data = write_jsonl(tmp_path / "lengths.jsonl", rows)
    args = ["--data", "instruct", f"data.path={data}", "data.group_by_length=false",
            "--batch-size", "4", "--seq-len", "160"]
    padded, _ = _bench(tiny_qwen, tmp_path, *args, name="padded.json", capsys=capsys)
    packed, _ = _bench(tiny_qwen, tmp_path, *args, "data.packing=true", name="packed.json",
                       capsys=capsys)
    for figures in (padded, packed):
        assert 0 < figures["label_tokens_per_s"] < 0.9 * figures["tokens_per_s"]
        assert figures["data"].startswith("instruct")
    assert padded["padding_fraction"] > 0.15
    assert packed["padding_fraction"] < padded["padding_fraction"]


def test_flop_formula_counts_frozen_lora_attention_and_head(tiny_llama: Path) -> None:
    from cpudist.bench.figures import flop_model
    from cpudist.config import Config, LoraConfig, ModelConfig
    from cpudist.model.load import build_model
    from cpudist.runtime.precision import choose_precision

    model, _, _ = build_model(Config(model=ModelConfig(path=str(tiny_llama), dtype="float32",
                                                       share_frozen_weights=False),
                                     lora=LoraConfig(r=4)), choose_precision("float32"))
    config = model.get_base_model().config
    h, i, layers, v = config.hidden_size, config.intermediate_size, config.num_hidden_layers, \
        config.vocab_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    per_layer = h * h * 2 + 2 * h * kv + 3 * h * i  # q, o, k, v, gate, up, down
    lora_per_layer = 4 * ((h + h) * 2 + 2 * (h + kv) + 3 * (h + i))
    flops = flop_model(model)
    assert flops.n_frozen == layers * per_layer
    assert flops.n_lora == layers * lora_per_layer
    assert flops.head_params == v * h and flops.attn_dim == h and flops.n_layers == layers
    expected = ((4 * flops.n_frozen + 6 * flops.n_lora) * (10 + 4)
                + 6 * layers * h * (10**2 + 4**2) + 4 * v * h * 9)
    assert flops.step_flops([10, 4], label_tokens=9) == expected


def test_gemm_peak_holds_no_operands_between_probes() -> None:
    """The probe's matrices would otherwise count in the peak RSS reported as the training's."""
    import torch

    from cpudist.bench.figures import GemmPeak

    gemm = GemmPeak(torch.float32, [(64, 32, 48)], repeats=1)
    first, second = gemm.probe(), gemm.probe()
    assert 0 < first < float("inf") and 0 < second < float("inf")
    assert gemm.samples == [first, second] and gemm.best == max(first, second)

    def tensors(value: object) -> int:
        if isinstance(value, torch.Tensor):
            return 1
        return sum(map(tensors, value)) if isinstance(value, list | tuple) else 0

    assert not [name for name, value in vars(gemm).items() if tensors(value)]


def test_bench_user_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = cli_in_process(capsys, ["bench", "--layers", "2"])
    assert result.returncode == 2 and "error: --layers needs --preset" in result.stderr
    result = cli_in_process(capsys, ["bench", "train.batch_sise=2"])
    assert result.returncode == 2 and "train.batch_size" in result.stderr
    result = cli_in_process(capsys, ["bench", "--vs", "trl"])
    assert result.returncode == 2 and "--vs trl trains train.objective=dpo; this bench's is sft" \
        in result.stderr


@pytest.mark.slow
def test_bench_dpo_vs_trl_times_the_same_pairs(tiny_qwen: Path, tmp_path: Path) -> None:
    """`--objective dpo --vs trl`: both sides time one epoch of the same synthetic pairs (prompt 16
    + answers of 16: 2 pairs x 2 rows x 32 tokens a step, 2 x 2 x 16 answer tokens); cpudist's
    reference precomputed (auto), TRL's a forward per step (its default), each said in the table."""
    figures, printed = _bench(tiny_qwen, tmp_path, "--objective", "dpo", "--vs", "trl",
                              "--hf-allocator", "auto")  # one TRL run: the same malloc as cpudist
    ours, trl = figures["cpudist"], figures["trl"]
    assert set(figures) >= {"cpudist", "trl", "ratios"} and "cpudist / trl" in printed
    assert trl["framework"] == "trl-dpo+peft" and trl["steps"] == 2
    assert ours["flop_model"] == trl["flop_model"]
    for side in (ours, trl):
        assert side["tokens_per_s"] * side["s_per_step"] == pytest.approx(2 * 2 * 32)
        assert side["label_tokens_per_s"] * side["s_per_step"] == pytest.approx(2 * 2 * 16)
    assert "synthetic pairs: 4 x (prompt 16 + chosen 16 | rejected 16)" in ours["data"] == trl["data"]
    assert ours["losses"][0] == pytest.approx(math.log(2), abs=1e-6)  # B = 0: policy = reference
    assert ours["prepare_s"] > 0 and "cpudist: DPO reference: precomputed, one pass over 4 pairs" in printed
    assert "trl: TRL's default: the reference is a forward at every step" in printed


def test_timed_steps_cover_the_fixed_sample_set_once() -> None:
    from cpudist.bench.samples import bench_step_position, fixed_sample_set
    from cpudist.data.batches import GlobalBatches
    from cpudist.data.tokenize import TokenizedSplit
    from cpudist.errors import UserError

    split = TokenizedSplit([[i] * (1 + i % 7) for i in range(50)], [[i] * (1 + i % 7) for i in range(50)])
    chosen = fixed_sample_set(split, 12, seed=3, where="data.path x")
    assert len(chosen) == 12 and chosen.input_ids == fixed_sample_set(split, 12, 3, "x").input_ids
    assert chosen.input_ids != fixed_sample_set(split, 12, 4, "x").input_ids
    with pytest.raises(UserError, match="data.path x has 50 training samples.*lower --steps"):
        fixed_sample_set(split, 51, seed=3, where="data.path x")
    batches = GlobalBatches(chosen, batch_size=2, grad_accum=1, world=2, seed=0, group_by_length=True)
    for warmup in (0, 1, 3, 4):
        timed = [bench_step_position(step, warmup, batches.steps_per_epoch)
                 for step in range(warmup, warmup + batches.steps_per_epoch)]
        seen = sorted(i for epoch, index in timed for rank in (0, 1)
                      for micro in batches.step_batches(epoch, index, rank) for i in micro)
        assert seen == list(range(12)), warmup


@pytest.mark.slow
def test_bench_vs_hf_times_the_same_samples_and_prints_ratios(tiny_qwen: Path,
                                                              tmp_path: Path) -> None:
    from tests.helpers import write_jsonl

    rows = [{"messages": [{"role": "user", "content": f"Count to {n}."},
                          {"role": "assistant", "content": " ".join(["one"] * (1 + n % 9 * 5))}]}
            for n in range(30)]
    data = write_jsonl(tmp_path / "lengths.jsonl", rows)
    figures, printed = _bench(tiny_qwen, tmp_path, "--data", "instruct", f"data.path={data}",
                              "--batch-size", "4", "--seq-len", "96", "--vs", "hf")
    assert "cpudist / hf" in printed
    assert (tmp_path / "bench.png").stat().st_size > 1000
    assert set(figures) >= {"cpudist", "hf", "ratios"}
    ours, hf = figures["cpudist"], figures["hf"]
    assert hf["framework"].startswith("hf-trainer") and hf["steps"] == 2
    # Each side on its own default malloc: HF as users run it, cpudist as `cpudist train` does.
    from cpudist.runtime.allocator import choose_allocator

    assert hf["allocator"] == "glibc malloc"
    assert ours["allocator"].split(" ")[0] == (choose_allocator("auto")[0] or "glibc")
    # So is MKL: cpudist's processes get the shim wherever this machine wants it, HF's not.
    from cpudist.runtime.mkl_shim import library

    assert hf["mkl"].startswith("as shipped")
    assert ours["mkl"] == ("kernels chosen by the CPU's features (cpudist's shim preloaded)"
                           if library() else hf["mkl"])
    # Same model and FLOP formula; both sides time one epoch over the same 8 samples: the same
    # real and label tokens.
    assert hf["flop_model"] == ours["flop_model"]
    assert "8 of" in ours["data"] and "8 of" in hf["data"]
    for key in ("tokens_per_s", "label_tokens_per_s", "samples_per_s"):
        assert ours[key] * ours["s_per_step"] == pytest.approx(hf[key] * hf["s_per_step"]), key
    assert ours["samples_per_s"] * ours["s_per_step"] == pytest.approx(4)
    for key in ("tokens_per_s", "s_per_step", "mfu", "node_pss_gb"):
        assert figures["ratios"][key] == pytest.approx(ours[key] / hf[key])


@pytest.mark.slow
def test_scaling_runs_each_rank_count(tiny_qwen: Path, tmp_path: Path) -> None:
    from cpudist.runtime.hardware import physical_cores
    from tests.helpers import mpirun_cmd

    mpirun_cmd(1)  # skips when mpirun is missing
    out = tmp_path / "scaling"
    result = run([*cpudist_cmd(), "scaling", "--np", "1,2", f"model.path={tiny_qwen}",
                  f"data.cache_dir={tmp_path / 'data-cache'}", "--steps", "2", "--seq-len", "32",
                  "--batch-size", "2", "--dtype", "float32", "--out", out])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = json.loads((out / "scaling.json").read_text())
    assert [r["world_size"] for r in rows] == [1, 2]
    # Without --total-threads the ranks share this machine's physical cores.
    cores = physical_cores()
    assert [r["threads"] for r in rows] == [cores, max(1, cores // 2)]
    # The global batch (2) is kept: each of the 2 ranks trains on 1 sample per step.
    assert [r["config"]["train"]["batch_size"] for r in rows] == [2, 1]
    assert rows[1]["tokens_per_s"] * rows[1]["s_per_step"] == pytest.approx(2 * 32)
    assert len(rows[1]["peak_rss_gb"]) == 2
    assert (out / "scaling.png").stat().st_size > 1000
    assert "| 2 |" in (out / "scaling.md").read_text()


def test_rounds_state_mfu_against_each_runs_peak_and_the_best_peak() -> None:
    """A run whose probes all read low is not flattered in the best-peak figure; an invalid run's
    MFU is marked and left out of the per-run spread."""
    from cpudist.commands.bench import summarize_rounds

    def run(achieved: float, peak: float) -> BenchResult:
        return bench_result(tokens_per_s=50.0, s_per_step=40.0, model_tflops=achieved,
                            peak_tflops=peak, mfu=achieved / peak, mfu_valid=achieved <= peak)

    summary, lines = summarize_rounds([run(0.11, 0.19), run(0.11, 0.15), run(0.16, 0.15)])
    assert summary["mfu_median"] == pytest.approx(0.11 / 0.15 + (0.11 / 0.19 - 0.11 / 0.15) / 2)
    assert summary["best_peak_tflops"] == 0.19
    assert summary["mfu_best_peak_min"] == pytest.approx(0.11 / 0.19)
    assert summary["mfu_best_peak_median"] == pytest.approx(0.11 / 0.19)
    assert summary["mfu_best_peak_max"] == pytest.approx(0.16 / 0.19)
    assert "(invalid)" in lines[4] and "median 65.6%" in lines[5]


@pytest.mark.parametrize(("method", "virtual", "prefix"), [
    ("prompt_tuning", 3, 0), ("p_tuning", 3, 0), ("prefix_tuning", 0, 3), ("ia3", 0, 0)])
def test_flop_formula_counts_virtual_tokens_and_prefix_keys(
        method: str, virtual: int, prefix: int, tiny_llama: Path) -> None:
    from cpudist.bench.figures import flop_model
    from cpudist.config import Config, ModelConfig, PeftSection, PromptSection
    from cpudist.model.load import build_model
    from cpudist.runtime.precision import choose_precision

    model, _, _ = build_model(Config(model=ModelConfig(path=str(tiny_llama), dtype="float32",
                                                       share_frozen_weights=False),
                                     peft=PeftSection(method=method),
                                     prompt=PromptSection(virtual_tokens=3)),
                              choose_precision("float32"))
    flops = flop_model(model)
    assert (flops.virtual_tokens, flops.prefix_keys, flops.n_lora) == (virtual, prefix, 0)
    d, layers = flops.attn_dim, flops.n_layers
    expected = (4 * flops.n_frozen * (10 + virtual + 4 + virtual)
                + 6 * layers * d * ((10 + virtual) ** 2 + (4 + virtual) ** 2
                                    + 2 * prefix * (10 + 4))
                + 4 * flops.head_params * 9)
    assert flops.step_flops([10, 4, 0], label_tokens=9) == expected
