"""Figures the code derives, shown in README.md, BENCHMARKS.md and docs/ (plans, FLOPs, GPU-hours, parameter
counts, `--validate` output), are generated blocks: the committed pages must be what the code gives now, and a
derived number edited by hand fails the check. Measured figures are not generated: those the README gives are ones
BENCHMARKS.md records, with the date and machine."""
import re

import pytest

from crate_clip import doc_outputs
from crate_clip.doc_outputs import BLOCK, GENERATORS, REGENERATE, REPO, doc_files, render, stale_blocks


def _pages() -> dict:
    return {path: path.read_text() for path in doc_files() if BLOCK.search(path.read_text())}


def test_every_generated_block_is_current():
    stale = [f"{path.relative_to(REPO)}: {name}" for path, text in _pages().items() for name in stale_blocks(text)]
    assert stale == [], f"stale generated blocks {stale}: run `{REGENERATE}` and commit the result"


def test_the_pages_hold_the_blocks_the_issues_named():
    names = {str(path.relative_to(REPO)): {m["name"].strip() for m in BLOCK.finditer(text)}
             for path, text in _pages().items()}
    assert {"plan l-14", "plan l-14 total", "plan l-14 flops", "plan l-14 memory",
            "flops l-14 masked"} <= names["BENCHMARKS.md"]
    assert "validate b-16" in names["docs/safety.md"] and "model counts" in names["docs/models.md"]
    assert "models tiny" in names["docs/cli.md"]
    assert "plan l-14 shuffle buffers" in names["docs/data.md"] & names["docs/scaling.md"]
    assert set().union(*names.values()) <= set(GENERATORS)


def test_an_edited_derived_number_fails_the_check():
    text = (REPO / "BENCHMARKS.md").read_text()
    assert stale_blocks(text) == []
    block = next(m for m in BLOCK.finditer(text) if m["name"] == "plan l-14")
    hours = block["body"].splitlines()[-2]             # "all stages: 8.2 h wall, 525 GPU-hours"
    assert hours.startswith("all stages:")
    edited = text.replace(hours, hours.replace("GPU-hours", "0 GPU-hours"), 1)
    assert stale_blocks(edited) == ["plan l-14"]
    assert stale_blocks(edited.replace("**525 GPU-hours**", "**660 GPU-hours**")) == ["plan l-14 total", "plan l-14"]
    assert render(edited) == text                       # regenerating puts the code's number back
    safety = (REPO / "docs" / "safety.md").read_text()
    assert stale_blocks(safety.replace("3,072,491,520 samples", "3,072,500,000 samples")) == ["validate b-16"]


def test_an_unknown_block_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown generated block 'plan x-99'"):
        render("<!-- generated: plan x-99 -->\n<!-- /generated -->")


def test_check_reports_stale_pages_and_writes_nothing(tmp_path, monkeypatch, capsys):
    page = tmp_path / "page.md"
    page.write_text("counts: <!-- generated: model counts -->stale<!-- /generated -->\n")
    monkeypatch.setattr(doc_outputs, "REPO", tmp_path)
    monkeypatch.setattr(doc_outputs, "doc_files", lambda: [page])
    assert doc_outputs.main(["--check"]) == 1
    assert "stale: page.md: model counts" in capsys.readouterr().out and "stale<" in page.read_text()
    assert doc_outputs.main([]) == 0 and doc_outputs.main(["--check"]) == 0
    assert "526,848,000" in page.read_text()


def test_the_readmes_measured_figures_are_dated_benchmarks():
    """Measured figures are not generated: each `mean ± std` the README gives is one BENCHMARKS.md records, and the
    section that gives it says when and on which machine it was measured."""
    benchmarks = (REPO / "BENCHMARKS.md").read_text()
    for section in (REPO / "README.md").read_text().split("\n## "):
        figures = re.findall(r"[+-]?\d+\.\d+ ± \d+\.\d+", section)
        assert not figures or (re.search(r"\b20\d\d-\d\d-\d\d\b", section) and re.search(r"\b\d+-core\b", section)), \
            f"README section {section.splitlines()[0]!r}: its figures need the date and machine of their measurement"
        assert [f for f in figures if f not in benchmarks] == [], "README figures BENCHMARKS.md does not record"


@pytest.mark.slow
def test_the_slow_blocks_are_current():
    """The plan with its activation trace (~25 s on a CPU); the fast blocks are the test above's."""
    text = (REPO / "BENCHMARKS.md").read_text()
    assert stale_blocks(text, slow=True, fast=False) == [], f"run `{REGENERATE} --slow` and commit the result"


@pytest.mark.slow
def test_the_l14_plan_keeps_its_headroom_and_plans_the_same_at_79_gib():
    """Issue 53: the shipped L/14 recipe leaves at least 5% of what a step may use free on 80 GiB after its peaks and
    their margin, and they fit 79 GiB (what an H100 80GB reports) with that headroom, so the plan there is the same
    (the measure does not depend on the memory: the same micro-batch and recomputed blocks fit). Reuses the slow
    block's plan."""
    from crate_clip.doc_outputs import plan_output
    from crate_clip.train.planning.planner import HEADROOM, STEP_MARGIN, fit_budget, usable_bytes

    out = plan_output(True)
    peaks = [float(p) * 2 ** 30 for p in re.findall(r"micro-batch +512 per rank, k = 1.*, peak ([\d.]+) GiB", out)]
    assert len(peaks) == 2 and HEADROOM >= 0.05
    for peak in peaks:   # the step as a fit holds it: the planned peak and the measured shortfall
        assert usable_bytes(80 * 2 ** 30) - peak * (1 + STEP_MARGIN) >= 0.05 * usable_bytes(80 * 2 ** 30)
        assert peak * (1 + STEP_MARGIN) <= fit_budget(79 * 2 ** 30)
    assert len(re.findall(r"headroom .* free \((\d+\.\d)% of", out)) == 2

