"""The figures and command outputs the code derives (plans, FLOPs and GPU-hours, parameter counts, `--validate`
and `crate-clip models` output), written into README.md, BENCHMARKS.md and docs/ between markers, so no page can
disagree with the code:

    <!-- generated: plan l-14 -->
    ...what the block's generator gives...
    <!-- /generated -->

    python -m crate_clip.doc_outputs                # rewrite every block
    python -m crate_clip.doc_outputs --check        # exit 1 naming the stale blocks; write nothing
    python -m crate_clip.doc_outputs --check --slow # also the slow blocks (the plan's memory trace, ~25 s)

Measured figures (timings, accuracies) are not generated: they keep the date, machine and command they were
measured with. Counting runs on the meta device (no weights allocated), so the fast blocks take seconds.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
REGENERATE = "python -m crate_clip.doc_outputs"
BLOCK = re.compile(r"<!-- generated: (?P<name>[^>]+?) -->(?P<body>.*?)<!-- /generated -->", re.S)
L14 = "configs/datacomp/crate_alpha_clipa_l-14.yaml"
PLAN_L14 = [L14, "--gpus", "64", "--gpu-memory", "80GiB", "--gpu", "h100"]
VALIDATE_B16 = ["--config", "configs/datacomp/crate_alpha_clipa_b-16.yaml", "--validate",
                "--set", 'data.sources=["pipe:aws s3 cp s3://bucket/{00000000..00139827}.tar -"]',
                "--set", "eval.evals=[]"]
MODELS_TINY = ["--filter", "tiny"]


@dataclass(frozen=True)
class Generator:
    """What a block holds: `make()` gives its text; `slow`: tens of seconds on a CPU, checked only with --slow."""
    make: Callable[[], str]
    slow: bool = False


def _quote(arg: str) -> str:
    """A shell word as the docs write it."""
    return f"'{arg}'" if any(c in arg for c in ' "[]{}$') else arg


def _run(main, argv: list[str]) -> str:
    """stdout of a CLI entry point run in this process, from the repository root (paths as the docs give them)."""
    out = io.StringIO()
    with contextlib.chdir(REPO), contextlib.redirect_stdout(out):
        code = main(argv)
    if code != 0:
        raise RuntimeError(f"{argv}: exit {code}")
    return out.getvalue().rstrip("\n")


def _shown(command: str, argv: list[str], output: str, wrap_after: int = 4) -> str:
    """A fenced block: the command (wrapped after `wrap_after` words) and what it printed."""
    words = [_quote(a) for a in argv]
    line = " ".join([command] + words[:wrap_after]) + (" \\\n    " + " ".join(words[wrap_after:])
                                                       if len(words) > wrap_after else "")
    return f"\n```\n$ {line}\n{output}\n```\n"


@functools.cache
def plan_output(memory: bool) -> str:
    """What `crate-clip plan` prints for the paper's L/14 recipe on 64 H100s (with or without the memory trace)."""
    from crate_clip.train.plan_cli import main

    return _run(main, PLAN_L14 + ([] if memory else ["--no-memory"]))


def _plan_block(memory: bool) -> str:
    return _shown("crate-clip plan", PLAN_L14 + ([] if memory else ["--no-memory"]), plan_output(memory),
                  wrap_after=3)


def _plan_total() -> str:
    """'629 GPU-hours (9.8 h wall on 64 H100s)' from the plan's last line."""
    last = plan_output(False).splitlines()[-1]
    wall, hours = re.fullmatch(r"all stages: ([\d.]+) h wall, ([\d,]+) GPU-hours", last).groups()
    return f"**{hours} GPU-hours** ({wall} h wall on 64 H100s)"


def _plan_flops() -> str:
    """The per-sample FLOP lines of the plan, one per stage."""
    lines = [line.strip() for line in plan_output(False).splitlines()]
    stages = [line.split(":")[0].removeprefix("stage ") for line in lines if line.startswith("stage ")]
    flops = [line.removeprefix("FLOPs per sample").strip() for line in lines if line.startswith("FLOPs per sample")]
    return "\n" + "\n".join(f"- {s}: {f}" for s, f in zip(stages, flops)) + "\n"


def _shuffle_memory() -> str:
    """'64 x 3,906 x 36 KB = 8.38 GiB' (a node) from the plan's shuffle-buffer line (the same in both stages)."""
    line = next(line for line in plan_output(False).splitlines() if "shuffle buffers" in line)
    streams, samples, size = re.search(r"(\d+) stream\(s\) a node \(\d+ a rank\) x ([\d,]+) samples = ([\d.]+ \w+)",
                                       line).groups()
    kb = re.search(r"\(([\d.]+) KB per raw", line).group(1)
    return f"{streams} x {samples} x {kb} KB = {size}"


