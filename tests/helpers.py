"""Helpers the tests share: paths, tiny models and data files, running the real CLI and mpirun,
reading a run's metrics, and the model/loss helpers of the equality tests."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    from cpudist.data.batches import Batch
    from cpudist.data.tokenize import TokenizedSplit
    from cpudist.records import BenchResult

REPO = Path(__file__).resolve().parents[1]
# Shared with the quickstart so the one-time GGUF conversion is reused.
MODEL_CACHE = REPO / ".cache" / "models"
SCRIPTS = REPO / "tests" / "scripts"

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


def save_tokenizer(target: Path) -> Path:
    """SmolLM2's real tokenizer (with its chat template) saved to target, without converting the
    weights (taken from the converted model when the cache has it)."""
    from transformers import AutoTokenizer

    from cpudist.model.load import BUILTIN_MODELS

    converted = MODEL_CACHE / "smollm2-135m-instruct"
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


def chatterbot_lines(language: str, cache_dir: Path) -> list[str]:
    """Every question and answer of one chatterbot-corpus language, a line each."""
    from cpudist.data.read import read_records, resolve_data_path

    rows = read_records(resolve_data_path(f"chatterbot:{language}", str(cache_dir)))
    return [message["content"] for row in rows for message in row["messages"]]


# How each family's SentencePiece model is made: Llama 2 / Mistral 7B put "<unk>" "<s>" "</s>"
# first and a space before the text; Gemma has "<pad>" "<eos>" "<bos>" "<unk>" and no such space.
SENTENCEPIECE_STYLES: dict[str, tuple[dict[str, object], str]] = {
    "llama": (dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1), "LlamaTokenizer"),
    "gemma": (dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
                   bos_piece="<bos>", unk_piece="<unk>", add_dummy_prefix=False), "GemmaTokenizer"),
}


def save_sentencepiece_tokenizer(target: Path, lines: list[str], style: str = "llama") -> Path:
    """A real SentencePiece BPE tokenizer as Llama 2 and Mistral 7B (or, style="gemma", Gemma)
    have one (byte fallback, split digits), trained on lines, saved as transformers saves that
    family's (tokenizer.json); the sentencepiece model itself stays in target/sentencepiece/."""
    import sentencepiece
    from transformers import AutoTokenizer

    pieces, tokenizer_class = SENTENCEPIECE_STYLES[style]
    source = target / "sentencepiece"
    source.mkdir(parents=True)
    (source / "corpus.txt").write_text("\n".join(lines), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(source / "corpus.txt"), model_prefix=str(source / "tokenizer"), vocab_size=600,
        model_type="bpe", byte_fallback=True, split_digits=True, character_coverage=1.0,
        allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", minloglevel=2, **pieces)
    (source / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": tokenizer_class, "add_bos_token": True, "legacy": False}))
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return target


# The split rule of GPT-4o's o200k vocabulary (Phi-4 mini, Llama 4), as its tokenizer.json holds it.
GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def save_gpt4o_style_tokenizer(target: Path, lines: list[str]) -> Path:
    """A byte-level BPE tokenizer made as Phi-4 mini's (GPT-4o's split rule, then bytes; its
    special tokens), trained on lines and saved as transformers saves it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GPT4O_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=1200, special_tokens=special, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>",
                                        eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
                               "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tokenizer.save_pretrained(target)
    return target


# Each Gemma's own features, sized so that each one changes the logits of a 64-token text
# (with head_dim=32 and initializer_range=0.2).
GEMMA_FEATURES: dict[str, dict[str, object]] = {
    "gemma": {},
    # Soft-capped attention and output logits; every other layer slides over 16 tokens.
    "gemma2": dict(num_hidden_layers=4, sliding_window=16, query_pre_attn_scalar=32,
                   attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    # Q/K norms; sliding layers with their own rope base (the releases use llama.cpp's default
    # of 10000 there, so another value shows whether the base travels); the full layers' rope
    # scaled linearly, as in the 4B/12B/27B releases.
    "gemma3_text": dict(num_hidden_layers=4, sliding_window=16, query_pre_attn_scalar=32,
                        layer_types=["sliding_attention", "full_attention"] * 2,
                        rope_parameters={
                            "full_attention": {"rope_type": "linear", "factor": 8.0,
                                               "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 5e4}}),
}


# Phi-3 mini 4k's rope, and Phi-3.5 / 128k's LongRoPE: past 32 tokens (the "original" context
# here) the long factors and the attention factor apply, in transformers as in llama.cpp at a
# context of 512.
PHI3_ROPES: dict[str, dict[str, object]] = {
    "default": {},
    "longrope": dict(max_position_embeddings=512, original_max_position_embeddings=32,
                     rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                      "original_max_position_embeddings": 32,
                                      "long_factor": [1.0 + 0.5 * i for i in range(8)],
                                      "short_factor": [1.0 + 0.1 * i for i in range(8)]}),
}


def chat_rows() -> list[dict]:
    """The small chat data set of the tests (32 samples)."""
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in CHAT_ROWS * 4]


def _tiny_sizes(tokenizer: Any, sizes: dict[str, object]) -> dict[str, object]:
    """The tiny models' config: two layers of width 64, the tokenizer's vocabulary and special
    tokens, then the caller's sizes."""
    return {**dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True), **sizes}


def make_tiny_model(kind: str, tokenizer_dir: Path, target: Path, **sizes: object) -> Path:
    """A random-weight causal LM of a real architecture (kind: its transformers model type, such as
    llama, mistral, qwen2, qwen3), saved with a real tokenizer; sizes overrides the config's
    (hidden_size=..., num_hidden_layers=..., rope_parameters=...)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **_tiny_sizes(tokenizer, sizes)))
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    return target


def make_tiny_gemma3_with_vision(tokenizer_dir: Path, target: Path, **text_sizes: object) -> Path:
    """A random Gemma3ForConditionalGeneration (a text model beside a small vision tower), saved
    as transformers saves the released Gemma 3 4B/12B/27B checkpoints; text_sizes overrides the
    text model's config."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = _tiny_sizes(tokenizer, {"head_dim": 16, "query_pre_attn_scalar": 16, **text_sizes})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=32, patch_size=8)
    config = AutoConfig.for_model("gemma3", text_config=text, vision_config=vision,
                                  mm_tokens_per_image=4)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    return target


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return path


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


def venv_mpirun() -> str | None:
    """The mpirun cpudist launch would use (the venv's own first), or None."""
    from cpudist.errors import UserError
    from cpudist.launch.mpi import find_mpirun

    try:
        return find_mpirun()
    except UserError:
        return None


def mpirun_cmd(np: int) -> list[str]:
    """Real mpirun from the venv (Open MPI wheel of the [mpi] extra)."""
    mpirun = venv_mpirun()
    if mpirun is None:
        pytest.skip("mpirun not installed (pip install 'cpudist[mpi]')")
    cmd = [mpirun, "-np", str(np), "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd


def run(cmd: list, timeout: float = 600, **kwargs: object) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **kwargs.pop("env", {})}  # type: ignore[dict-item]
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO, **kwargs)  # type: ignore[call-overload]


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    """Puts back what a command run in this process changes in it: cpudist's log handlers (bound
    to the stream that was sys.stdout then, closed once that test's capture ends), the capture of
    Python warnings into logging, torch's threads and RNG, the CPU affinity, the handlers of the
    signals a run stops on, the environment (OMP_NUM_THREADS, HF_HUB_OFFLINE, ...) and the thread
    excepthook. Library verbosity and progress bars stay as the command left them."""
    loggers = [logging.getLogger(name) for name in ("cpudist", "cpudist.progress", "py.warnings")]
    saved_loggers = [(log, list(log.handlers), log.level, log.propagate) for log in loggers]
    showwarning = warnings.showwarning
    threads = torch.get_num_threads()
    rng = torch.random.get_rng_state()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    signals = {sig: signal.getsignal(sig)
               for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)}
    environ = dict(os.environ)
    excepthook = threading.excepthook
    try:
        yield
    finally:
        for log, handlers, level, propagate in saved_loggers:
            log.handlers[:] = handlers
            log.setLevel(level)
            log.propagate = propagate
        if warnings.showwarning is not showwarning:
            logging.captureWarnings(False)
            warnings.showwarning = showwarning
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)
        if affinity is not None and os.sched_getaffinity(0) != affinity:
            os.sched_setaffinity(0, affinity)
        for sig, handler in signals.items():
            signal.signal(sig, handler)
        for name in set(os.environ) - set(environ):
            del os.environ[name]
        os.environ.update(environ)
        threading.excepthook = excepthook


