"""cpudist: LoRA fine-tuning of Hugging Face causal language models on CPUs, one laptop to a cluster."""

__version__ = "0.1.0"
