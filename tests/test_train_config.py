"""Run configs: shipped ones validate; bad ones fail before any work with the key named and a fix;
`--set` overrides; parameter groups and the warm-up + cosine schedule."""
import json
import math
from pathlib import Path

import pytest
import yaml

from crate_clip.train.run.run_config import (ConfigError, apply_override, check_runtime, config_from_dict,
                                             load_run_config)
from crate_clip.train.stage_setup.stage_model import resolve_stage

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))


def _good() -> dict:
    return {"data": {"sources": ["/data/{00000000..00000009}.tar"]},
            "stages": [{"name": "pre", "image_size": 84, "context_length": 8, "samples": 1024, "global_batch": 64,
                        "lr": 1e-3, "warmup_steps": 2, "text_mask": "syntax"},
                       {"name": "ft", "image_size": 224, "context_length": 32, "samples": 256, "global_batch": 64,
                        "lr": 5e-5}]}


def _error(raw: dict, **kw) -> str:
    with pytest.raises(ConfigError) as exc:
        config_from_dict(raw, check_paths=kw.pop("check_paths", False), **kw)
    return str(exc.value)


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(REPO)) for p in CONFIGS])
def test_shipped_configs_validate(path):
    cfg = load_run_config(path, check_paths=False)
    assert cfg.stages and all(s.steps >= 1 for s in cfg.stages)
    assert cfg.stages[-1].image_size >= cfg.stages[0].image_size


def test_datacomp_recipes_match_the_paper():
    for size in ("B-16", "L-14", "H-14"):
        cfg = load_run_config(REPO / f"configs/datacomp/crate_alpha_clipa_{size.lower()}.yaml", check_paths=False)
        pre, ft = cfg.stages
        low = 80 if size == "B-16" else 84   # the paper's 84 px at B/16's 16 px patches drops pixels (issue 39)
        assert (pre.image_size, pre.samples, pre.global_batch, pre.lr, pre.warmup_steps) == \
            (low, 2_560_000_000, 32_768, 1.024e-3, 1600)
        assert (ft.image_size, ft.samples, ft.lr, ft.warmup_steps) == (224, 512_500_000, 5.12e-5, 800)
        assert cfg.optimizer.betas == [0.9, 0.95] and cfg.optimizer.grad_clip == 1.0
        assert pre.weight_decay == ft.weight_decay == 0.2 and cfg.model.name == f"CRATE-alpha-CLIPA-{size}"
        assert cfg.model.pos_embed_resize == "official_1d"   # the official 84 -> 224 px stage change


def test_unknown_key_is_named_with_a_suggestion():
    raw = _good()
    raw["stages"][1]["warmup_step"] = 5
    raw["optimiser"] = {}
    msg = _error(raw)
    assert "stages.1.warmup_step: unknown key" in msg and "did you mean 'warmup_steps'" in msg
    assert "optimiser: unknown key" in msg and "'optimizer'" in msg


@pytest.mark.parametrize("path, value, expected", [
    ("stages.0.lr", "fast", "stages.0.lr: expected a number"),
    ("stages.0.lr", -1.0, "stages.0.lr: -1.0; fix: a positive peak learning rate"),
    ("stages.1.text_mask", "nouns", "stages.1.text_mask: 'nouns' is not one of"),
    ("stages.0.image_mask", "random", "stages.0.image_mask_ratio: 0 with image_mask 'random'"),
    ("stages.0.samples", 10, "stages.0.samples: 10 is less than one global batch"),
    ("stages.0.warmup_steps", 99, "stages.0.warmup_steps: 99 but the stage has 16 steps"),
    ("precision", "fp8", "precision: 'fp8' is not one of"),
    ("deepspeed.zero_stage", 4, "deepspeed.zero_stage: 4; fix: use 0, 1, 2 or 3"),
    ("data.weights", [1.0, 2.0], "data.weights: 2 weights for 1 sources"),
    ("checkpoint.keep_last", 0, "checkpoint.keep_last: must be >= 1"),
    ("stages.1.crop_scale", [0.9, 0.5], "stages.1.crop_scale: [0.9, 0.5]; fix: [min, max]"),
    ("eval.evals", [{"name": "in1k", "type": "linear", "data": "x"}], "eval.evals.0.type: 'linear'"),
    ("data.std", [0.2, 0.0, 0.2], "data.std: [0.2, 0.0, 0.2]; fix: three positive values"),
    ("data.num_workers", 100000, "data.num_workers: must be <= 256"),
])
def test_bad_values_name_the_key(path, value, expected):
    raw = _good()
    apply_override(raw, f"{path}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}")
    assert expected in _error(raw)


