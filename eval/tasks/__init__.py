"""Evaluation tasks, one module each: `Settings` (its schema), `run(model, settings, context) -> dict of
numbers` and `summary(metrics) -> str` (one line); eval.registry finds them. A new task is a new file here."""
