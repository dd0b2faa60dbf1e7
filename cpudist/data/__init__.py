"""Data: reading files, a registry of formats, tokenization with its cache, batches per rank."""