def test_missing_paths_are_named(tmp_path):
    raw = _good()
    raw["data"]["sources"] = [str(tmp_path / "nowhere")]
    raw["eval"] = {"evals": [{"name": "in1k", "data": str(tmp_path / "val")}]}
    msg = _error(raw, check_paths=True)
    assert "data.sources.0:" in msg and "does not exist" in msg and "eval.evals.0.data:" in msg


def test_runtime_checks_name_the_key():
    cfg = config_from_dict(_good(), check_paths=False)
    with pytest.raises(ConfigError, match=r"stages.0.global_batch: 64 is not divisible by the 3 processes"):
        check_runtime(cfg, world_size=3)
    cfg.precision = "fp16"
    with pytest.raises(ConfigError, match="precision: fp16 is not supported by DeepSpeed on CPU"):
        check_runtime(cfg, world_size=2)


def test_overrides():
    raw = _good()
    apply_override(raw, "stages.0.lr=1e-3")
    apply_override(raw, "deepspeed.overrides.zero_optimization.overlap_comm=true")
    apply_override(raw, "data.sources=[/a, /b]")
    cfg = config_from_dict(raw, check_paths=False)
    assert cfg.stages[0].lr == 1e-3 and isinstance(cfg.stages[0].lr, float)  # YAML 1.1 reads 1e-3 as text
    assert cfg.deepspeed.overrides == {"zero_optimization": {"overlap_comm": True}}
    assert cfg.data.sources == ["/a", "/b"]
    with pytest.raises(ConfigError, match=r"--set stages.5.lr: 'stages.5' is not an index of a list of 2"):
        apply_override(raw, "stages.5.lr=1")
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        apply_override(raw, "stages.0.lr")
    deep = "deepspeed.overrides." + ".".join(["a"] * 50_000)   # a free-form section: once it passed --validate
    with pytest.raises(ConfigError, match=r"a key of 50,002 parts, more than the 16 any run-config key has") as err:
        apply_override(raw, f"{deep}=1")
    assert len(str(err.value)) < 300 and raw["deepspeed"]["overrides"] == {"zero_optimization": {"overlap_comm": True}}


