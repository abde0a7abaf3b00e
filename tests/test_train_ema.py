"""train.ema in one process: the part's arithmetic (a copy at start_step, then decay x ema + (1 - decay) x weights
every every_steps steps), its state_dict round trip (a resume goes on to the same average, also from a checkpoint
saved before the part saw its step), the checkpoint reader and the merge into consolidated weights, the config's
checks and what `crate-clip plan` counts. The SIGKILL resume of a two-rank run and `crate-clip export --weights ema`
are in test_train_resume.py."""
from __future__ import annotations

import pytest
import torch

from crate_clip.checkpoint_io.ema_state import (NoEmaError, ema_state_of_checkpoint, ema_weights_of_checkpoint,
                                                with_ema)
from crate_clip.checkpoint_io.run_layout import rank_state_file
from crate_clip.core.errors import ConfigError
from crate_clip.checkpoint_io.checkpoint_record import Progress
from crate_clip.train.loop.parts.ema_weights import EmaWeights
from crate_clip.train.loop.parts.stage_part import LoopState
from crate_clip.train.run.run_config import EmaSection, config_from_dict
from crate_clip.train.stage_setup.engine import DistInfo

DIST = DistInfo(rank=0, world_size=1, local_rank=0, device="cpu")


class _Run:
    """What a part reads of the run: the job's place and the log (a resume without a saved average prints)."""

    def __init__(self):
        self.dist, self.lines = DIST, []
        self.log = self

    def print(self, line: str) -> None:
        self.lines.append(line)


class _Engine:
    """The one thing the part reads of DeepSpeed's engine: the model it trains (`engine.module`)."""

    def __init__(self):
        torch.manual_seed(0)
        self.module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
        self.module[1].bias.requires_grad_(False)   # a parameter that is not trained: not averaged

    def train_step(self, step: int) -> None:
        """A deterministic change of every weight, as an optimizer step would make."""
        with torch.no_grad():
            for i, p in enumerate(self.module.parameters()):
                p.add_(0.1 * (step + i) * torch.ones_like(p))


def _loop(engine, step: int = 0) -> LoopState:
    return LoopState(run=_Run(), stage=None, engine=engine, stream=None, progress=Progress(step=step))


def _train(part: EmaWeights, engine: _Engine, loop: LoopState, until: int) -> None:
    while loop.progress.step < until:
        engine.train_step(loop.progress.step)
        loop.progress.step += 1
        part.on_step_end(loop)


SETTINGS = EmaSection(decay=0.75, every_steps=2, start_step=1)


def test_the_average_starts_at_start_step_then_takes_in_every_every_steps():
    engine, part = _Engine(), EmaWeights(SETTINGS, is_main=True)
    loop = _loop(engine)
    part.on_stage_start(loop)
    assert part.weights() is None   # step 0 < start_step 1
    live = {}
    for step in range(1, 6):
        engine.train_step(step - 1)
        loop.progress.step = step
        part.on_step_end(loop)
        live[step] = {k: v.detach().clone() for k, v in engine.module.named_parameters()}
    ema = part.weights()
    assert set(ema) == {"0.weight", "0.bias", "1.weight"}   # the trained parameters, the module's names
    for name, value in ema.items():   # copied at step 1, taken in at steps 3 and 5 (not at 2 and 4)
        expected = live[1][name]
        for step in (3, 5):
            expected = 0.75 * expected + 0.25 * live[step][name]
        assert value.dtype == torch.float32 and torch.equal(value, expected), name


@pytest.mark.parametrize("saved_before_the_part", [False, True])
def test_a_resume_from_the_state_dict_ends_with_the_same_average(saved_before_the_part):
    """Saved after the part saw the step, or before (a checkpoint cadence ahead of it in the loop's parts): the
    resumed part, handed the checkpoint's weights of that step, ends with the same average tensor for tensor."""
    reference, part = _Engine(), EmaWeights(SETTINGS, is_main=True)
    loop = _loop(reference)
    part.on_stage_start(loop)
    _train(part, reference, loop, 9)

    engine, first = _Engine(), EmaWeights(SETTINGS, is_main=True)
    loop = _loop(engine)
    first.on_stage_start(loop)
    _train(first, engine, loop, 4 if saved_before_the_part else 5)
    if saved_before_the_part:   # step 5 trained, the checkpoint saved before the part's on_step_end
        engine.train_step(4)
        loop.progress.step = 5
    saved_state = first.state_dict()
    saved_weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    first.on_step_end(loop)   # the killed run goes on a little: none of it may leak into the saved state
    _train(first, engine, loop, 7)

    resumed_engine, resumed = _Engine(), EmaWeights(SETTINGS, is_main=True)
    resumed_engine.module.load_state_dict(saved_weights)
    resumed.load_state_dict(saved_state)
    loop = _loop(resumed_engine, step=5)
    resumed.on_stage_start(loop)
    _train(resumed, resumed_engine, loop, 9)
    want, got = part.weights(), resumed.weights()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_turned_on_at_a_resume_past_start_step_it_starts_there_and_says_so():
    engine, part = _Engine(), EmaWeights(SETTINGS, is_main=True)
    part.load_state_dict(None)   # the checkpoint holds no average
    loop = _loop(engine, step=6)
    part.on_stage_start(loop)
    assert all(torch.equal(part.weights()[k], p) for k, p in engine.module.named_parameters() if p.requires_grad)
    assert part.state_dict()["seen"] == 6 and "train.ema starts at stage step 6" in loop.run.lines[0]
    assert EmaWeights(SETTINGS, is_main=False).state_dict() is None   # job-wide: rank 0's alone


