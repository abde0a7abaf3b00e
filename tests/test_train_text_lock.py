"""A pretrained text tower locked for training (the paper's CRATE-alpha-CLIPA setup): loading it from a
file / local-dir export / open_clip tag, the config keys and their errors, and 2-process ZeRO-2/3 runs where
only the image tower trains, the frozen tower is replicated (not partitioned) and comes back bit-identical."""
import json

import pytest
import torch

from train_fixtures import ranks_cmd, run_job, tiny_config, write_config

MODEL = "CRATE-alpha-CLIPA-tiny"
CRATE_TEXT = "CRATE-alpha-CLIPA-tiny-crate-text"


def _text_source(path, seed=123):
    """A tiny CLIP checkpoint whose text tower and logit scale differ from a seed-0 model's."""
    from crate_clip.models import create_clip
    torch.manual_seed(seed)
    model = create_clip(MODEL, image_size=16, context_length=16)
    with torch.no_grad():
        model.logit_scale.fill_(2.5)
    torch.save(model.state_dict(), path)
    return model.state_dict()


# ---------------------------------------------------------------- multi-process runs
@pytest.fixture(scope="module")
def lock_probe(tmp_path_factory):
    out = tmp_path_factory.mktemp("lock")
    _text_source(out / "text.pt")
    proc = run_job(ranks_cmd(2, "lock", str(out)), timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out / "lock.json").read_text())


def _rows(records, zs, precision, lock):
    rows = [r for r in records if (r["zero_stage"], r["precision"], r["lock"]) == (zs, precision, lock)]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    return rows


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("zs, precision", [(2, "bf16"), (3, "bf16")])
def test_locked_text_tower_trains_only_the_image_tower(lock_probe, zs, precision):
    for r in _rows(lock_probe, zs, precision, True):
        assert r["losses"][-1] < r["losses"][0] - 0.1, r["losses"]  # the image tower learns the batch
        assert r["frozen_live_equal"]  # text tower and logit scale untouched by 6 steps
        assert r["text_requires_grad"] == []
        assert r["trained_names"] and all(n.startswith("visual.") for n in r["trained_names"])
    saved = _rows(lock_probe, zs, precision, True)[0]
    assert saved["saved_text_equal"]  # checkpoint -> zero_to_fp32: the fp32 source values, bit for bit
    assert "token_embedding.weight" in saved["saved_keys"] and "logit_scale" in saved["saved_keys"]


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("zs", [2, 3])
def test_lock_keeps_text_out_of_optimizer_and_partitions(lock_probe, zs):
    locked, free = _rows(lock_probe, zs, "bf16", True), _rows(lock_probe, zs, "bf16", False)
    total, image = free[0]["param_numel_total"], locked[0]["param_numel_total"]
    assert image < total * 0.6  # the tiny model's text tower is about half of it
    for r in locked:
        # Adam moments and fp32 masters cover only this rank's half of the image tower
        assert r["master_numel"] == pytest.approx(image / 2, rel=0.02)
        assert r["optimizer_state_numel"] == pytest.approx(image, rel=0.02)
        # the frozen tower is replicated in full on every rank, in fp32, as buffers
        assert r["buffer_bytes"] >= (total - image) * 4
    for r in free:
        assert r["master_numel"] == pytest.approx(total / 2, rel=0.02)
    if zs == 3:  # ZeRO-3 partitions parameters: the locked run's are the image tower's only
        assert locked[0]["param_numel_local"] == pytest.approx(image / 2, rel=0.02)
    assert free[0]["saved_text_equal"] is False  # control: a trainable tower does move


# ---------------------------------------------------------------- loading and locking (one process)
def _model(seed=0, **kw):
    from crate_clip.models import create_clip
    torch.manual_seed(seed)
    return create_clip(MODEL, image_size=16, context_length=16, **kw)


def _text_equal(model, source) -> bool:
    from crate_clip.models import text_tower_keys
    own = model.state_dict()
    return all(torch.equal(own[k].reshape(-1), source[k].reshape(-1))
               for k in text_tower_keys(model, include_logit_scale=False))


