"""One module per command: its flags and its entry.

Each module defines HELP (one line for `cpudist --help`), DESCRIPTION, `add_arguments(parser)` and
`run(args) -> exit code`, and may set INTERMIXED = False when its arguments cannot be parsed with
argparse's parse_intermixed_args. Modules import torch, transformers and the rest of cpudist only
inside `run`, so that `--help` is instant. A new command is one module here plus one line in
cpudist.cli.COMMANDS.
"""
