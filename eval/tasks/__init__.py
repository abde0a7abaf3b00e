"""Evaluation tasks, one module each: `run(model, settings, context) -> dict of numbers` and `summary(metrics) -> str`
(one line), beside the task's own evaluation loop; `Settings` is the task's schema, defined in
crate_clip.eval.task_settings (pydantic only, so that the CLI's --help and a config's validation need no torch). A
new task is a new file here and its settings class registered in task_settings.TASK_SETTINGS."""
