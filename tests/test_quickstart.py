"""The README's main job on the real embedded model (SmolLM2-135M-Instruct), shortened."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import REPO, cpudist_cmd, run


@pytest.mark.slow
def test_quickstart_improves_validation_loss_and_answers(smol_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "quickstart"
    result = run([*cpudist_cmd(), "train", REPO / "configs" / "quickstart.yaml",
                  "train.max_steps=8", "train.save_every=0", "train.max_new_tokens=12",
                  f"output.dir={out}"], timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_loss_after"] < summary["val_loss_before"] - 0.1
    (sample,) = summary["samples"]
    assert sample["prompt"] and sample["before"] and sample["after"]
    assert "validation loss: before" in result.stdout and "held-out prompt" in result.stdout
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    assert (out / "report.html").exists()
