"""Exports load wherever open_clip loads models: the exports are opened in a fresh interpreter that runs only
`import crate_clip, open_clip` (`local-dir:`, and `hf-hub:` from a Hugging Face cache laid out as a download
leaves it), at any patch and image size, with the BPE or the BERT tokenizer, with a trained or a locked text tower;
its features, tokens and preprocessing are the trained model's. Identical inputs, and two identical runs, give
byte-identical export files."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import crate_clip  # noqa: F401
from crate_clip.models import register_open_clip_configs
from train_fixtures import tiny_config, train_in_process

REPO_ROOT = Path(__file__).resolve().parents[1]
BERT_VOCAB = REPO_ROOT.parent / "shared" / "bert_base_uncased"
TINY = "CRATE-alpha-CLIPA-tiny"
TINY_BERT = "test-CRATE-alpha-CLIPA-tiny-bert"
TEXTS = ["a photo of a sneaker", "a photo of a bag", "trouser"]
HUB_ID = "crate-clip-tests/tiny-bert"
# (model, patch, px, lock the text tower, data.mean) for each export
CASES = {"p4_28_bpe": (TINY, 4, 28, False, None), "p7_21_bpe": (TINY, 7, 21, False, None),
         "p7_28_bert_locked": (TINY_BERT, 7, 28, True, [0.5, 0.5, 0.5]), "p4_20_bert": (TINY_BERT, 4, 20, False, None)}

# what the fresh interpreter runs: nothing but crate_clip and open_clip, then the loaders' own calls, for each
# (spec, image, output) in turn
LOADER = """
import json, sys
import torch
torch.set_num_threads(1)
import crate_clip, open_clip
from PIL import Image
texts = json.loads(sys.argv[1])
for spec, image, out in json.loads(sys.argv[2]):
    model, _, preprocess = open_clip.create_model_and_transforms(spec)
    tokenizer = open_clip.get_tokenizer(spec)
    model.eval()
    pixels = preprocess(Image.open(image)).unsqueeze(0)
    fixed = torch.load(out + ".in.pt")
    tokens = tokenizer(texts)
    with torch.no_grad():
        image_features = model.encode_image(fixed["pixels"])
        text_features = model.encode_text(tokens)
    torch.save({"pixels": pixels, "tokens": tokens, "image_features": image_features,
                "text_features": text_features, "tower": model.visual.trunk.default_cfg.get("architecture"),
                "patch": model.visual.trunk.patch_size, "preprocess_cfg": model.visual.preprocess_cfg}, out)
"""


@pytest.fixture(scope="module")
def bert_config(tmp_path_factory):
    """The tiny model with CLIPA's BERT text setup (30,522-row vocabulary), registered in this process only."""
    if not (BERT_VOCAB / "vocab.txt").is_file():
        pytest.skip(f"no BERT vocabulary at {BERT_VOCAB}")
    folder = tmp_path_factory.mktemp("configs")
    cfg = json.loads((REPO_ROOT / "crate_clip/models/model_configs/CRATE-alpha-CLIPA-tiny.json").read_text())
    cfg["text_cfg"].update(vocab_size=30522, hf_tokenizer_name="bert-base-uncased",
                           tokenizer_kwargs={"strip_sep_token": True}, pool_type="last", no_causal_mask=True)
    (folder / f"{TINY_BERT}.json").write_text(json.dumps(cfg))
    register_open_clip_configs(folder)
    return TINY_BERT


def _run_config(model: str, patch: int, px: int, lock: bool, mean, text_file: Path):
    from crate_clip.train.run.run_config import config_from_dict

    model_section = {"name": model, "bert_vocab": str(BERT_VOCAB) if model == TINY_BERT else None}
    if lock:
        model_section.update(text_pretrained=str(text_file), lock_text=True, lock_logit_scale=True)
    data = {"sources": ["unused"], **({"mean": mean} if mean else {})}
    return config_from_dict({"model": model_section, "data": data, "precision": "fp32", "stages": [
        {"name": "s", "image_size": px, "context_length": 16, "patch_size": patch, "samples": 16,
         "global_batch": 8, "lr": 1e-3}]}, check_paths=False)


