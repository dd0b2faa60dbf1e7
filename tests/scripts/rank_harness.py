"""Run `cpudist ARGS` as one MPI rank, recording what the rank prints and which files it writes.

Used by tests/train/test_distributed.py as
`mpirun -np N python tests/scripts/rank_harness.py LOGDIR ARGS...`.
Before cpudist starts, this rank's stdout/stderr are sent to LOGDIR/rank<r>.out/.err and a Python
audit hook records every path the process opens for writing, creates, renames or removes; at exit
that list goes to LOGDIR/rank<r>.writes.json (the harness's own files are not recorded).
"""

from __future__ import annotations

import atexit
import json
import os
import sys

WRITE_EVENTS = {"os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "os.unlink",
                "shutil.rmtree", "shutil.move", "shutil.copyfile", "os.symlink", "os.link",
                "os.truncate"}


def main() -> int:
    log_dir, *args = sys.argv[1:]
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0"))
    os.makedirs(log_dir, exist_ok=True)
    for stream, suffix in ((sys.stdout, "out"), (sys.stderr, "err")):
        stream.flush()
        fd = os.open(os.path.join(log_dir, f"rank{rank}.{suffix}"),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, stream.fileno())
        os.close(fd)
    report = os.path.join(log_dir, f"rank{rank}.writes.json")
    written: list[str] = []

    def hook(event: str, hook_args: tuple) -> None:
        if event == "open":
            path, mode, flags = hook_args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                mode is None and isinstance(flags, int)
                and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            if writing and not isinstance(path, int):
                written.append(os.fsdecode(path))
        elif event in WRITE_EVENTS and hook_args and not isinstance(hook_args[0], int):
            written.append(os.fsdecode(hook_args[0]))

    def dump() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        payload = json.dumps(sorted(set(written)))
        fd = os.open(report, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, payload.encode())
        os.close(fd)

    atexit.register(dump)
    sys.addaudithook(hook)
    from cpudist.cli import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
