"""A large chat-format JSONL file for the data-at-scale figures (docs/PERFORMANCE.md).

    python -m cpudist.bench.chat_data OUT.jsonl --rows 2000000 [--bad-line N] [--seed 0]
    python -m cpudist.bench.chat_data FILE.jsonl --tokenize 1 2 [CONFIG] [k=v ...]

The first writes the file; the second tokenizes it (not cached: a fresh cache directory each
time) with 1, then 2 worker processes, for the config's model and data settings (default
configs/quickstart.yaml), and prints rows/s and the ratio to the first.

    python -m cpudist.bench.chat_data --time-run -- cpudist train ...

runs a command and prints the seconds from its start to its first training step (the first
"step 1/" line), to its end, and the largest peak RSS of it and its children.

Conversations of one to three user/assistant turns of words drawn from a fixed vocabulary,
about 750 bytes a row (2,000,000 rows: about 1.5 GB), the same file for the same seed. --bad-line
writes line N cut short (malformed JSON), to time how soon a bad row is reported.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

WORDS = (  # noqa: SIM905 (one readable block of words)"the of and to in is that for it as was with be by on not he this are or his from at "
         "which but have an they you were her she there one all we their can been has more if "
         "will would when what so no out up into do time only could new about other two then "
         "first any my now such like our over man me even most made after also did many before "
         "must through back years where much your way well down should because each just those "
         "people how too little state good very make world still own see men work long get here "
         "between both life being under never day same another know while last might us great "
         "old year off come since against go came right used take three model data train step "
         "memory cluster node rank token batch answer question").split()


def conversation(rng: random.Random) -> dict:
    messages = []
    for _ in range(rng.choice((1, 1, 2, 3))):
        question = " ".join(rng.choices(WORDS, k=rng.randint(8, 30))).capitalize() + "?"
        answer = " ".join(rng.choices(WORDS, k=rng.randint(26, 80))).capitalize() + "."
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": answer}]
    return {"messages": messages}


def write(path: Path, rows: int, seed: int = 0, bad_line: int | None = None) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as handle:
        for number in range(1, rows + 1):
            line = json.dumps(conversation(rng))
            if number == bad_line:
                line = line[: len(line) // 2]  # cut short: not JSON
            handle.write(line + "\n")


def time_tokenize(path: Path, workers: list[int], config_path: str | None,
                  overrides: list[str]) -> None:
    """Rows/s of tokenizing `path` with each worker count (a fresh cache each time)."""
    import tempfile
    import time

    from cpudist.config import load_config
    from cpudist.data.tokenize import load_tokenized
    from cpudist.model.load import load_tokenizer, resolve_model_path
    from cpudist.runtime.process import quiet_libraries

    quiet_libraries()
    config = load_config(config_path, overrides)
    tokenizer = load_tokenizer(resolve_model_path(config.model))
    first = 0.0
    for count in workers:
        with tempfile.TemporaryDirectory(dir=path.parent) as cache:
            data = config.data.model_copy(update={"cache_dir": cache, "tokenize_workers": count})
            started = time.perf_counter()
            split, stats = load_tokenized(path, tokenizer, data)
            rate = stats["samples"] / (time.perf_counter() - started)
        first = first or rate
        print(f"{count} worker(s): {stats['samples']:,} rows, {len(split):,} samples, "
              f"{rate:,.0f} rows/s ({rate / first:.2f}x)", flush=True)


def time_run(command: list[str]) -> None:
    """Seconds to the first training step and to the end, and the peak RSS, of a command."""
    import resource
    import subprocess
    import time

    started = time.perf_counter()
    first_step = None
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, bufsize=1) as child:
        assert child.stdout is not None
        for line in child.stdout:
            sys.stdout.write(line)
            if first_step is None and line.lstrip().startswith("step 1/"):
                first_step = time.perf_counter() - started
    total = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6
    step = "none" if first_step is None else f"{first_step:.1f} s"
    print(f"time-run: exit {child.returncode}, first step {step}, end {total:.1f} s, "
          f"peak RSS {peak:.2f} GB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    if sys.argv[1:2] == ["--time-run"]:
        time_run(sys.argv[3:] if sys.argv[2:3] == ["--"] else sys.argv[2:])
        return
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bad-line", type=int, default=None)
    parser.add_argument("--tokenize", type=int, nargs="+", metavar="WORKERS")
    parser.add_argument("settings", nargs="*", help="[CONFIG] k=v ... (with --tokenize)")
    args = parser.parse_args()
    if args.tokenize:
        config = next((s for s in args.settings if "=" not in s), "configs/quickstart.yaml")
        time_tokenize(args.out, args.tokenize, config, [s for s in args.settings if "=" in s])
    else:
        write(args.out, args.rows, args.seed, args.bad_line)


if __name__ == "__main__":
    main()