def cli_in_process(capsys: pytest.CaptureFixture[str], args: list) -> subprocess.CompletedProcess:
    """`cpudist ARGS` run by cpudist.cli.main in this process (seconds faster than a new process,
    which imports torch and transformers again): exit code, stdout and stderr as a process would
    give them, the test process as it was before (process_state_kept)."""
    from cpudist.cli import main

    argv = [str(a) for a in args]
    capsys.readouterr()  # only this command's output
    with process_state_kept():
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's errors (code 2) and --help
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)  # as the interpreter prints it
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["cpudist", *argv], code, out, err)


def cpudist_in_process(args: list) -> int:
    """`cpudist ARGS` in this process, for fixtures, which have no capsys: its output goes to
    pytest's own capture; returns the exit code."""
    from cpudist.cli import main

    with process_state_kept():
        return main([str(a) for a in args])


def signal_after(monkeypatch: pytest.MonkeyPatch, steps: int, sig: int = signal.SIGTERM) -> None:
    """This process gets `sig` once an in-process run has logged `steps` steps: between two steps,
    where a signal from outside lands in a real run (start_and_signal sends a real one to a real
    process, for the tests where that boundary is the point)."""
    from cpudist.records import StepRecord
    from cpudist.report.metrics import MetricsLog

    write = MetricsLog.write

    def write_then_signal(self: MetricsLog, record: Any) -> None:
        write(self, record)
        if isinstance(record, StepRecord) and record.step == steps:
            os.kill(os.getpid(), sig)

    monkeypatch.setattr(MetricsLog, "write", write_then_signal)


