"""cpudist: LoRA fine-tuning of Hugging Face causal language models on CPUs, one laptop to a cluster.

The Python API (cpudist.api): train, plan and make_config; errors are UserError (bad input) and
Preempted (stopped by a signal after a checkpoint). Importing cpudist stays instant: torch loads
when a function runs."""

from cpudist.api import make_config, plan, train
from cpudist.errors import ExitCode, PlanRefused, Preempted, UserError

__version__ = "0.1.0"
__all__ = ["ExitCode", "PlanRefused", "Preempted", "UserError", "make_config", "plan", "train",
           "__version__"]