def test_cli_rejects_a_bad_config_before_training(tmp_path, capsys):
    from crate_clip.core.errors import EXIT_CONFIG
    from crate_clip.train.cli import main

    path = tmp_path / "bad.yaml"
    raw = _good()
    raw["stages"][0]["global_batch"] = "big"
    path.write_text(yaml.safe_dump(raw))
    assert main(["--config", str(path)]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "stages.0.global_batch: expected an integer, got 'big'" in err
    assert main(["--config", str(tmp_path / "none.yaml")]) == EXIT_CONFIG
    assert "--config: file" in capsys.readouterr().err


def test_deepspeed_json_is_derived_from_the_run_config():
    from crate_clip.train.stage_setup.engine import deepspeed_config

    raw = _good()
    raw["deepspeed"] = {"config": str(REPO / "configs/deepspeed/zero3.json"), "overrides": {"zero_optimization": {
        "stage3_param_persistence_threshold": 0}}}
    raw["precision"] = "bf16"
    cfg = config_from_dict(raw, check_paths=False)
    ds = deepspeed_config(cfg, resolve_stage(cfg, 1, world_size=4))
    assert ds["train_batch_size"] == 64 and ds["train_micro_batch_size_per_gpu"] == 16
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"] and ds["gradient_clipping"] == 1.0


def test_param_groups_and_schedule():
    import crate_clip  # noqa: F401
    from crate_clip.models import create_clip
    from crate_clip.train.stage_setup.engine import prepare_model_for_deepspeed
    from crate_clip.train.stage_setup.optim import param_groups, warmup_cosine

    model = prepare_model_for_deepspeed(create_clip("CRATE-alpha-CLIPA-tiny", image_size=16, context_length=16))
    assert model.logit_scale.shape == (1,)
    groups = {g["weight_decay"]: set(g["names"]) for g in param_groups(model, 0.2)}
    decay, no_decay = groups[0.2], groups[0.0]
    assert not decay & no_decay and len(decay | no_decay) == len(list(model.parameters()))
    for name in ("logit_scale", "token_embedding.weight", "positional_embedding", "visual.trunk.pos_embed",
                 "visual.trunk.cls_token", "visual.trunk.blocks.0.ista.D", "visual.trunk.blocks.0.ista.D1",
                 "visual.trunk.blocks.0.norm1.weight", "ln_final.bias"):
        assert name in no_decay, name
    for name in ("visual.trunk.patch_embed.proj.weight", "text_projection", "visual.head.proj.weight",
                 "transformer.resblocks.0.mlp.c_fc.weight"):
        assert name in decay, name
    assert all(model.get_parameter(n).ndim >= 2 for n in decay)
    lrs = [warmup_cosine(s, total_steps=10, warmup_steps=4) for s in range(10)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0] and lrs[4] == 1.0
    assert lrs[7] == pytest.approx(0.5 * (1 + math.cos(math.pi * 3 / 6)))
    assert all(a > b for a, b in zip(lrs[4:], lrs[5:]))


def test_stage_model_carries_weights_resizes_and_sets_the_token_mask():
    import torch

    raw = _good()
    raw["model"] = {"name": "CRATE-alpha-CLIPA-tiny"}
    raw["stages"][0].update(image_size=16, context_length=8, image_mask="block", image_mask_ratio=0.5)
    raw["stages"][1].update(image_size=28, context_length=16, image_mask="random", image_mask_ratio=0.3)
    cfg = config_from_dict(raw, check_paths=False)
    low = resolve_stage(cfg, 0).build_model()
    assert (low.visual.trunk.token_mask, low.visual.trunk.token_drop_ratio) == ("block", 0.5)
    weights = {k: v.clone() for k, v in low.state_dict().items()}
    full = resolve_stage(cfg, 1).build_model(weights)
    assert (full.visual.trunk.token_mask, full.visual.trunk.token_drop_ratio) == ("random", 0.3)
    got = full.state_dict()
    assert weights["visual.trunk.pos_embed"].shape[1] == 17 and got["visual.trunk.pos_embed"].shape[1] == 50
    assert weights["positional_embedding"].shape[0] == 8 and got["positional_embedding"].shape[0] == 16
    torch.testing.assert_close(got["visual.trunk.pos_embed"][:, 0], weights["visual.trunk.pos_embed"][:, 0])
    same = [k for k in weights if k not in ("visual.trunk.pos_embed", "positional_embedding")]
    assert all(torch.equal(got[k], weights[k]) for k in same)


def test_schema_reports_every_error_at_once_with_the_key_and_the_fix():
    raw = _good()
    raw["data"].update(drop_last="yes", pos_source="spacy", shufle_buffer=3)
    raw["stages"][0]["global_batch"] = True          # a boolean is not a number
    raw["logging"] = {"plot": 1}                     # nor is a number a boolean
    raw["eval"] = {"evals": [{"name": "in1k", "data": "x", "templats": "openai"}]}
    lines = _error(raw).splitlines()[1:]
    assert [line.split(":")[0].strip() for line in lines] == [
        "data.drop_last", "data.pos_source", "data.shufle_buffer", "stages.0.global_batch", "eval.evals.0.templats",
        "logging.plot"]
    assert all("fix:" in line for line in lines), lines
    assert "data.pos_source: 'spacy' is not one of ('auto', 'nltk', 'wordnet', 'builtin')" in lines[1]
    assert "did you mean 'shuffle_buffer'" in lines[2] and "did you mean 'templates'" in lines[4]


def test_every_stream_option_is_settable_and_reaches_the_stream():
    from crate_clip.data.train_stream import StreamConfig

    raw = _good()
    for assignment in ("data.pos_source=builtin", "data.shards_per_group=4", "data.max_image_pixels=1e6",
                       "data.drop_last=false", "data.prefetch_factor=3", "stages.1.crop_scale=[0.9, 1.0]"):
        apply_override(raw, assignment)
    cfg = config_from_dict(raw, check_paths=False)
    stream = cfg.stream_config(1)
    assert isinstance(stream, StreamConfig) and set(StreamConfig.model_fields) - {"seed"} == set(cfg.to_dict()["data"])
    assert (stream.pos_source, stream.shards_per_group, stream.max_image_pixels, stream.drop_last) == \
        ("builtin", 4, 1_000_000, False)
    assert (stream.seed, stream.crop_scale, cfg.stream_config(0).seed) == (1009, (0.9, 1.0), 0)
    assert "data.seed: set per stage from run.seed" in _error({**raw, "data": {**raw["data"], "seed": 3}})


def test_run_config_round_trips_through_its_saved_yaml():
    raw = _good()
    raw["eval"] = {"evals": [{"name": "captions", "type": "retrieval", "data": "/val", "num_workers": 2}]}
    cfg = config_from_dict(raw, check_paths=False)
    again = config_from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict())), check_paths=False)
    assert again.to_dict() == cfg.to_dict() and again.eval.evals[0].num_workers == 2


