"""training_curve.png: the loss against samples seen, the stage boundaries, and every classification evaluation,
each point labelled with how it was taken.

Evaluations at the resolution a stage trains at (at its end or during it: eval.every_samples) form one line, each
point labelled "16px p4"; an evaluation of a stage's weights at another resolution is a point of its own, never
joined to that line: "stage 0 -> 28 px, grid grown (p4)" or "stage 0 -> 28 px, kernel resized (p7)", both where
both were measured (two ways to the same pixels that score differently).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from crate_clip.checkpoint_io.atomic_files import atomic_write
from crate_clip.checkpoint_io.run_layout import METRICS_FILE, PLOT_FILE, RESULTS_FILE, read_jsonl
from crate_clip.train.reporting.whitebox_log import draw_whitebox_curves, whitebox_keys

RESIZE_WORDS = {"grid": "grid grown", "patch": "kernel resized"}


def latest_per_step(records: list[dict]) -> list[dict]:
    """One record per (stage, step), the last written (a resumed run re-logs steps after its checkpoint)."""
    by_key = {}
    for r in records:
        by_key[(r["stage_index"], r["step"])] = r
    return [by_key[k] for k in sorted(by_key)]


def stage_spans(steps: list[dict]) -> list[tuple[int, str, int, float, float]]:
    """(stage index, name, image size, first samples_seen, last samples_seen) of each stage the rows cover."""
    spans: dict[int, list] = {}
    for r in steps:
        span = spans.setdefault(r["stage_index"], [r.get("stage_name", ""), r.get("image_size"),
                                                    r["samples_seen"], r["samples_seen"]])
        span[2], span[3] = min(span[2], r["samples_seen"]), max(span[3], r["samples_seen"])
    ordered = [[i, *spans[i]] for i in sorted(spans)]
    for before, span in zip(ordered, ordered[1:]):   # a stage starts where the one before it ended
        span[3] = before[4]
    return [tuple(span) for span in ordered]


def point_label(row: dict) -> str:
    """How an evaluation was taken, in a few characters: "28px p7" (+ "kernel resized" / "grid grown" when the
    weights were moved to another resolution than their stage's)."""
    patch = f" p{row['patch_size']}" if row.get("patch_size") else ""
    moved = row.get("image_size") != row.get("stage_image_size", row.get("image_size"))
    return f"{row['image_size']}px{patch}" + (f" {RESIZE_WORDS.get(row.get('resize', 'grid'))}" if moved else "")


def eval_series(results: list[dict]) -> dict[tuple, list[dict]]:
    """Classification rows grouped into what is drawn as one line: ('trained',) for each evaluation at the stage's
    own resolution; (stage, size, resize) for a stage's weights taken to another resolution."""
    series: dict[tuple, list[dict]] = {}
    for r in results:
        own = r.get("image_size") == r.get("stage_image_size", r.get("image_size"))
        key = ("trained",) if own else (r["stage_index"], r["image_size"], r.get("resize", "grid"))
        series.setdefault(key, []).append(r)
    for rows in series.values():
        rows.sort(key=lambda r: r["samples_seen"])
    return series


def series_label(key: tuple, rows: list[dict]) -> str:
    """The legend entry of a series."""
    if key == ("trained",):
        return "zero-shot top-1 at the training resolution"
    stage, size, resize = key
    patch = rows[0].get("patch_size")
    return f"stage {stage} -> {size} px, {RESIZE_WORDS.get(resize, resize)}" + (f" (p{patch})" if patch else "")


def write_plot(run_dir: Path) -> Optional[Path]:
    """PNG of the loss against samples seen with the stage boundaries marked and every zero-shot top-1 labelled;
    below it, the white-box curves of each CRATE-alpha tower the run probed."""
    # imported only when a plot is drawn: matplotlib is the slowest import of a run (about half a second)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = latest_per_step(read_jsonl(run_dir / METRICS_FILE))
    steps = [r for r in records if r.get("loss") is not None]
    if not steps:
        return None
    results = [r for r in read_jsonl(run_dir / RESULTS_FILE)   # the live weights' (train.ema's rows: results.jsonl)
               if r.get("top1") is not None and r.get("weights", "live") == "live"]
    towers = whitebox_keys(records)
    if towers:  # per-layer white-box curves of each CRATE-alpha tower under the loss (logging.diagnostics_every)
        fig = plt.figure(figsize=(10, 4.8 + 3.5 * len(towers)), dpi=110)
        grid = fig.add_gridspec(1 + len(towers), 2)
        ax = fig.add_subplot(grid[0, :])
        for row, key in enumerate(towers, start=1):
            draw_whitebox_curves(records, [fig.add_subplot(grid[row, 0]), fig.add_subplot(grid[row, 1])], key=key)
    else:
        fig, ax = plt.subplots(figsize=(10, 4.8), dpi=110)
    ax.plot([r["samples_seen"] for r in steps], [r["loss"] for r in steps], lw=1, color="tab:blue")
    ax.set_xlabel("samples seen")
    ax.set_ylabel("contrastive loss", color="tab:blue")
    _mark_stages(ax, stage_spans(steps))
    if results:
        _draw_evals(ax.twinx(), eval_series(results))
    ax.set_title(run_dir.name, pad=16)
    fig.tight_layout()
    out = run_dir / PLOT_FILE
    try:   # write-then-rename: a full disk leaves the earlier plot (or none), never a 0-byte file
        atomic_write(out, lambda tmp: fig.savefig(tmp, format="png"))
    finally:
        plt.close(fig)
    return out


def _mark_stages(ax, spans: list[tuple]) -> None:
    """A dotted line at each stage's end, the stage named (and its image size) above its span."""
    for index, name, size, first, last in spans:
        ax.axvline(last, color="grey", lw=0.8, ls=":")
        ax.text((first + last) / 2, 1.01, f"stage {index} {name}" + (f" @{size}px" if size else ""),
                transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=8, color="dimgrey")


def _draw_evals(ax2, series: dict[tuple, list[dict]]) -> None:
    """Each series as markers (joined only at the training resolution), each point labelled with its value and
    its resolution / patch."""
    ax2.set_ylabel("zero-shot top-1 (%)", color="tab:red")
    markers = iter(["s", "^", "D", "v", "P", "X", "*"] * 8)
    for k, (key, rows) in enumerate(series.items()):
        xs, ys = [r["samples_seen"] for r in rows], [100 * r["top1"] for r in rows]
        style = "o-" if key == ("trained",) else next(markers)
        ax2.plot(xs, ys, style, ms=6, lw=1, color="tab:red" if key == ("trained",) else None,
                 label=series_label(key, rows))
        for r, x, y in zip(rows, xs, ys):
            # each series' labels on a line of their own: points of one stage's end share an x
            ax2.annotate(f"{y:.1f}% {point_label(r)}", (x, y), textcoords="offset points", xytext=(4, 4 - 11 * k),
                         fontsize=7)
    ax2.set_ylim(0, 100)
    ax2.legend(loc="center right", fontsize=7)
