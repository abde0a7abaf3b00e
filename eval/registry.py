"""The evaluation tasks and what the trainer, the CLI and the logger need of them: the settings schema of every task
(one union, told apart by `type`), parsing with errors that name the key, and running a declared evaluation.

A task NAME is one file, crate_clip.eval.tasks.NAME: its settings class `Settings` (whose `type` is NAME), `run`,
`summary`, optionally `details` and `data_problems`. A task module imports torch only inside the functions that run
the task, so parsing a config or building the CLI's --help loads no torch."""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, Union

from pydantic import Discriminator, Tag, TypeAdapter, ValidationError

import crate_clip.eval.tasks
from crate_clip.core.config_schema import error_lines
from crate_clip.eval.eval_settings import EvalSettings

DEFAULT_TYPE = "zeroshot"   # an evaluation declared without a type


def task_module(name: str) -> ModuleType:
    """The code of task `name` (eval/tasks/NAME.py)."""
    return importlib.import_module(f"crate_clip.eval.tasks.{name}")


def task_names() -> list[str]:
    """Every task, by name: the modules of eval/tasks/ (a new file there is a new task)."""
    return sorted(m.name for m in pkgutil.iter_modules(crate_clip.eval.tasks.__path__) if not m.name.startswith("_"))


# task name (the `type` key, the module eval/tasks/NAME.py) -> its settings, by name as the docs list them
TASK_SETTINGS = {name: task_module(name).Settings for name in task_names()}


def task_help(name: str) -> str:
    """The task's one-line description (its settings' docstring's first line)."""
    return (TASK_SETTINGS[name].__doc__ or name).splitlines()[0]


def _type_of(value: Any) -> Any:
    return value.get("type", DEFAULT_TYPE) if isinstance(value, dict) else getattr(value, "type", None)


EvalSpec = Annotated[Union[tuple(Annotated[cls, Tag(name)] for name, cls in TASK_SETTINGS.items())],
                     Discriminator(_type_of)]
_ADAPTER = TypeAdapter(EvalSpec)


def parse_eval(raw: dict | EvalSettings) -> EvalSettings:
    """The settings of one declared evaluation; a bad key raises ValueError naming it and the fix."""
    if isinstance(raw, EvalSettings):
        return raw
    try:
        return _ADAPTER.validate_python(raw)
    except ValidationError as err:
        unknown = sorted(str(e["loc"][-1]) for e in err.errors() if e["type"] == "extra_forbidden")
        name = raw.get("name", "?") if isinstance(raw, dict) else "?"
        head = f"eval {name!r}" + (f": unknown keys {unknown}" if unknown else "")
        raise ValueError(head + ":\n  " + "\n  ".join(error_lines(err, EvalSpec))) from None


@dataclass
class EvalContext:
    """What every task gets besides its settings: the model's tokenizer and transform, where to run."""

    tokenizer: Any
    preprocess: Any
    device: str = "cpu"
    precision: str = "fp32"
    cache_dir: str | Path | None = None
    progress: bool = True
    per_image: bool = False   # zeroshot: also each image's top-1 class (`eval zeroshot --per-image-out`)

    def loop_args(self, settings: EvalSettings) -> dict:
        """The keyword arguments every evaluation loop takes."""
        return dict(batch_size=settings.batch_size, device=self.device, precision=self.precision,
                    num_workers=settings.num_workers, progress=self.progress, max_images=settings.max_images,
                    max_unreadable_fraction=settings.max_unreadable_fraction)


def run_task(model, settings: dict | EvalSettings, context: EvalContext) -> dict:
    """Run one declared evaluation; returns its metrics (numbers, plus lists such as per-class rows)."""
    settings = parse_eval(settings)
    return task_module(settings.type).run(model, settings, context)


def data_problems(settings: EvalSettings) -> list[tuple[str, str]]:
    """What the declared evaluation's files lack (key, problem with the fix), found before any model exists:
    the task's own `data_problems`, none for a task without one."""
    check = getattr(task_module(settings.type), "data_problems", None)
    return check(settings) if check else []


def summary_line(metrics: dict, *, eval_type: str) -> str:
    """The task's one-line summary of its metrics."""
    return task_module(eval_type).summary(metrics)