def test_load_from_file_and_lock(tmp_path):
    from crate_clip.train.stage_setup.optim import param_groups
    from crate_clip.train.stage_setup.text_lock import apply_text_config, frozen_names

    source = _text_source(tmp_path / "text.pt")
    model = _model()
    visual_before = model.visual.trunk.patch_embed.proj.weight.detach().clone()
    names = apply_text_config(model, text_pretrained=str(tmp_path / "text.pt"), lock_text=True,
                              lock_logit_scale=True, compute_dtype=torch.bfloat16)
    assert _text_equal(model, source) and float(model.logit_scale) == 2.5
    assert torch.equal(model.visual.trunk.patch_embed.proj.weight, visual_before)  # image tower untouched
    assert set(names) == set(frozen_names(model)) and "token_embedding.weight" in names and "logit_scale" in names
    assert all(n.startswith("visual.") for n, _ in model.named_parameters())
    assert all(n.startswith("visual.") for g in param_groups(model, 0.2) for n in g["names"])
    image_f, text_f, scale = model(image=torch.randn(2, 3, 16, 16), text=torch.randint(1, 500, (2, 16)))
    assert image_f.requires_grad and not text_f.requires_grad and not scale.requires_grad
    # the state dict keeps every key under its name: checkpoints and exports load in a plain model
    fresh = _model(seed=5)
    fresh.load_state_dict({k: v.reshape(fresh.state_dict()[k].shape) for k, v in model.state_dict().items()})
    assert _text_equal(fresh, source)


def test_locked_text_forward_matches_the_plain_model_in_fp32(tmp_path):
    from crate_clip.train.stage_setup.text_lock import lock_text_tower

    plain, locked = _model(), _model()
    lock_text_tower(locked, lock_text=True)
    tokens = torch.randint(1, 500, (3, 16))
    # the locked tower runs under no_grad with its weights as buffers: the same maths, but other kernels may
    # run than in the grad-enabled forward (last digits apart on a CPU with AVX512-BF16: 0.77103 vs 0.77104)
    torch.testing.assert_close(locked.encode_text(tokens), plain.encode_text(tokens), rtol=1e-4, atol=1e-4)


def test_custom_text_layout_and_shape_errors(tmp_path):
    from crate_clip.models.text_sources import TextTowerError, load_pretrained_text_tower

    source = _text_source(tmp_path / "text.pt")
    moved = {("text." + k if not k.startswith(("visual.", "logit_")) else k): v for k, v in source.items()}
    model = _model()
    load_pretrained_text_tower(model, moved)  # CustomTextCLIP's `text.*` keys map onto CLIP's flat ones
    assert _text_equal(model, source)
    # the released CRATE-alpha-CLIPA layout (x @ text_projection.T): detected and transposed back
    official = {k: v for k, v in source.items() if not k.startswith("visual.")}
    official["text_projection"] = source["text_projection"].t().contiguous()
    official["visual.transformer.resblocks.0.mlp.c_fc"] = torch.zeros(8, 32)
    other = _model(seed=9)
    load_pretrained_text_tower(other, official)
    assert _text_equal(other, source)
    wrong = dict(source, positional_embedding=torch.zeros(32, 64))
    with pytest.raises(TextTowerError, match=r"positional_embedding \(32, 64\) vs \(16, 64\).*context_length"):
        load_pretrained_text_tower(model, wrong, where="x.pt")
    with pytest.raises(TextTowerError, match=r"model.text_pretrained: x.pt lacks the text-tower keys \[ln_final"):
        load_pretrained_text_tower(model, {k: v for k, v in source.items() if not k.startswith("ln_final")},
                                   where="x.pt")


