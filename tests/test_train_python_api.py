"""`crate_clip.train.run(config) -> RunResult` (crate_clip/train/python_api.py, docs/python_api.md): the trainer in
the calling process, as a notebook runs it. One real run of the tiny model (one stage of 2 steps, evaluated on the
50 test images, exported) stopped first by a save signal waiting in the process, then started again with
resume="auto"; the process is checked to be as it was after each call. The refusals need no training."""
import os
import signal
import threading

import pytest

from train_fixtures import read_jsonl, tiny_config

STAGE = {"name": "only", "image_size": 16, "context_length": 16, "samples": 32, "global_batch": 16, "lr": 2e-3,
         "warmup_steps": 0}
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def _config(run_dir, data) -> dict:
    """The tiny run in one stage at 16 px (evaluated at its own size only), fp32 under ZeRO 0, nothing optional."""
    cfg = tiny_config(run_dir, data, zero_stage=0, precision="fp32", stages=[STAGE])
    cfg["eval"]["full_image_size"] = None
    cfg["logging"].update(tensorboard=False, plot=False)
    return cfg


def _process_state() -> dict:
    """What a call must give back: signal handlers and mask, environment, process group, generators, warning filters,
    DeepSpeed's logger, threads and child processes."""
    import logging
    import random
    import warnings

    import torch
    import torch.distributed as tdist

    children = open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()
    return {"handlers": {s: signal.getsignal(s) for s in SIGNALS}, "mask": signal.pthread_sigmask(signal.SIG_BLOCK, []),
            "environ": dict(os.environ), "group": tdist.is_initialized(), "random": random.getstate(),
            "torch": torch.get_rng_state().tolist(), "warnings": list(warnings.filters),
            "deepspeed logger": list(logging.getLogger("DeepSpeed").filters), "children": children,
            "threads": {t for t in threading.enumerate() if t.name != "tqdm_monitor"}}   # tqdm's own, once per process


def test_a_run_in_process_stops_on_a_signal_resumes_and_returns_the_run(tiny_fmnist, tmp_path):
    import deepspeed  # noqa: F401  (imports set variables and warning filters of their own: before the snapshot)

    import crate_clip.train
    from crate_clip.train import python_api  # noqa: F401
    from crate_clip.core.errors import EXIT_PREEMPTED, ConfigError, UserError

    cfg = _config(tmp_path / "run", tiny_fmnist)
    before = _process_state()
    # Slurm's warning arrives while the process is busy: pending (blocked here, as a launcher holds it) when the run
    # starts, it is delivered once the run's handlers are in place and stops it at its first step. Sent to this
    # thread: the process has other threads, which do not block it (one of them would take its default action)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
    signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
    try:
        with pytest.raises(crate_clip.train.PreemptedStop) as stopped:
            crate_clip.train.run(cfg)
        assert signal.SIGUSR1 not in signal.sigpending()
    finally:
        if signal.SIGUSR1 in signal.sigpending():   # never delivered: not to this process's default action either
            previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGUSR1])
            signal.signal(signal.SIGUSR1, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, before["mask"])
    assert stopped.value.exit_code == EXIT_PREEMPTED and isinstance(stopped.value, UserError)
    assert "stopped by SIGUSR1" in str(stopped.value) and "--resume auto" in str(stopped.value)
    assert _process_state() == before   # the save signals' handlers back, not ignored as after the command's stop

    result = crate_clip.train.run(cfg, resume="auto")
    assert _process_state() == before
    rows = read_jsonl(tmp_path / "run" / "results.jsonl")
    assert [(r["stage_index"], r["eval"], r["image_size"]) for r in rows] == [(0, "fmnist", 16)]
    assert isinstance(result, crate_clip.train.RunResult) and result.run_dir == tmp_path / "run"
    assert result.export_dir == tmp_path / "run" / "export" and (result.export_dir / "open_clip_config.json").is_file()
    assert (result.samples_seen, result.global_step) == (32, 2)
    assert result.last_checkpoint == tmp_path / "run" / "checkpoints" / "stage0-step00000002"
    (record,) = result.stage_results
    assert (record.stage_name, record.eval, record.image_size, record.samples_seen) == ("only", "fmnist", 16, 32)
    assert record.results["top1"] == rows[0]["top1"] and record.results["n_images"] == 50
    assert result.results_of(-1) == result.results_of(0) == [record]

    with pytest.raises(ConfigError) as again:   # the same refusal as `crate-clip train`, with its exit code
        crate_clip.train.run(cfg)
    assert again.value.exit_code == 2 and "already holds a run" in str(again.value)
    assert read_jsonl(tmp_path / "run" / "results.jsonl") == rows


def test_each_form_of_config_is_checked_as_the_command_checks_it(tiny_fmnist, tmp_path):
    import yaml

    import crate_clip.train
    from crate_clip.core.errors import ConfigError, UserError
    from crate_clip.train.run.run_config import load_run_config

    cfg = _config(tmp_path / "run", tiny_fmnist)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=r"stages\.0\.global_batch: expected an integer, got 'big'") as bad:
        crate_clip.train.run(path, overrides=["stages.0.global_batch=big"])
    assert bad.value.exit_code == 2 and str(path) in str(bad.value)
    loaded = load_run_config(path)
    loaded.stages[0].lr = -1.0   # assigned after loading: validated again, as a loaded file would be
    with pytest.raises(ConfigError, match=r"stages\.0\.lr: -1\.0; fix: a positive peak learning rate"):
        crate_clip.train.run(loaded)
    with pytest.raises(ConfigError, match=r"run\.output_dir: .* is the data source"):   # the command's folder checks
        crate_clip.train.run(dict(cfg, run={**cfg["run"], "output_dir": str(tiny_fmnist / "train")}))
    with pytest.raises(crate_clip.train.InputError, match="save_on_signal 'KILL': SIGKILL cannot be caught") as sig:
        crate_clip.train.run(cfg, save_on_signal="KILL")
    assert sig.value.exit_code == 2 and isinstance(sig.value, UserError)
    assert not (tmp_path / "run").exists()