def _trained(cfg, seed: int):
    """The trainer's stage model, with one optimizer step on a fixed batch (so no weight is its init)."""
    from crate_clip.train.stage_setup.stage_model import resolve_stage

    stage = resolve_stage(cfg, 0)
    model = stage.build_model()
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(4, 3, stage.image_size, stage.image_size, generator=g)
    tokens = torch.randint(1, 2000, (4, stage.context_length), generator=g)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    img, txt, scale = model(images, tokens)
    (img @ txt.T * scale).logsumexp(-1).mean().backward()
    opt.step()
    return model.eval()


def _fresh_loads(loads: list[tuple[str, Path, Path]], env: dict) -> subprocess.CompletedProcess:
    """One fresh interpreter that imports only crate_clip and open_clip, then loads each (spec, image, output)."""
    return subprocess.run([sys.executable, "-c", LOADER, json.dumps(TEXTS),
                           json.dumps([(spec, str(image), str(out)) for spec, image, out in loads])],
                          cwd=loads[0][2].parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)


def _hub_cache(export: Path, cache: Path, repo: str) -> None:
    """`export` as huggingface_hub leaves a download of repository `repo` in its cache: the files under
    snapshots/<commit>, refs/main naming the commit, and .no_exist/<commit>/config.json, the record of the
    hub's 404 when transformers' AutoTokenizer looked for a model config the repository does not have."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    folder = cache / f"models--{repo.replace('/', '--')}"
    for sub in ("refs", f"snapshots/{commit}", f".no_exist/{commit}"):
        (folder / sub).mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    (folder / ".no_exist" / commit / "config.json").touch()
    for f in export.iterdir():
        (folder / "snapshots" / commit / f.name).write_bytes(f.read_bytes())


@pytest.mark.slow
def test_exports_load_in_a_fresh_interpreter_with_the_trained_features(bert_config, tmp_path):
    from PIL import Image

    from crate_clip.models import clip_tokenizer
    from crate_clip.export.writer import export_open_clip
    from crate_clip.train.stage_setup.stage_model import resolve_stage
    from crate_clip.data.image_decode import normalize_batch

    text_source = tmp_path / "text.pt"   # the locked case's pretrained text tower
    torch.save(_trained(_run_config(TINY_BERT, 4, 28, False, None, text_source), seed=9).state_dict(), text_source)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               HF_HUB_CACHE=str(tmp_path / "hub"), TRANSFORMERS_OFFLINE="1")
    expected, loads = {}, []
    for i, (case, (model_name, patch, px, lock, mean)) in enumerate(CASES.items()):
        cfg = _run_config(model_name, patch, px, lock, mean, text_source)
        model = _trained(cfg, seed=i)
        stage = resolve_stage(cfg, 0)
        norm = {"mean": stage.mean, "std": stage.std}   # the training stream's normalisation
        hub_id = HUB_ID if lock else None
        out = export_open_clip(model.state_dict(), model_name, tmp_path / case, image_size=px, context_length=16,
                               mean=norm["mean"], std=norm["std"], bert_vocab=cfg.model.bert_vocab, hub_id=hub_id)
        rgb = np.random.default_rng(i).integers(0, 256, (px, px, 3), dtype=np.uint8)
        Image.fromarray(rgb).save(tmp_path / f"{case}.png")
        pixels = normalize_batch(rgb[None], norm["mean"], norm["std"])   # the training stream's normalisation
        tokenizer = clip_tokenizer(model_name, 16, cfg.model.bert_vocab)   # the training stream's tokenizer
        threads = torch.get_num_threads()
        torch.set_num_threads(1)   # the fresh interpreter's: the same kernels give the same bits
        with torch.no_grad():
            expected[case] = {"pixels": pixels, "tokens": tokenizer(TEXTS), "patch": patch, "px": px,
                              "image_features": model.encode_image(pixels),
                              "text_features": model.encode_text(tokenizer(TEXTS)), "mean": list(norm["mean"])}
        torch.set_num_threads(threads)
        torch.save({"pixels": pixels}, tmp_path / f"{case}.out.in.pt")
        loads.append((f"local-dir:{out}", tmp_path / f"{case}.png", tmp_path / f"{case}.out"))
        if hub_id:
            _hub_cache(out, tmp_path / "hub", hub_id)
            expected[f"{case}_hub"] = expected[case]
            torch.save({"pixels": pixels}, tmp_path / f"{case}_hub.out.in.pt")
            # first: no earlier load in the interpreter has seen this export
            loads.insert(0, (f"hf-hub:{hub_id}", tmp_path / f"{case}.png", tmp_path / f"{case}_hub.out"))
    # one interpreter for every load (each fresh one costs ~7 s of CPU in imports): what each load may use is
    # still only what `import crate_clip, open_clip` set up, and the export's files
    proc = _fresh_loads(loads, env)
    assert proc.returncode == 0, proc.stdout[-4000:]
    for case in expected:
        got, want = torch.load(tmp_path / f"{case}.out", weights_only=False), expected[case]
        assert got["patch"] == want["patch"] and got["tower"] == "crate_alpha_clipa", case
        assert got["preprocess_cfg"]["size"] == (want["px"], want["px"]), case
        assert [float(v) for v in got["preprocess_cfg"]["mean"]] == want["mean"], case
        assert torch.equal(got["tokens"], want["tokens"]), case
        # torchvision's ToTensor + Normalize against the stream's fused (x / 255 - mean) / std: rounding only
        torch.testing.assert_close(got["pixels"], want["pixels"], rtol=0, atol=1e-6, msg=case)
        assert torch.equal(got["image_features"], want["image_features"]), case
        assert torch.equal(got["text_features"], want["text_features"]), case


def test_identical_exports_are_byte_identical_and_the_header_is_sorted(tmp_path):
    from safetensors.torch import load_file

    from crate_clip.models import create_clip
    from crate_clip.export.writer import CONFIG_FILE, WEIGHTS_FILE, export_open_clip

    torch.manual_seed(0)
    state = create_clip(TINY, patch_size=7, image_size=21, context_length=16).state_dict()
    first = export_open_clip(state, TINY, tmp_path / "a", image_size=21, context_length=16)
    second = export_open_clip(state, TINY, tmp_path / "b", image_size=21, context_length=16)
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    raw = (first / WEIGHTS_FILE).read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert list(header) == sorted(header) and header["__metadata__"] == {"format": "pt", "model_name": TINY}
    loaded = load_file(str(first / WEIGHTS_FILE))
    assert all(torch.equal(loaded[k], v.float().reshape(loaded[k].shape)) for k, v in state.items())
    assert json.loads((first / CONFIG_FILE).read_text())["model_cfg"]["vision_cfg"]["timm_model_name"] == \
        "crate_alpha_clipa.w128_d4_h4_p7_21"


def test_an_export_never_replaces_a_folder_that_is_not_an_export(tmp_path):
    from crate_clip.export.writer import export_open_clip

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not an export"):
        export_open_clip({}, TINY, tmp_path / "mine", image_size=28, context_length=16)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


@pytest.mark.slow
def test_two_identical_runs_give_byte_identical_exports(tiny_fmnist, tmp_path):
    """The same config trained twice (one process each time, fp32: the same kernels in the same order; here both in
    this process, train_fixtures.train_in_process) exports the same bytes, model card included: checksums and caches
    of exports work."""
    stages = [{"name": "s", "image_size": 16, "patch_size": 8, "context_length": 16, "samples": 16,
               "global_batch": 8, "lr": 2e-3}]
    for name in ("a", "b"):
        cfg = tiny_config(tmp_path / name, tiny_fmnist, precision="fp32", stages=stages, evals=False,
                          logging={"tensorboard": False, "plot": False, "progress": False})
        cfg["data"]["num_workers"] = 0
        train_in_process(cfg)
    files = sorted(p.name for p in (tmp_path / "a" / "export").iterdir())
    assert files == ["README.md", "open_clip_config.json", "open_clip_model.safetensors"]
    for name in files:
        assert (tmp_path / "a" / "export" / name).read_bytes() == (tmp_path / "b" / "export" / name).read_bytes(), name
