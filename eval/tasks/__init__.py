"""Evaluation tasks, one module each, registered by being here (crate_clip.eval.registry finds them): `Settings`
(its schema), `run(model, settings, context) -> dict of numbers` and `summary(metrics) -> str` (one line), beside
the task's own evaluation loop. A new task is a new file here."""
