"""`crate-clip plan` of the paper's L/14 recipe (the memory trace on), with and without the planner's frozen heap
(planner.older_objects_frozen: each traced pass collects only its own garbage), alternated in one process after a
first untimed plan (imports, first-call set-up). Prints each plan's CPU seconds and whether the outputs are equal.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_plan_gc.py
"""
import contextlib
import io
import resource

from crate_clip.doc_outputs import PLAN_L14
from crate_clip.train.plan_cli import main
from crate_clip.train.planning import planner


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed_plan(frozen) -> tuple[float, str]:
    """(CPU seconds, printed plan) with `frozen` as the planner's heap freeze (contextlib.nullcontext: none, so
    each pass's gc.collect walks the whole process, as before)."""
    planner.older_objects_frozen, out, start = frozen, io.StringIO(), cpu_s()
    with contextlib.redirect_stdout(out):
        main(PLAN_L14)
    return cpu_s() - start, out.getvalue()


def main_bench() -> None:
    frozen = planner.older_objects_frozen
    with contextlib.redirect_stdout(io.StringIO()):
        main(PLAN_L14 + ["--no-memory"])
    runs = {"before": [], "after": []}
    for arm in ("before", "after", "after", "before"):
        runs[arm].append(timed_plan(contextlib.nullcontext if arm == "before" else frozen))
    print({arm: [round(s, 2) for s, _ in r] for arm, r in runs.items()},
          "same output:", runs["before"][0][1] == runs["after"][0][1])


if __name__ == "__main__":
    main_bench()