def test_the_checkpoint_reader_and_the_merge_into_the_consolidated_weights(tmp_path):
    from crate_clip.checkpoint_io.atomic_files import atomic_torch_save

    engine, part = _Engine(), EmaWeights(SETTINGS, is_main=True)
    loop = _loop(engine)
    part.on_stage_start(loop)
    _train(part, engine, loop, 3)
    atomic_torch_save({"stream": None, "ema": part.state_dict()}, rank_state_file(tmp_path, 0))
    ema = ema_state_of_checkpoint(tmp_path)
    assert all(torch.equal(ema[k], v) for k, v in part.weights().items()) and set(ema) == set(part.weights())
    live = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    merged = ema_weights_of_checkpoint(tmp_path, live)
    assert torch.equal(merged["1.bias"], live["1.bias"]) and torch.equal(merged["0.weight"], ema["0.weight"])
    with pytest.raises(ValueError, match=r"0.weight \(2, 3\) \(no such key\)"):
        with_ema({"1.bias": live["1.bias"]}, ema)

    atomic_torch_save({"stream": None, "ema": {"seen": 0, "weights": None}}, rank_state_file(tmp_path, 0))
    with pytest.raises(NoEmaError, match="holds no EMA weights .* fix: export its weights without --weights ema"):
        ema_weights_of_checkpoint(tmp_path, live)


def _raw(**ema) -> dict:
    stages = [{"name": "a", "image_size": 16, "samples": 64, "global_batch": 16},
              {"name": "b", "image_size": 16, "samples": 160, "global_batch": 16}]
    return {"data": {"sources": ["unused"]}, "stages": stages, **({"train": {"ema": ema}} if ema else {})}


def test_the_config_keeps_it_off_by_default_and_names_the_key_of_a_bad_value():
    assert not config_from_dict(_raw(), check_paths=False).train.ema.on
    assert config_from_dict(_raw(decay=0.99, start_step=3), check_paths=False).train.ema.on
    with pytest.raises(ConfigError, match=r"train.ema.decay"):
        config_from_dict(_raw(decay=1.0), check_paths=False)
    with pytest.raises(ConfigError, match=r"train.ema.start_step: 4, but stages.0 has 4 steps .*fix: a start_step "
                                          r"below 4"):
        config_from_dict(_raw(decay=0.99, start_step=4), check_paths=False)


def test_the_plan_counts_an_fp32_copy_of_the_trained_parameters_on_rank_0():
    from crate_clip.train.planning.planner import format_plan, measure_stage, plan_stage, state_bytes_per_rank
    from crate_clip.train.stage_setup.stage_model import resolve_stage

    assert state_bytes_per_rank(100, 20, "bf16", 3, 4, ema=True) == {"weights": 60, "grads": 50, "optimizer": 300,
                                                                     "ema": 400}
    assert "ema" not in state_bytes_per_rank(100, 20, "bf16", 3, 4)
    raw = _raw(decay=0.99)
    raw["deepspeed"] = {"zero_stage": 3}
    on = resolve_stage(config_from_dict(raw, check_paths=False), 0, world_size=4)
    off = resolve_stage(config_from_dict(_raw(), check_paths=False), 0, world_size=4)
    measure = measure_stage(off, memory=False)
    with_ema, without = (plan_stage(s, measure, 80 << 30, None, 0.4) for s in (on, off))
    assert with_ema.state_bytes["ema"] == 4 * measure.trainable_params
    assert with_ema.state_by_zero[3] - without.state_by_zero[3] == 4 * measure.trainable_params
    assert "EMA " in format_plan([with_ema], 4, 80 << 30, None, 0.4, 3, "bf16") and "(rank 0, train.ema)" in \
        format_plan([with_ema], 4, 80 << 30, None, 0.4, 3, "bf16")


def test_each_kind_of_weights_has_its_own_record_of_the_stage_end_evaluations(tmp_path):
    """A run killed between a stage's live and EMA evaluations: the resume finds the EMA ones missing (and only
    those), and a finished earlier stage counts as missing evaluations until both kinds are in results.jsonl."""
    import json

    from crate_clip.train.loop.stage_evals import EMA, LIVE, missing_evals, stage_end_missing

    raw = _raw(decay=0.99)
    raw.update(run={"output_dir": str(tmp_path)}, eval={"evals": [{"name": "fm", "type": "zeroshot",
                                                                   "dataset": "fashion_mnist", "data": "unused"}]})
    cfg = config_from_dict(raw, check_paths=False)
    row = {"stage_index": 0, "eval": "fm", "image_size": 16, "resize": "grid", "global_step": 4}
    (tmp_path / "results.jsonl").write_text(json.dumps(row) + "\n")
    assert missing_evals(cfg, 0, LIVE) == {} and [e.name for e in missing_evals(cfg, 0, EMA)[(16, "grid")]] == ["fm"]
    assert stage_end_missing(cfg, 0, DIST)
    with (tmp_path / "results.jsonl").open("a") as f:
        f.write(json.dumps({**row, "weights": "ema"}) + "\n")
    assert not stage_end_missing(cfg, 0, DIST)
    del raw["train"]   # off: no EMA evaluation is ever missing
    assert missing_evals(config_from_dict(raw, check_paths=False), 0, EMA) == {}
