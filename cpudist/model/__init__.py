"""The model: base loading (HF directory, built-in GGUF), shared frozen weights, adapters, loss."""