# --------------------------------------------------------------------------- a run's metrics


def metric_records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in metric_records(out) if "loss" in r]


def start_and_signal(cmd: list, out: Path, sig: int, after_steps: int = 2,
                     target: Callable[[subprocess.Popen], int] | None = None
                     ) -> subprocess.CompletedProcess:
    """Start cmd, send sig once `after_steps` steps are in metrics.jsonl, and wait for the run to
    exit by itself. The signal goes to the started process, or to the pid target(process) picks."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 300
        while len(step_losses(out)) < after_steps:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.02)
        if target is None:
            proc.send_signal(sig)
        else:
            os.kill(target(proc), sig)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def stopped_step(output: str) -> int:
    for line in output.splitlines():
        if "stopped by signal" in line:
            return int(line.split(" after step ")[1].split(";")[0])
    raise AssertionError(f"no 'stopped by signal' message in:\n{output[-3000:]}")


# --------------------------------------------------------------------------- equality tests


def lora_model(path: Path, cache: Path, dtype: str = "float32", share: bool = False,
               **model_settings: object) -> torch.nn.Module:
    """A peft model as training builds it, with random LoRA B so both LoRA matrices get gradient."""
    from cpudist.config import Config, LoraConfig, ModelConfig
    from cpudist.model.load import build_model
    from cpudist.runtime.precision import choose_precision

    torch.manual_seed(0)
    model, _, _ = build_model(
        Config(model=ModelConfig(path=str(path), dtype=dtype, share_frozen_weights=share,
                                 cache_dir=str(cache), **model_settings),
               lora=LoraConfig(r=4, alpha=8, dropout=0.0)), choose_precision(dtype))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    return model


def random_split(lengths: list[int], vocab: int, prompt: int = 3) -> TokenizedSplit:
    """Samples of random tokens of these lengths; the first `prompt` positions carry no loss."""
    from cpudist.data.tokenize import IGNORE, TokenizedSplit

    generator = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
    labels = [[IGNORE] * prompt + row[prompt:] for row in ids]
    return TokenizedSplit(ids, labels)


def grad_atol(reference: torch.Tensor) -> float:
    # fp32 sums in a different order: differences scale with the gradient's own size.
    return 1e-4 * float(reference.abs().max())


def loss_and_grads(module: torch.nn.Module, batch: Batch) -> tuple[float, int, dict[str, torch.Tensor]]:
    """(loss sum, label tokens, gradient of every trainable parameter) of one forward/backward."""
    from cpudist.model.adapters import trainable_parameters

    module.zero_grad(set_to_none=True)
    total, count, _ = module(**batch.as_kwargs())
    total.backward()
    grads = {name: p.grad.clone() for name, p in trainable_parameters(module)}
    return float(total.detach()), int(count), grads


def bench_result(**figures: Any) -> BenchResult:
    """A BenchResult with these figures and neutral values for the rest."""
    from cpudist.records import BenchResult

    neutral: dict[str, Any] = dict(
        tokens_per_s=1.0, label_tokens_per_s=1.0, samples_per_s=1.0, s_per_step=1.0,
        s_per_step_median=1.0, label_tokens_per_s_best_step=1.0, step_s=[1.0],
        padding_fraction=0.0, mfu=0.5, mfu_valid=True, model_tflops=0.1, peak_tflops=0.2,
        peak_samples_tflops=[0.2], peak_rss_gb=[1.0], node_pss_gb=1.0, framework="cpudist",
        dtype="float32", threads=1, world_size=1, steps=1, warmup_steps=0, data="synthetic",
        model_dir="model", allocator="none", flop_model={}, config={})
    return BenchResult(**{**neutral, **figures})