MASKED_L14 = ["stages.0.context_length=8", "stages.0.image_mask=random", "stages.0.image_mask_ratio=0.5",
              "model.lock_text=false", "model.lock_logit_scale=false", "model.text_pretrained=null"]


def _masked_l14_flops() -> str:
    """Training FLOPs per sample of the L/14 config's 84 px stage at 8 tokens with half the patches masked."""
    from crate_clip.train.run.run_config import load_run_config
    from crate_clip.train.stage_setup.stage_model import resolve_stage

    cfg = load_run_config(REPO / L14, MASKED_L14, check_paths=False)
    return f"{resolve_stage(cfg, 0).counts.flops / 1e9:.1f} GFLOP"


def _validate_block() -> str:
    from crate_clip.train.cli import main

    return _shown("crate-clip train", VALIDATE_B16, _run(main, VALIDATE_B16), wrap_after=3)


def _models_block() -> str:
    """What `crate-clip models --filter tiny` prints (docs/cli.md): every tiny registered config, counted on the meta
    device."""
    from crate_clip.models_cli import main

    return _shown("crate-clip models", MODELS_TINY, _run(main, MODELS_TINY))


def _model_counts() -> str:
    """The parameter counts docs/models.md quotes, counted on the meta device."""
    from crate_clip.models import create_clip, image_tower_param_count

    model = create_clip("CRATE-alpha-CLIPA-L-14", device="meta")
    total = sum(p.numel() for p in model.parameters())
    text = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("visual.") and n != "logit_scale")
    return (f"`image_tower_param_count(\"CRATE-alpha-CLIPA-H-14\")` gives "
            f"{image_tower_param_count('CRATE-alpha-CLIPA-H-14'):,}. The L/14 CLIPA model has {total:,} (its text "
            f"tower {text:,}).")


GENERATORS: dict[str, Generator] = {
    "plan l-14": Generator(lambda: _plan_block(False)),
    "plan l-14 total": Generator(_plan_total),
    "plan l-14 flops": Generator(_plan_flops),
    "plan l-14 memory": Generator(lambda: _plan_block(True), slow=True),
    "plan l-14 shuffle buffers": Generator(_shuffle_memory),
    "validate b-16": Generator(_validate_block),
    "flops l-14 masked": Generator(_masked_l14_flops),
    "model counts": Generator(_model_counts),
    "models tiny": Generator(_models_block),
}


def doc_files() -> list[Path]:
    """The pages that may hold generated blocks."""
    return [REPO / "README.md", REPO / "BENCHMARKS.md"] + sorted((REPO / "docs").rglob("*.md"))


def render(text: str, slow: bool = False, fast: bool = True) -> str:
    """`text` with every block regenerated (slow blocks kept as they are unless `slow`, the others unless `fast`);
    an unknown block name is a ValueError naming it."""
    def fill(match: re.Match) -> str:
        name = match["name"].strip()
        if name not in GENERATORS:
            raise ValueError(f"unknown generated block {name!r}; known: {', '.join(GENERATORS)}")
        gen = GENERATORS[name]
        body = gen.make() if (slow if gen.slow else fast) else match["body"]
        return f"<!-- generated: {name} -->{body}<!-- /generated -->"

    return BLOCK.sub(fill, text)


def stale_blocks(text: str, slow: bool = False, fast: bool = True) -> list[str]:
    """Names of the blocks of `text` whose content is not what the code gives now (the slow ones with `slow`, the
    others with `fast`)."""
    fresh = {m["name"].strip(): m["body"] for m in BLOCK.finditer(render(text, slow, fast))}
    return [m["name"].strip() for m in BLOCK.finditer(text) if fresh[m["name"].strip()] != m["body"]]


def main(argv=None) -> int:
    """Rewrite the generated blocks, or with --check list the stale ones (exit 1)."""
    p = argparse.ArgumentParser(prog=REGENERATE, description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when a block is stale; write nothing")
    p.add_argument("--slow", action="store_true", help="also the slow blocks (the plan's memory trace, ~25 s)")
    args = p.parse_args(argv)
    stale = []
    for path in doc_files():
        text = path.read_text()
        if not BLOCK.search(text):
            continue
        if args.check:
            stale += [f"{path.relative_to(REPO)}: {name}" for name in stale_blocks(text, args.slow)]
            continue
        new = render(text, args.slow)
        if new != text:
            path.write_text(new)
            print(f"wrote {path.relative_to(REPO)}")
    if args.check:
        print("\n".join(f"stale: {s}" for s in stale) + (f"\nrun `{REGENERATE}`" if stale else "all generated "
                                                           "blocks are current"))
        return 1 if stale else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
