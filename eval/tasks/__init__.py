"""Evaluation tasks, one module each: its settings schema `Settings` (pydantic; `type` is the module's name),
`run(model, settings, context) -> dict of numbers` and `summary(metrics) -> str` (one line), beside the task's own
evaluation loop. A module imports torch only inside the functions that run the task, so that the CLI's --help and a
config's validation need no torch. A new task is a new file here (crate_clip.eval.registry finds it)."""
