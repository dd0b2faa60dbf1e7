"""Run report (PNGs + self-contained HTML) and the scaling report."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest

from cpudist.cli import main
from cpudist.errors import UserError
from cpudist.report.plots import PLOTS, write_report, write_scaling_report
from tests.helpers import cli_in_process, tiny_overrides

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(out: Path, metrics: list[dict], summary: dict | None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if summary is not None:
        (out / "summary.json").write_text(json.dumps(summary))
    (out / "config.yaml").write_text("model:\n  path: tiny <model>\ntrain:\n  lr: 0.001\n")
    return out


def _embedded_pngs(page: str) -> list[bytes]:
    return [base64.b64decode(data) for data in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]


def _steps(n: int, val_every: int = 0) -> list[dict]:
    records = []
    for step in range(1, n + 1):
        records.append({"step": step, "epoch": 0, "loss": 3.0 / step, "lr": 1e-3 * step / n,
                        "tokens_per_s": 100.0 + step, "elapsed": float(step)})
        if val_every and step % val_every == 0:
            records.append({"step": step, "val_loss": 2.5 / step, "val_ppl": 10.0})
    return records


SUMMARY = {
    "world_size": 2, "threads_per_rank": 1, "dtype": "float32: set by model.dtype",
    "communication": "gloo", "cpu": "Test CPU 9000", "launcher": "openmpi", "global_batch": 8,
    "val_loss_before": 3.25, "val_ppl_before": 25.8, "steps": 6, "train_loss": 0.5,
    "val_loss_after": 0.41, "val_ppl_after": 1.5, "wall_s": 12.0, "tokens_per_s": 104.5,
    "tokens_seen": 1000, "bad_steps": 0, "peak_rss_gb": 0.7,
    "time": {"setup_s": 3.5, "data_s": 41.25, "data_cached": False, "eval_s": 2.75,
             "train_s": 12.0, "other_s": 0.5, "wall_s": 60.0, "goodput": 0.2},
    "sources": {"web.jsonl": 300, "books.parquet": 100},
    "samples": [{"prompt": "<|im_start|>user\nWhat is <b>2+2</b>?", "reference": "Four.",
                 "before": "Maybe five", "after": "Four, of course."}],
}


def test_report_embeds_plots_environment_figures_and_answers(tmp_path: Path) -> None:
    out = _write_run(tmp_path / "run", _steps(6, val_every=3), SUMMARY)
    page_path = write_report(out)
    assert page_path == out / "report.html"
    for name in PLOTS:
        assert (out / name).read_bytes().startswith(PNG_MAGIC), name
    page = page_path.read_text()
    images = _embedded_pngs(page)
    assert sorted(images) == sorted((out / name).read_bytes() for name in PLOTS)
    assert "<link" not in page and "<script" not in page  # nothing to fetch from elsewhere
    for text in ("Test CPU 9000", "float32: set by model.dtype", "gloo", "openmpi",
                 "0.41", "3.25", "104.5", "Four, of course.", "Maybe five", "lr: 0.001",
                 "Where the time went", "41.25", "read and tokenized", "2.75", "20.0%",
                 "web.jsonl", "books.parquet"):
        assert text in page, text
    # User text is escaped, never interpreted as markup.
    assert "&lt;b&gt;2+2&lt;/b&gt;" in page and "<b>2+2</b>" not in page
    assert "tiny &lt;model&gt;" in page


def test_restarts_are_marked_on_the_loss_plot_and_listed(tmp_path: Path) -> None:
    records = _steps(6)
    plain = write_report(_write_run(tmp_path / "plain", records, SUMMARY)).read_text()
    restart = {"event": "restart", "attempt": 1, "reason": "exit status 137 (SIGKILL)",
               "resumed_from_step": 4, "time": "2026-01-01T00:00:00+00:00"}
    out = _write_run(tmp_path / "restarted", [*records[:4], restart, *records[4:]], SUMMARY)
    page = write_report(out).read_text()
    assert "Restarts" not in plain and "<h2>Restarts</h2>" in page
    assert "resumed from step 4" in page and "exit status 137 (SIGKILL)" in page
    # The loss plot differs (the marker); the others do not depend on restarts.
    assert (out / "loss.png").read_bytes() != (tmp_path / "plain" / "loss.png").read_bytes()
    assert (out / "lr.png").read_bytes() == (tmp_path / "plain" / "lr.png").read_bytes()


def test_preference_runs_plot_rewards_and_reward_accuracy(tmp_path: Path) -> None:
    records = _steps(4, val_every=2)
    for record in records:
        if "loss" in record:
            margin = 0.1 * record["step"]
            record.update(reward_chosen=margin / 2, reward_rejected=-margin / 2, reward_margin=margin,
                          reward_accuracy=0.5 + 0.1 * record["step"])
        else:
            record.update(val_reward_margin=0.2 * record["step"], val_reward_accuracy=0.9)
    summary = {**SUMMARY, "eval_before": {"val_loss": 0.6931, "val_reward_accuracy": 0.5,
                                          "val_reward_margin": 0.0}}
    out = _write_run(tmp_path / "run", records, summary)
    images = _embedded_pngs(write_report(out).read_text())
    assert len(images) == len(PLOTS) + 2
    for name in ("rewards.png", "reward_accuracy.png"):
        assert (out / name).read_bytes() in images, name
    sft = _write_run(tmp_path / "sft", _steps(4, val_every=2), SUMMARY)
    write_report(sft)
    assert not (sft / "rewards.png").exists()


@pytest.mark.parametrize("metrics, summary", [
    (_steps(1), None),                              # a single step, no val, run did not finish
    (_steps(3), {"steps": 3, "train_loss": 1.0}),   # no validation anywhere
    ([{"step": 1, "loss": float("nan"), "lr": 1e-3, "tokens_per_s": 5.0}], {}),  # non-finite loss
])
def test_report_copes_with_sparse_runs(tmp_path: Path, metrics: list[dict],
                                       summary: dict | None) -> None:
    out = _write_run(tmp_path / "run", metrics, summary)
    page = write_report(out).read_text()
    assert len(_embedded_pngs(page)) == len(PLOTS)
    if summary is None:
        assert "did not finish" in page


def test_report_command_and_its_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = _write_run(tmp_path / "run", _steps(2), SUMMARY)
    assert main(["report", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out / "report.html")
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "nothing" in capsys.readouterr().err
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n')
    assert main(["report", str(out)]) == 2
    assert "metrics.jsonl:2" in capsys.readouterr().err


def test_training_run_writes_its_report(tiny_qwen: Path, chat_file: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    result = cli_in_process(capsys, ["train", *tiny_overrides(tiny_qwen, chat_file, out,
                                                              output__plots="true",
                                                              train__sample_prompts=1,
                                                              train__max_new_tokens=4)])
    assert result.returncode == 0, result.stderr[-3000:]
    page = (out / "report.html").read_text()
    assert len(_embedded_pngs(page)) == len(PLOTS)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cpu"] and summary["cpu"] in page
    assert f"{summary['val_loss_after']:.4g}" in page
    assert "Held-out answers" in page


def test_scaling_report_efficiency_is_relative_to_the_smallest_run(tmp_path: Path) -> None:
    rows = [{"world_size": 4, "tokens_per_s": 300.0, "peak_rss_gb": 1.25},
            {"world_size": 1, "tokens_per_s": 100.0, "peak_rss_gb": 1.0},
            {"world_size": 2, "tokens_per_s": 180.0, "peak_rss_gb": 1.1}]
    md_path, png_path = write_scaling_report(rows, tmp_path / "scaling")
    assert png_path.read_bytes().startswith(PNG_MAGIC)
    table = [line for line in md_path.read_text().splitlines() if line.startswith("| ")]
    assert table[0].startswith("| ranks | tokens/s | speedup | efficiency | peak_rss_gb")
    assert table[1:] == ["| 1 | 100.0 | 1.00x | 100% | 1 |",
                         "| 2 | 180.0 | 1.80x | 90% | 1.1 |",
                         "| 4 | 300.0 | 3.00x | 75% | 1.25 |"]

    # Without a one-rank run the smallest measured count is the reference.
    md_path, _ = write_scaling_report([{"world_size": 2, "tokens_per_s": 200.0},
                                       {"world_size": 8, "tokens_per_s": 600.0}], tmp_path / "b")
    assert "| 8 | 600.0 | 3.00x | 75% |" in md_path.read_text()

    with pytest.raises(UserError, match="world_size and tokens_per_s"):
        write_scaling_report([{"world_size": 1}], tmp_path / "c")
    with pytest.raises(UserError, match="no measurements"):
        write_scaling_report([], tmp_path / "d")
