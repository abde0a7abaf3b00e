"""What every evaluation task's settings share; each task in eval/tasks/ extends them with its own keys.

The same schema serves a run config's `eval.evals` entries and `crate-clip eval TASK` (whose options
are generated from it), so both have the same keys and the same defaults.
"""
from __future__ import annotations

from typing import Optional

from pydantic import Field, model_validator

from crate_clip.core.config_schema import Float, Int, Section
from crate_clip.eval.unreadable_images import DEFAULT_MAX_UNREADABLE_FRACTION


class EvalSettings(Section):
    """One declared evaluation: which task, on which data, in batches of what size."""

    name: str = Field("", description="the name results are logged under (default: the task type)")
    type: str
    data: str = Field("", description="the evaluation set: a val folder, a flat folder with labels, or shards")
    batch_size: Int = Field(256, ge=1, description="images per forward on each rank")
    max_images: Optional[Int] = Field(None, ge=1, description="evaluate this many images (spread evenly) only")
    num_workers: Int = Field(0, ge=0, description="data-loader worker processes per rank")
    max_unreadable_fraction: Float = Field(DEFAULT_MAX_UNREADABLE_FRACTION, ge=0, le=1,
                                           description="refuse the result when more than this fraction of the "
                                                       "images cannot be read (always when none can)")

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, raw):
        if isinstance(raw, dict) and not raw.get("name"):
            return {**raw, "name": raw.get("type") or cls.model_fields["type"].default}
        return raw

    def checks(self) -> list[tuple[str, str]]:
        """An empty data path is an error (there is no default evaluation set)."""
        if not str(self.data).strip():
            return [("data", "empty; fix: the path of the evaluation set")]
        return []
