"""Benchmark: CRATE-alpha-B/16 vs timm's ViT-B/16 (forward+backward, same batch), and SDPA vs plain MSSA.

Run: .venv/bin/python bench/bench_models.py [--repeats 3] [--batch224 2] [--batch84 8]
Writes its table to BENCHMARKS.md (section `models`). Targets: CRATE-alpha / ViT <= 1.5 (CRATE-alpha does
18 d^2 vs ViT's 12 d^2 matmul MACs per token and layer), SDPA / plain <= 1.0.
"""
import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import timm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import crate_clip  # noqa: E402,F401  (registers the towers)
from crate_clip.models.mssa import MSSA  # noqa: E402
from bench.report import BENCHMARKS_MD, machine_line, write_section  # noqa: E402


AMP = {"fp32": None, "bf16": torch.bfloat16}
_SETTINGS = {"amp": None}


def _sync(x: torch.Tensor) -> None:
    if x.is_cuda:
        torch.cuda.synchronize()


def fwd_bwd(model: torch.nn.Module, x: torch.Tensor) -> None:
    """One training-style step without the optimizer: forward, scalar loss, backward."""
    model.zero_grad(set_to_none=True)
    dtype = _SETTINGS["amp"]
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        out = model(x)
    out = out[0] if isinstance(out, tuple) else out
    out.float().square().mean().backward()


def time_pair(a, b, x, repeats: int):
    """Seconds of each run of a(x) and b(x), interleaved so both see the same machine load; one warm-up each."""
    fwd_bwd(a, x), fwd_bwd(b, x)
    ta, tb = [], []
    for _ in range(repeats):
        for fn, acc in ((a, ta), (b, tb)):
            _sync(x)
            start = time.perf_counter()
            fwd_bwd(fn, x)
            _sync(x)
            acc.append(time.perf_counter() - start)
    return ta, tb


def row(label: str, ta, tb, target: str, digits: int = 0) -> str:
    """Table row: medians, ratio of medians, ratio of minima (robust to other jobs on a shared machine)."""
    ma, mb = statistics.median(ta), statistics.median(tb)
    return (f"| {label} | {ma * 1e3:.{digits}f} | {mb * 1e3:.{digits}f} | **{ma / mb:.2f}** | "
            f"{min(ta) / min(tb):.2f} | {target} |")


def tower_rows(args):
    rows = []
    for px, batch in ((224, args.batch224), (84, args.batch84)):
        torch.manual_seed(0)
        crate = timm.create_model("crate_alpha_base_patch16_224", img_size=px).train().to(args.device)
        vit = timm.create_model("vit_base_patch16_224", img_size=px).train().to(args.device)
        x = torch.randn(batch, 3, px, px, device=args.device)
        tc, tv = time_pair(crate, vit, x, args.repeats)
        rows.append(row(f"CRATE-α-B/16 vs ViT-B/16 fwd+bwd, {px} px, batch {batch}", tc, tv, "≤ 1.5"))
        print(rows[-1], flush=True)
        del crate, vit
    return rows


class _MSSAOnly(torch.nn.Module):
    def __init__(self, impl: str):
        super().__init__()
        torch.manual_seed(0)
        self.attn = MSSA(768, 12, attn_impl=impl)

    def forward(self, y):
        return self.attn(y)[0]


def attention_rows(args):
    rows = []
    for tokens, batch in ((197, args.batch224), (26, args.batch84)):
        y = torch.randn(batch, tokens, 768, device=args.device)
        ts, tm = time_pair(_MSSAOnly("sdpa").to(args.device), _MSSAOnly("math").to(args.device), y, args.repeats * 2)
        rows.append(row(f"MSSA (B/16 width) SDPA vs matmul-softmax fwd+bwd, {tokens} tokens, batch {batch}",
                        ts, tm, "≤ 1.0", digits=1))
        print(rows[-1], flush=True)
    return rows


INTRO = ("## Models: CRATE-α tower cost (`bench/bench_models.py`)\n"
         "Baselines: timm `vit_base_patch16_224` at the same input size and batch; a plain "
         "`softmax(q k^T / sqrt(hd)) v` MSSA (`attn_impl='math'`) for the SDPA rows. One table per device/precision.")


def read_section(name: str) -> str:
    """Current text of a BENCHMARKS.md section ('' when absent)."""
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else ""
    m = re.search(f"<!-- BEGIN {name} -->\n(.*?)<!-- END {name} -->", text, re.S)
    return m.group(1) if m else ""


def merge_block(section: str, block: str) -> str:
    """The section with this run's `#### device precision` table replaced (or added); other tables kept."""
    blocks = [b.strip() for b in re.split(r"(?m)^(?=#### )", section) if b.strip().startswith("#### ")]
    heading = block.splitlines()[0]
    kept = [b for b in blocks if b.splitlines()[0] != heading]
    return "\n\n".join([INTRO, *sorted(kept + [block])])


def main(argv=None) -> int:
    """Run both comparisons, print them and write the `models` section of BENCHMARKS.md."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch224", type=int, default=2)
    p.add_argument("--batch84", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", choices=sorted(AMP), default="fp32", help="autocast dtype for the forward")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    p.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    _SETTINGS["amp"] = AMP[args.amp]
    if args.threads:
        torch.set_num_threads(args.threads)
    header = ["| comparison | ours (ms, median) | baseline (ms, median) | ratio (medians) | ratio (minima) | target |",
              "| --- | ---: | ---: | ---: | ---: | --- |"]
    rows = tower_rows(args) + attention_rows(args)
    block = "\n".join([
        f"#### {args.device} {args.amp}" + (f", {args.threads} thread(s)" if args.threads else ""),
        machine_line() + f", median of {args.repeats} interleaved runs (MSSA-only rows: {2 * args.repeats}). "
        f"Command: `bench/bench_models.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        "", *header, *rows])
    print(block)
    if not args.no_write:
        write_section("models", merge_block(read_section("models"), block))
    return 0


if __name__ == "__main__":
    sys.exit(main())
