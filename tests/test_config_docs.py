"""docs/config.md is generated from the run-config schemas: the committed page must be what they give now,
and every key must explain itself (a Field description, or a section's docstring)."""
from pydantic import BaseModel

from crate_clip.config_docs import DOC_PATH, REGENERATE, render, schema_sections


def test_committed_config_reference_is_current():
    assert DOC_PATH.read_text() == render(), f"docs/config.md is stale: run `{REGENERATE}` and commit the result"


def test_every_key_has_a_description():
    sections = schema_sections()
    assert [title for title, _ in sections][:4] == ["Top level", "`run`", "`model`", "`data`"]
    assert {"`stages[]`", "`eval.evals[]` (`type: zeroshot`)", "`eval.evals[]` (`type: linear_probe`)"} <= {
        title for title, _ in sections}
    bare = [f"{title}: {name}" for title, cls in sections for name, field in cls.model_fields.items()
            if not (field.description or (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)))]
    assert bare == [], f"keys without Field(description=...): {bare}"
