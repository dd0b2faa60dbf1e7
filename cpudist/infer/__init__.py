"""Running a trained model: a loaded session, generation, evaluation on a file, task scoring
(`cpudist eval` and `generate`, and the held-out answers of a training run)."""
