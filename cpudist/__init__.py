"""cpudist: LoRA fine-tuning of Hugging Face causal language models on CPUs, one laptop to a cluster.

The Python API (cpudist.api): train, plan, make_config, evaluate, generate, predict, merge and
export; errors are UserError (bad input) and Preempted (stopped by a signal after a
checkpoint). Importing cpudist stays instant: torch loads when a function runs."""

from cpudist.api import evaluate, export, generate, make_config, merge, plan, predict, train
from cpudist.errors import ExitCode, PlanRefused, Preempted, UserError

__version__ = "0.1.0"
__all__ = ["ExitCode", "PlanRefused", "Preempted", "UserError", "evaluate", "export", "generate",
           "make_config", "merge", "plan", "predict", "train", "__version__"]