def test_a_crate_alpha_text_tower_loads_from_its_own_kind_and_locks(tmp_path):
    """A CRATE-alpha text tower takes model.text_pretrained from a *-crate-text checkpoint (exactly) and locks like
    the transformer; a checkpoint with the other kind of text tower is refused naming both kinds, either way."""
    from crate_clip.models import create_clip
    from crate_clip.models.text_sources import TextTowerError, load_pretrained_text_tower
    from crate_clip.train.stage_setup.text_lock import apply_text_config, frozen_names

    torch.manual_seed(123)
    crate = create_clip(CRATE_TEXT, image_size=16, context_length=16)
    torch.save(crate.state_dict(), tmp_path / "crate_text.pt")
    torch.manual_seed(0)
    model = create_clip(CRATE_TEXT, image_size=16, context_length=16)
    names = apply_text_config(model, text_pretrained=str(tmp_path / "crate_text.pt"), lock_text=True,
                              lock_logit_scale=True, compute_dtype=None)
    assert _text_equal(model, crate.state_dict()) and set(names) == set(frozen_names(model))
    assert "text.transformer.resblocks.1.ista.D1" in names and "logit_scale" in names
    assert all(n.startswith("visual.") for n, _ in model.named_parameters())
    image_f, text_f, _ = model(image=torch.randn(2, 3, 16, 16), text=torch.randint(1, 500, (2, 16)))
    assert image_f.requires_grad and not text_f.requires_grad
    with pytest.raises(TextTowerError, match="CRATE-alpha text tower and the checkpoint a transformer one"):
        load_pretrained_text_tower(model, _text_source(tmp_path / "text.pt"))
    with pytest.raises(TextTowerError, match="transformer text tower and the checkpoint a CRATE-alpha one"):
        load_pretrained_text_tower(_model(), crate.state_dict())


def test_sources_local_dir_and_open_clip_tag(tmp_path):
    from crate_clip.export.writer import export_open_clip
    from crate_clip.models.text_sources import TextTowerError, read_text_source, resolve_text_source

    source = _text_source(tmp_path / "text.pt")
    export_open_clip(source, MODEL, tmp_path / "export", image_size=16, context_length=16)
    state, where = read_text_source(f"local-dir:{tmp_path / 'export'}")
    assert where.endswith("open_clip_model.safetensors")
    assert torch.equal(state["ln_final.weight"], source["ln_final.weight"])
    # an open_clip tag goes through open_clip's registry and the Hugging Face cache (offline here): a cached
    # copy of the file is found, a missing one is an error naming the key and the fix
    snapshot = tmp_path / "hf" / "models--UCSC-VLAA--ViT-H-14-CLIPA-datacomp1B" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    (snapshot / "open_clip_pytorch_model.bin").write_bytes((tmp_path / "text.pt").read_bytes())
    found = resolve_text_source("ViT-H-14-CLIPA:datacomp1b", cache_dir=str(tmp_path / "hf"))
    assert found.resolve() == (snapshot / "open_clip_pytorch_model.bin").resolve()
    with pytest.raises(TextTowerError, match="model.text_pretrained: 'ViT-L-14-CLIPA:datacomp1b' could not be fetched"):
        resolve_text_source("ViT-L-14-CLIPA:datacomp1b", cache_dir=str(tmp_path / "hf"))
    with pytest.raises(TextTowerError, match=r"no pretrained tag 'laion9b'.*ViT-H-14-CLIPA:datacomp1b"):
        resolve_text_source("ViT-H-14-CLIPA:laion9b")
    with pytest.raises(TextTowerError, match="is not a file, local-dir:DIR"):
        resolve_text_source(str(tmp_path / "missing.pt"))


def _raw(**model) -> dict:
    return {"model": model, "data": {"sources": ["/data/{00000000..00000009}.tar"]},
            "stages": [{"name": "pre", "image_size": 84, "context_length": 32, "samples": 1024, "global_batch": 64,
                        "lr": 1e-3},
                       {"name": "ft", "image_size": 224, "context_length": 16, "samples": 256, "global_batch": 64,
                        "lr": 5e-5}]}


def test_config_keys_and_errors():
    from crate_clip.train.run.run_config import ConfigError, config_from_dict

    with pytest.raises(ConfigError) as exc:
        config_from_dict(_raw(lock_text=True), check_paths=False)
    assert "model.lock_text: true would freeze a randomly initialised text tower" in str(exc.value)
    with pytest.raises(ConfigError, match="stages.1.context_length: 16, but stages.0 has 32"):
        config_from_dict(_raw(lock_text=True, text_pretrained="x.pt"), check_paths=False)
    with pytest.raises(ConfigError, match="model.text_pretrained: 'ViT-H-14-CLIPA:nope'"):
        config_from_dict(_raw(text_pretrained="ViT-H-14-CLIPA:nope"), check_paths=False)
    cfg = config_from_dict(_raw(text_pretrained="ViT-H-14-CLIPA:datacomp1b"), check_paths=False)
    assert not cfg.model.lock_text  # loading without locking: the text tower fine-tunes


