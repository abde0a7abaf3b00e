"""Cost of the checkpoint checksums: the sha256 of one rank's share of a B/16-sized checkpoint, against writing it.

Every save records the size and sha256 of its files (crate_clip/checkpoint_io/checkpoint_manifest.py), each rank
hashing about 1/world of the bytes right after writing them. Baseline: writing those bytes the way a save does
(torch.save through a Python file object, then fsync). Also compared: torch.save given a path, DeepSpeed's own way,
against the Python file object a save uses (where a full disk is an OSError with its errno).

    python bench/bench_checkpoint_checksums.py [--ranks 8] [--dir /tmp]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import crate_clip  # noqa: E402,F401
from bench.report import machine_line, markdown_table, write_section  # noqa: E402
from crate_clip.checkpoint_io.atomic_files import fsync_file, torch_save_to_file  # noqa: E402
from crate_clip.checkpoint_io.checkpoint_manifest import checksum_share  # noqa: E402

# bf16 module weights (2 bytes) + ZeRO's fp32 master copy and AdamW's two moments (12 bytes) per parameter
BYTES_PER_PARAM = 14
CHUNK = 16 * 2 ** 20   # floats per tensor: 64 MiB tensors, like a model's largest


def b16_params() -> int:
    """Parameters of CRATE-alpha-CLIPA-B-16 (counted on the meta device)."""
    from crate_clip.models import create_clip
    model = create_clip("CRATE-alpha-CLIPA-B-16", device="meta")
    return sum(p.numel() for p in model.parameters())


def best_of(n: int, run) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=8, help="ranks sharing the checkpoint (ZeRO-1 on one 8-GPU node)")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where to write (the file system measured)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    params = b16_params()
    total = params * BYTES_PER_PARAM
    share = total // args.ranks
    floats = share // 4
    state = {f"t{i}": torch.randn(min(CHUNK, floats - i * CHUNK)) for i in range((floats + CHUNK - 1) // CHUNK)}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        path = folder / "share.pt"

        def write_path():
            torch.save(state, path)
            fsync_file(path)

        def write_file_object():
            torch_save_to_file(state, path)
            fsync_file(path)

        t_path = best_of(args.repeats, write_path)
        t_file = best_of(args.repeats, write_file_object)
        t_hash = best_of(args.repeats, lambda: checksum_share(folder, 0, 1))
        written = os.path.getsize(path)
    gb = written / 1e9
    rows = [["write, torch.save(path) + fsync (DeepSpeed's way)", f"{t_path:.2f}", f"{gb / t_path:.2f}", "-"],
            ["write, torch.save(file object) + fsync (a save's way)", f"{t_file:.2f}", f"{gb / t_file:.2f}",
             f"{t_file / t_path:.2f}x the path write"],
            ["sha256 of the written file (checksum_share)", f"{t_hash:.2f}", f"{gb / t_hash:.2f}",
             f"{t_hash / t_file:.2f}x the write"]]
    table = markdown_table(["step (one rank's share)", "seconds (best of %d)" % args.repeats, "GB/s", "ratio"], rows)
    text = (f"CRATE-alpha-CLIPA-B-16: {params / 1e6:.1f} M parameters, {total / 1e9:.2f} GB of checkpoint at "
            f"{BYTES_PER_PARAM} bytes per parameter (bf16 weights, fp32 master copy and AdamW moments); one rank's "
            f"share at {args.ranks} ranks: {gb:.2f} GB, written to {args.dir}.\n\n{table}\n\n{machine_line()}")
    print(text)
    write_section("checkpoint_checksums", "## Checkpoint checksums (`bench/bench_checkpoint_checksums.py`)\n\n" + text)


if __name__ == "__main__":
    main()
