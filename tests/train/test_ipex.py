"""The IPEX lane (.ci/ipex-lane.sh): with intel_extension_for_pytorch importable (torch 2.8),
train.ipex=true trains the quickstart and says that IPEX ran. Skipped elsewhere (cpudist pins
torch 2.13, which IPEX does not support)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.helpers import REPO, cpudist_cmd, run

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("intel_extension_for_pytorch") is None,
    reason="intel_extension_for_pytorch is not installed (it needs torch 2.8: .ci/ipex-lane.sh "
           "builds a venv for it)")


def test_ipex_trains_the_quickstart(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # IPEX 2.8 imports transformers 4.x: the lane's own converted copy of the model (tokenizer files
    # written by transformers 5 do not load in 4.x).
    done = run([*cpudist_cmd(), "train", REPO / "configs" / "quickstart.yaml", "train.ipex=true",
                f"model.cache_dir={REPO / 'runs' / 'ipex-lane' / '.cache' / 'models'}",
                "train.max_steps=8", "train.sample_prompts=0", "train.eval_batches=4",
                "output.plots=false", f"output.dir={out}"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "IPEX 2." in done.stdout and "ipex.optimize" in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_loss_after"] < summary["val_loss_before"]