# ---------------------------------------------------------------- a whole run: stages, checkpoints, resume, export
@pytest.mark.multiproc
@pytest.mark.slow
def test_run_with_locked_text_resumes_without_the_text_file_and_exports(tiny_fmnist, tmp_path):
    from safetensors.torch import load_file

    from crate_clip.export.writer import load_export
    from crate_clip.train.stage_setup.text_lock import is_text_key

    source = _text_source(tmp_path / "text.pt")
    text_keys = [k for k in source if is_text_key(k)] + ["logit_scale"]
    model = {"name": MODEL, "text_pretrained": str(tmp_path / "text.pt"), "lock_text": True, "lock_logit_scale": True}

    stages = [{"name": "low", "image_size": 16, "context_length": 16, "samples": 96, "global_batch": 16,
               "lr": 2e-3, "warmup_steps": 1},
              {"name": "full", "image_size": 28, "context_length": 16, "samples": 32, "global_batch": 16,
               "lr": 2e-4, "warmup_steps": 1}]

    def config(name):
        cfg = tiny_config(tmp_path / name, tiny_fmnist, stages=stages, evals=False, model=model,
                          checkpoint={"every_steps": 3, "keep_last": 10},
                          logging={"every_steps": 1, "progress": False, "tensorboard": False})
        cfg["data"]["num_workers"] = 0
        return write_config(cfg, tmp_path / f"{name}.yaml")

    def train(cfg, *extra):
        proc = run_job(ranks_cmd(2, "--config", str(cfg), *extra, module="crate_clip.train.cli"), timeout=400)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        return load_file(str(cfg.parent / cfg.stem / "export" / "open_clip_model.safetensors"))

    full = train(config("full"))
    (tmp_path / "text.pt").unlink()  # resuming must not need it: the checkpoint holds the frozen tower
    resumed = train(config("resumed"), "--resume", str(tmp_path / "full" / "checkpoints" / "stage0-step00000003"))
    for key in text_keys:  # through 2 stages, checkpoints, a resume and the export: the source, bit for bit
        assert torch.equal(full[key].reshape(-1), source[key].reshape(-1)), key
        assert torch.equal(resumed[key].reshape(-1), source[key].reshape(-1)), key
    assert set(full) == set(resumed)
    for key in full:
        torch.testing.assert_close(resumed[key], full[key], rtol=1e-5, atol=1e-6, msg=key)
    first = torch.load(tmp_path / "full" / "checkpoints" / "stage0-step00000003" / "mp_rank_00_model_states.pt",
                       map_location="cpu", weights_only=False)["module"]
    key = "visual.trunk.patch_embed.proj.weight"
    assert not torch.equal(first[key].float(), full[key])  # while the image tower trained
    opened, _, _ = load_export(tmp_path / "full" / "export")  # plain open_clip, trainable again
    own = opened.state_dict()
    assert all(torch.equal(own[k].reshape(-1), source[k].reshape(-1)) for k in text_keys)
    assert opened.token_embedding.weight.requires_grad


def test_datacomp_configs_lock_clipa_text_and_the_demo_trains_its_own():
    from pathlib import Path

    from crate_clip.train.run.run_config import load_run_config

    configs = Path(__file__).resolve().parents[1] / "configs"
    for size in ("b-16", "l-14", "h-14"):
        m = load_run_config(configs / f"datacomp/crate_alpha_clipa_{size}.yaml", check_paths=False).model
        assert (m.text_pretrained, m.lock_text, m.lock_logit_scale) == ("ViT-H-14-CLIPA:datacomp1b", True, True)
    for path in ("datacomp/crate_alpha_clipa_h-14_clipa_v2.yaml", "demo/fashion_mnist.yaml"):
        m = load_run_config(configs / path, check_paths=False).model
        assert not m.lock_text and not m.lock_logit_scale
