"""Nothing the project loads runs code. Checkpoint folders of ZeRO-0, -2 and -3 layout written by the trainer,
with one file replaced by a pickle whose `__reduce__` payload would create a marker file, are refused in one
line by eval, the export reader, resume and model.pretrained; the marker never appears. `--trust-checkpoint`
is the opt-in (it does run the payload), rank states need no allow-list, and `--validate` lists the shell
commands of `pipe:` sources."""
from __future__ import annotations

import os
import random
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from crate_clip.checkpoint_io.deepspeed_checkpoints import consolidate_deepspeed_checkpoint, consolidated_state_dict
from crate_clip.checkpoint_io.safe_unpickling import (DEEPSPEED_CLASSES, UntrustedCheckpointError, deepspeed_reads,
                                                      load_torch_file, trusted_checkpoints, unsafe_classes)
from train_fixtures import run_jobs, tiny_config, write_config

MID_TAG, LAST_TAG = "stage0-step00000001", "stage0-step00000002"
# layout -> the file given the payload (the examples: ZeRO-0 model states, ZeRO-2 optimizer states)
POISONED_FILE = {0: "mp_rank_00_model_states.pt", 2: "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                 3: "zero_pp_rank_0_mp_rank_00_model_states.pt"}
LAYOUTS = sorted(POISONED_FILE)
TRAINED = (0, 1, 2, 3)


class Payload:
    """Unpickled without restriction, runs a shell command that creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


def poison(path: Path, marker: Path) -> None:
    """Add the payload to a trainer-written torch file, keeping all it held (an unsafe reader would go on)."""
    state = torch.load(path, map_location="cpu", weights_only=False)   # the test's own file
    state["extra"] = Payload(marker)
    torch.save(state, path)


def _stage(**extra) -> list[dict]:
    return [{"name": "s", "image_size": 16, "context_length": 16, "samples": 32, "global_batch": 16, "lr": 1e-3,
             "warmup_steps": 1, **extra}]


def _config(run_dir: Path, data: Path, zero_stage: int, text_file: Path, path: Path) -> Path:
    """2 steps checkpointed after each, with what a checkpoint can hold beyond a plain model: a locked
    pretrained text tower (buffers), a patch-size change (4 -> 8 px), 2 accumulated micro-batches, and
    random image-token masks (drawn from the RNG states a resume restores)."""
    stages = _stage(patch_size=8, micro_batch=8, image_mask="random", image_mask_ratio=0.5)
    cfg = tiny_config(run_dir, data, zero_stage=zero_stage, precision="bf16", stages=stages, every_steps=1,
                      evals=False, logging={"tensorboard": False, "plot": False},
                      model={"text_pretrained": str(text_file), "lock_text": True, "lock_logit_scale": True})
    return write_config(cfg, path)


def _train_all(*commands: list[str]) -> list[subprocess.CompletedProcess]:
    """`crate-clip train` of each argument list, each in a process of its own, two side by side."""
    return run_jobs([[sys.executable, "-m", "crate_clip.train.cli", *args] for args in commands])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_fmnist):
    """ZeRO stage -> (config, run folder) of a real 2-step, 1-process run (bf16)."""
    from crate_clip.models import create_clip

    root = tmp_path_factory.mktemp("trained")
    torch.manual_seed(0)
    torch.save(create_clip("CRATE-alpha-CLIPA-tiny", context_length=16).state_dict(), root / "text.pt")
    runs = {zs: (_config(root / f"z{zs}", tiny_fmnist, zs, root / "text.pt", root / f"z{zs}.yaml"), root / f"z{zs}")
            for zs in TRAINED}
    for proc in _train_all(*(["--config", str(cfg)] for cfg, _ in runs.values())):
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return runs


def _copy_mid_stage(source: Path, run: Path) -> Path:
    """A run folder holding only the step-1 checkpoint of `source` (named by `latest`) and the run's records a resume
    checks its config against (run_config.yaml, run_reads.json); returns its tag folder."""
    tag = run / "checkpoints" / MID_TAG
    shutil.copytree(source / "checkpoints" / MID_TAG, tag)
    (run / "checkpoints" / "latest").write_text(MID_TAG)
    for record in ("run_config.yaml", "run_reads.json"):
        if (source / record).is_file():
            shutil.copy2(source / record, run / record)
    return tag


def _poisoned_run(trained, zs: int, root: Path, name: str = POISONED_FILE[0]) -> tuple[Path, Path, Path]:
    """(run folder, tag folder, marker) of a copy of the ZeRO-`zs` run's mid-stage checkpoint with `name` poisoned."""
    run = root / f"poisoned{zs}-{name.split('_')[0]}"
    tag = _copy_mid_stage(trained[zs][1], run)
    marker = root / f"marker-{run.name}"
    poison(tag / name, marker)
    _record_checksum(tag, name)
    return run, tag, marker


def _record_checksum(tag: Path, name: str) -> None:
    """Record the poisoned file's size and sha256 in crate_clip.json as its writer would have: the checksums catch
    damage, not a file from elsewhere whose record was rewritten too (the allow-list refuses that one)."""
    import json

    from crate_clip.checkpoint_io.file_checksums import CHECKSUMS_KEY, file_checksum

    info_path = tag / "crate_clip.json"
    info = json.loads(info_path.read_text())
    info[CHECKSUMS_KEY][name] = file_checksum(tag / name)
    info_path.write_text(json.dumps(info))


@pytest.fixture(scope="module")
def poisoned(trained, tmp_path_factory):
    """ZeRO stage -> (run folder, tag folder, marker) with POISONED_FILE[stage] carrying the payload."""
    root = tmp_path_factory.mktemp("poisoned")
    return {zs: _poisoned_run(trained, zs, root, POISONED_FILE[zs]) for zs in LAYOUTS}


def _one_line_refusal(message: str, path_part: str) -> None:
    assert len(message.strip().splitlines()) == 1, message
    assert path_part in message and "posix.system" in message and "--trust-checkpoint" in message, message


def _refused(read, path_part: str) -> None:
    """`read()` raises the one-line refusal naming `path_part` and the payload's function."""
    with pytest.raises(UntrustedCheckpointError) as exc:
        read()
    _one_line_refusal(str(exc.value), path_part)


# ---------------------------------------------------------------- refused everywhere, in one line
@pytest.mark.slow
@pytest.mark.parametrize("zs", LAYOUTS)
def test_eval_refuses_a_checkpoint_that_pickles_code(poisoned, zs, capsys):
    from crate_clip.cli import main

    run, _, marker = poisoned[zs]
    code = main(["eval", "zeroshot", "--model", str(run / "checkpoints"), "--data", "unused", "--dataset",
                 "fashion_mnist", "--device", "cpu", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and not marker.exists()
    _one_line_refusal(err, POISONED_FILE[zs])


@pytest.mark.slow
@pytest.mark.parametrize("zs", LAYOUTS)
def test_export_reader_refuses_a_checkpoint_that_pickles_code(poisoned, zs, tmp_path, capsys):
    from crate_clip.cli import main

    run, tag, marker = poisoned[zs]
    _refused(lambda: consolidate_deepspeed_checkpoint(run / "checkpoints"), POISONED_FILE[zs])
    _refused(lambda: consolidated_state_dict(tag), POISONED_FILE[zs])
    code = main(["export", str(tag), "--out", str(tmp_path / "export"), "--no-verify"])   # the command itself
    assert code == 2 and not (tmp_path / "export").exists()
    _one_line_refusal(capsys.readouterr().err, POISONED_FILE[zs])
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("zs", LAYOUTS)
def test_model_pretrained_and_text_pretrained_refuse_a_checkpoint_that_pickles_code(poisoned, zs):
    from crate_clip.models.text_sources import TextTowerError
    from crate_clip.train.run.run_config import config_from_dict
    from crate_clip.train.stage_setup.stage_model import resolve_stage

    run, tag, marker = poisoned[zs]
    sources = [run / "checkpoints", tag] + ([tag / POISONED_FILE[zs]] if "model_states" in POISONED_FILE[zs] else [])
    for source in sources:   # a run's checkpoints, one tag folder, a model-states file itself
        cfg = config_from_dict({"data": {"sources": ["unused"]}, "model": {"pretrained": str(source)},
                                "stages": _stage()}, check_paths=False)
        _refused(lambda: resolve_stage(cfg, 0).build_model(), POISONED_FILE[zs])
    text = {"text_pretrained": str(run / "checkpoints"), "lock_text": True}
    cfg = config_from_dict({"data": {"sources": ["unused"]}, "stages": _stage(), "model": text}, check_paths=False)
    with pytest.raises(TextTowerError) as exc:   # a config error naming the key, then the refusal
        resolve_stage(cfg, 0).build_model()
    assert str(exc.value).startswith("model.text_pretrained: ")
    _one_line_refusal(str(exc.value), POISONED_FILE[zs])
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("zs", LAYOUTS)
def test_resume_refuses_a_checkpoint_that_pickles_code(poisoned, zs):
    from crate_clip.train.checkpointing.checkpoints import CheckpointManager

    _, tag, marker = poisoned[zs]
    ckpts = CheckpointManager(tag.parent, 3, rank=0, world_size=1)
    _refused(lambda: ckpts.check_compatible(tag), POISONED_FILE[zs])   # what --resume checks on every rank first
    assert not marker.exists()


def _resume_config(trained, zs: int, run: Path, path: Path) -> Path:
    """The ZeRO-`zs` run's config, writing into `run`."""
    cfg = yaml.safe_load(trained[zs][0].read_text())
    cfg["run"]["output_dir"] = str(run)
    return write_config(cfg, path)


@pytest.fixture(scope="module")
def resumed(trained, tmp_path_factory):
    """The `--resume latest` commands of test_every_trainer_checkpoint_resumes_bit_exact (per ZeRO stage: a copy of
    the step-1 checkpoint resumed) and of test_resume_command_refuses_a_poisoned_rank_state_in_one_line (the ZeRO-2
    copy with a poisoned rank state), each in a process of its own, two side by side (the same commands the tests
    ran one by one): {"runs": zs -> (run folder, process), "poisoned": (run, tag, marker, process)}."""
    root = tmp_path_factory.mktemp("resumed")
    runs = {zs: root / f"z{zs}" / "run" for zs in TRAINED}
    for zs, run in runs.items():
        _copy_mid_stage(trained[zs][1], run)
    poisoned = _poisoned_run(trained, 2, root / "poisoned", "train_state_rank00000.pt")
    configs = [_resume_config(trained, zs, run, root / f"z{zs}.yaml") for zs, run in runs.items()]
    configs.append(_resume_config(trained, 2, poisoned[0], root / "poisoned.yaml"))
    procs = _train_all(*(["--config", str(cfg), "--resume", "latest"] for cfg in configs))
    return {"runs": {zs: (run, proc) for (zs, run), proc in zip(runs.items(), procs)},
            "poisoned": (*poisoned, procs[-1])}


@pytest.mark.slow
def test_resume_command_refuses_a_poisoned_rank_state_in_one_line(resumed):
    from crate_clip.train.checkpointing.checkpoints import CheckpointManager

    _, tag, marker, proc = resumed["poisoned"]
    _refused(lambda: CheckpointManager(tag.parent, 3, rank=0, world_size=1).load_rank_state(tag),
             "train_state_rank00000.pt")
    ours = [line for line in proc.stderr.splitlines() if line.startswith("crate-clip train:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(ours) == 1, proc.stderr[-3000:]
    _one_line_refusal(ours[0], "train_state_rank00000.pt")
    assert "earlier crate-clip version" not in ours[0]   # os.system is no numpy RNG state
    assert not marker.exists()


# ---------------------------------------------------------------- the opt-in, and earlier versions
@pytest.mark.slow
@pytest.mark.parametrize("zs", [0, 2])
def test_trust_checkpoint_is_an_explicit_opt_in_that_unpickles(trained, tmp_path, zs):
    _, tag, marker = _poisoned_run(trained, zs, tmp_path, POISONED_FILE[zs])
    with trusted_checkpoints():
        state, _ = consolidate_deepspeed_checkpoint(tag.parent, tag=tag.name)
    assert marker.exists()   # the payload is live: only the allow-listed reader kept it from running
    assert set(state) == set(consolidated_state_dict(trained[zs][1] / "checkpoints" / MID_TAG))


@pytest.mark.slow
def test_rank_state_of_an_earlier_version_loads_with_the_opt_in(trained, tmp_path):
    from crate_clip.train.checkpointing.checkpoints import CheckpointManager, set_rng_state

    tag = tmp_path / "checkpoints" / MID_TAG
    shutil.copytree(trained[2][1] / "checkpoints" / MID_TAG, tag)
    path = tag / "train_state_rank00000.pt"
    state = load_torch_file(path, allow=())
    state["rng"]["numpy"] = np.random.get_state()   # as the earlier version saved it: numpy's tuple with an array
    torch.save(state, path)
    ckpts = CheckpointManager(tag.parent, 3, rank=0, world_size=1)
    with pytest.raises(UntrustedCheckpointError, match="earlier crate-clip version.*--trust-checkpoint") as exc:
        ckpts.check_compatible(tag)
    assert len(str(exc.value).splitlines()) == 1 and "numpy.ndarray" in str(exc.value)
    with trusted_checkpoints():
        ckpts.check_compatible(tag)
        old = ckpts.load_rank_state(tag)
    set_rng_state(old["rng"])
    assert np.array_equal(np.random.get_state()[1], state["rng"]["numpy"][1])


# ---------------------------------------------------------------- what the trainer writes still resumes
@pytest.mark.slow
@pytest.mark.parametrize("zs", TRAINED)
def test_every_trainer_checkpoint_resumes_bit_exact(trained, resumed, zs):
    """Resumed from the step-1 checkpoint through the allow-listed readers (the `resumed` fixture's process), step 2
    ends where the uninterrupted run's did: weights, optimizer states and rank states equal to the bit."""
    source = trained[zs][1]
    run, proc = resumed["runs"][zs]
    assert proc.returncode == 0 and "--trust-checkpoint" not in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
    ours, theirs = run / "checkpoints" / LAST_TAG, source / "checkpoints" / LAST_TAG
    assert sorted(p.name for p in ours.glob("*.pt")) == sorted(p.name for p in theirs.glob("*.pt"))
    for path in ours.glob("*.pt"):
        mine, reference = load_torch_file(path), load_torch_file(theirs / path.name)
        for state in (mine, reference):
            state.pop("crate_clip", None)   # the run info: it names the run's folder
        _assert_equal(mine, reference, path.name)
    resumed, uninterrupted = consolidated_state_dict(ours), consolidated_state_dict(theirs)
    assert set(resumed) == set(uninterrupted)
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)


def _assert_equal(a, b, where: str) -> None:
    """Nested containers of tensors and plain values, equal to the bit."""
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for key in a:
            _assert_equal(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b or type(a).__module__.startswith("deepspeed"), where


# ---------------------------------------------------------------- what the reader allows
@pytest.mark.slow
@pytest.mark.parametrize("zs", TRAINED)
def test_trainer_checkpoints_need_nothing_beyond_the_allow_list(trained, zs):
    tag = trained[zs][1] / "checkpoints" / LAST_TAG
    files = sorted(tag.glob("*.pt"))
    assert len(files) >= 2 + (zs > 0)   # DeepSpeed's model (ZeRO 1-3: and optimizer) states, our rank state
    for path in files:
        assert unsafe_classes(path) == [], path
    assert unsafe_classes(tag / "train_state_rank00000.pt", allow=()) == []   # rank states: no allow-list at all
    state = consolidated_state_dict(tag)
    assert state["visual.trunk.pos_embed"].dtype == torch.float32


def test_rank_state_round_trips_exactly_without_an_allow_list(tmp_path):
    from crate_clip.train.checkpointing.checkpoints import rng_state, set_rng_state

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()   # leaves a cached gaussian in numpy's state
    torch.save({"rng": rng_state()}, tmp_path / "rank.pt")
    expected = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    assert unsafe_classes(tmp_path / "rank.pt", allow=()) == []
    set_rng_state(load_torch_file(tmp_path / "rank.pt", allow=())["rng"])
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == expected


def test_allow_list_reads_every_class_deepspeed_writes(tmp_path):
    """Each allow-listed class as DeepSpeed builds it (fp16's dynamic loss scaler needs a GPU to be written by a
    run), read back with weights_only=True."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    objects = {"static": LossScaler(scale=1), "zero": ZeroStageEnum.gradients,
               "dynamic": DynamicLossScaler(init_scale=2 ** 16, scale_window=1000, min_scale=1, delayed_shift=2,
                                            consecutive_hysteresis=False, raise_error_at_min_scale=True,
                                            dtype=torch.float16),
               "mappings": {"visual.proj": fragment_address(numel=12, start=4)}}
    assert {f"{type(o).__module__}.{type(o).__qualname__}" for o in
            (objects["static"], objects["zero"], objects["dynamic"], objects["mappings"]["visual.proj"])} == \
        set(DEEPSPEED_CLASSES)
    torch.save(objects, tmp_path / "ds.pt")
    back = load_torch_file(tmp_path / "ds.pt")
    assert back["zero"] is ZeroStageEnum.gradients and back["mappings"] == objects["mappings"]
    assert vars(back["dynamic"]) == vars(objects["dynamic"]) and vars(back["static"]) == vars(objects["static"])
    with pytest.raises(UntrustedCheckpointError, match="ds.pt: refused: it pickles deepspeed"):
        load_torch_file(tmp_path / "ds.pt", allow=())


def test_deepspeed_reads_force_weights_only_and_restore_after(tmp_path, monkeypatch):
    """DeepSpeed's own torch.load(weights_only=False) calls are held to weights_only inside the block."""
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", raising=False)
    marker = tmp_path / "marker"
    torch.save({"w": torch.ones(2), "extra": Payload(marker)}, tmp_path / "payload.pt")
    (tmp_path / "folder").mkdir()   # nothing to scan: the forcing alone must stop the payload
    with pytest.raises(UntrustedCheckpointError, match="posix.system"):
        with deepspeed_reads(tmp_path / "folder"):
            torch.load(tmp_path / "payload.pt", weights_only=False)
    assert not marker.exists() and "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ
    torch.load(tmp_path / "payload.pt", weights_only=False)   # outside the block torch is as it was
    assert marker.exists()


def test_convert_official_refuses_a_file_that_pickles_code(tmp_path, capsys):
    from crate_clip.cli import main

    marker = tmp_path / "marker"
    torch.save({"w": torch.ones(2), "extra": Payload(marker)}, tmp_path / "released.pth")
    code = main(["convert", "official", str(tmp_path / "released.pth"), "--model", "CRATE-alpha-CLIPA-tiny",
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and not marker.exists()
    _one_line_refusal(err, "released.pth")


# ---------------------------------------------------------------- pipe: sources run commands by design
def test_validate_prints_the_shell_commands_of_pipe_sources(tmp_path, capsys, monkeypatch):
    from crate_clip.train.cli import main

    monkeypatch.setenv("BUCKET", "s3://lab-bucket")
    raw = {"data": {"sources": ["pipe:aws s3 cp $BUCKET/{00000000..00000099}.tar -", "pipe:cat /d/one.tar"]},
           "stages": _stage()}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["--config", str(path), "--validate"]) == 0
    out = capsys.readouterr().out
    assert "a run config is as trusted as a script" in out
    assert "data.sources.0: aws s3 cp s3://lab-bucket/{00000000..00000099}.tar -   (100 commands, one per shard)" in out
    assert "data.sources.0: aws s3 cp s3://lab-bucket/{00000000..00000099}_stats.json -   (up to 8 of these" in out
    assert "data.sources.1: cat /d/one.tar   (1 command, one per shard)" in out