def test_validate_flag_checks_and_exits(tmp_path, capsys):
    from crate_clip.core.errors import EXIT_CONFIG
    from crate_clip.train.cli import main

    import tarfile

    (tmp_path / "shards").mkdir()
    with tarfile.open(tmp_path / "shards" / "00000000.tar", "w") as tar:
        tar.add(__file__, arcname="0000.txt")
    raw = _good()
    raw["data"]["sources"] = [str(tmp_path / "shards")]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["--config", str(path), "--validate"]) == 0
    out = capsys.readouterr().out
    assert "valid (2 stages, 20 steps, 1,280 samples)" in out
    assert "stage 0 (pre): 84 px, 8 tokens, 16 steps x 64 = 1,024 samples" in out
    assert main(["--config", str(path), "--validate", "--json"]) == 0   # the same check as one JSON object
    checked = json.loads(capsys.readouterr().out)
    assert (checked["valid"], checked["stages"], checked["steps"], checked["samples"]) == (True, 2, 20, 1280)
    assert "stage 0 (pre): 84 px, 8 tokens, 16 steps x 64 = 1,024 samples" in checked["plan"][0]
    assert main(["--config", str(path), "--validate", "--set", "stages.0.text_mask=nouns"]) == EXIT_CONFIG
    assert "stages.0.text_mask: 'nouns' is not one of" in capsys.readouterr().err


def _validate(tmp_path, raw) -> tuple[int, str]:
    from crate_clip.train.cli import main

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    code = main(["--config", str(path), "--validate"])
    return code, path


