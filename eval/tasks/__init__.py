"""Evaluation tasks, one module each: `Settings` (its schema), `run(model, settings, context) -> dict of
numbers` and `summary(metrics) -> str` (one line); crate_clip.eval.registry finds them. A new task is a new file here."""
