"""Runs `python -m open_clip_train.main` (the open_clip_torch wheel's trainer) with crate-clip's model configs
registered, for bench/bench_open_clip_train.py. torchrun starts it like the trainer itself:

    torchrun --nproc_per_node 2 bench/open_clip_train_entry.py --model CRATE-alpha-CLIPA-tiny ...

Two things differ from a bare `python -m open_clip_train.main`, neither of them in the timed loop:
- `import crate_clip` first, so `--model CRATE-alpha-CLIPA-tiny` names the demo's model (open_clip reads the
  registered JSON; the model is built by open_clip's own factory).
- open_clip_train wraps the model in DistributedDataParallel with `device_ids=[device]` even on the CPU, which
  torch's DDP refuses for CPU modules ("device_ids ... only work with ... GPU modules"); the wrapper below drops
  `device_ids` for CPU devices only, which is what DDP expects there (the same module, buckets and all-reduce).
"""
import runpy

import torch

import crate_clip  # noqa: F401  registers the CRATE-alpha configs with open_clip once open_clip is imported


class _CpuDistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """DDP that accepts open_clip_train's `device_ids=[cpu]` (DDP wants None for a CPU module)."""

    def __init__(self, module, device_ids=None, **kwargs):
        if device_ids and all(torch.device(d).type == "cpu" for d in device_ids):
            device_ids = None
        super().__init__(module, device_ids=device_ids, **kwargs)


if __name__ == "__main__":
    torch.nn.parallel.DistributedDataParallel = _CpuDistributedDataParallel
    runpy.run_module("open_clip_train.main", run_name="__main__", alter_sys=True)