@pytest.mark.parametrize("fault", ["folder without tar", "not a tar", "image smaller than a patch"])
def test_validate_rejects_what_training_would_crash_on(tmp_path, capsys, monkeypatch, fault):
    from crate_clip.core.errors import EXIT_CONFIG

    shards = tmp_path / "shards"
    shards.mkdir()
    raw = _good()
    raw["data"]["sources"] = [str(shards)]
    raw["model"] = {"name": "CRATE-alpha-CLIPA-tiny"}          # 4 px patches
    if fault != "folder without tar":
        (shards / "00000000.tar").write_bytes(b"not a tar " * 100 if fault == "not a tar" else b"")
    if fault == "image smaller than a patch":
        import tarfile
        with tarfile.open(shards / "00000000.tar", "w") as tar:
            tar.add(__file__, arcname="0000.txt")
        raw["stages"][0]["image_size"] = 3
    expected = {"folder without tar": f"data.sources.0: {str(shards)!r} names no .tar shard",
                "not a tar": f"data.sources.0: {str(shards / '00000000.tar')!r} is not a tar file; fix:",
                "image smaller than a patch": "stages.0.image_size: 3 px is smaller than one 4 px patch of "
                                              "CRATE-alpha-CLIPA-tiny; fix: at least 4"}[fault]
    code, path = _validate(tmp_path, raw)
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG and err.splitlines() == [f"crate-clip train: invalid run config ({path}):",
                                                        "  " + err.splitlines()[1].strip()]
    assert expected in err and "Traceback" not in err
    monkeypatch.setenv("RANK", "1")   # under torchrun only rank 0 prints it; every rank exits with 2
    assert _validate(tmp_path, raw)[0] == EXIT_CONFIG and capsys.readouterr().err == ""


def _shards(tmp_path) -> str:
    import tarfile

    (tmp_path / "shards").mkdir()
    with tarfile.open(tmp_path / "shards" / "00000000.tar", "w") as tar:
        tar.add(__file__, arcname="0000.txt")
    return str(tmp_path / "shards")


def test_samples_that_are_not_whole_batches_are_rounded_as_validate_says(tmp_path, capsys):
    """2,500 samples in batches of 64: --validate says the stage trains 39 steps = 2,496 samples, the numbers the
    trainer's resolved stage has, and says that they were rounded down."""
    raw = _good()
    raw["data"]["sources"] = [_shards(tmp_path)]
    raw["stages"][0].update(samples=2500, global_batch=64)
    code, path = _validate(tmp_path, raw)
    out = capsys.readouterr().out
    assert code == 0 and "valid (2 stages, 43 steps, 2,752 samples)" in out
    assert "stage 0 (pre): 84 px, 8 tokens, 39 steps x 64 = 2,496 samples" in out
    assert ("stages.0.samples: 2,500 is not a multiple of global_batch 64: the stage trains 39 steps = 2,496 "
            "samples (rounded down); set samples to 2,496 or 2,560") in out
    stage = resolve_stage(load_run_config(path), 0)
    assert (stage.steps, stage.steps * stage.global_batch) == (39, 2496)   # what training runs and counts
    assert "rounded down" not in "\n".join(load_run_config(path, ["stages.0.samples=2496"]).training_plan())


def test_validate_catches_an_eval_without_class_names(tmp_path, capsys):
    """An eval entry of a dataset without built-in class names needs classnames.txt beside its data (or a
    classnames file): found by --validate (and at config load), one line naming the key."""
    from crate_clip.core.errors import EXIT_CONFIG

    raw = _good()
    raw["data"]["sources"] = [_shards(tmp_path)]
    (tmp_path / "val" / "a").mkdir(parents=True)
    raw["eval"] = {"evals": [{"name": "mine", "dataset": "mystery", "data": str(tmp_path / "val")}]}
    code, _ = _validate(tmp_path, raw)
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG and "Traceback" not in err
    problem = [line.strip() for line in err.splitlines()[1:]]
    assert len(problem) == 1 and problem[0].startswith("eval.evals.0.dataset: 'mystery' has no built-in class "
                                                       "names") and "fix: set classnames: FILE" in problem[0]
    raw["eval"]["evals"][0]["classnames"] = str(tmp_path / "names.txt")
    assert _validate(tmp_path, raw)[0] == EXIT_CONFIG
    assert "eval.evals.0.classnames: " in capsys.readouterr().err
    (tmp_path / "val" / "classnames.txt").write_text("a\n")
    del raw["eval"]["evals"][0]["classnames"]
    assert _validate(tmp_path, raw)[0] == 0
