"""Load a CLIP for evaluation from an open_clip name + weights file, `local-dir:`, or a DeepSpeed checkpoint.

DeepSpeed checkpoints (`<run>/checkpoints/` with a `latest` file, or one `<tag>/` folder) of any ZeRO stage
are consolidated to fp32: stage 0 keeps the whole model in `mp_rank_00_model_states.pt["module"]`;
stages 1-3 are merged from their partitions by DeepSpeed's zero_to_fp32.
"""
import json
from pathlib import Path

import open_clip
import torch
from open_clip.transform import PreprocessCfg, image_transform_v2

from crate_clip.models.clip_factory import create_clip, load_clip_weights, read_state_dict
from crate_clip.models.clip_tokenizers import clip_tokenizer

RUN_INFO_FILE = "crate_clip.json"
STAGE0_MODEL_FILE = "mp_rank_00_model_states.pt"
LOCAL_DIR = "local-dir:"


def _is_tag_dir(path: Path) -> bool:
    return path.is_dir() and (any(path.glob("*mp_rank_*_model_states.pt")) or (path / RUN_INFO_FILE).is_file())


def is_deepspeed_checkpoint(path: str | Path | None) -> bool:
    """True for a DeepSpeed checkpoint folder (with a `latest` file) or one of its tag folders."""
    if path is None or str(path).startswith(LOCAL_DIR):
        return False
    path = Path(path)
    return (path / "latest").is_file() or _is_tag_dir(path)


def resolve_checkpoint_tag(path: str | Path, tag: str | None = None) -> Path:
    """The tag folder: `path/<tag>`, `path/<contents of latest>`, or `path` itself when it is a tag folder."""
    path = Path(path)
    if tag is not None:
        tag_dir = path / tag
    elif (path / "latest").is_file():
        tag_dir = path / (path / "latest").read_text().strip()
    else:
        tag_dir = path
    if not _is_tag_dir(tag_dir):
        raise FileNotFoundError(f"{tag_dir} is not a DeepSpeed checkpoint folder (no *model_states.pt files)")
    return tag_dir


def consolidate_deepspeed_checkpoint(path: str | Path, tag: str | None = None) -> tuple[dict, dict]:
    """fp32 state dict of a DeepSpeed checkpoint of any ZeRO stage, and the run info from crate_clip.json."""
    tag_dir = resolve_checkpoint_tag(path, tag)
    info_path = tag_dir / RUN_INFO_FILE
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    if any(tag_dir.glob("*zero_pp_rank_*_optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        state = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
        info.setdefault("zero_stage", "1-3")
    else:
        # ZeRO stage 0 (zero_to_fp32 refuses it): the whole module is in the model-states file.
        # DeepSpeed's own files are pickles with its config objects: trusted, as DeepSpeed itself loads them.
        states = torch.load(tag_dir / STAGE0_MODEL_FILE, map_location="cpu", weights_only=False)
        state = states["module"]
        info.setdefault("zero_stage", 0)
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    info["checkpoint"] = str(tag_dir)
    return state, info


def eval_transform(model: torch.nn.Module, image_size: int | None = None):
    """open_clip's evaluation preprocessing for this model (its mean/std), at `image_size` if given."""
    cfg = dict(getattr(getattr(model, "visual", None), "preprocess_cfg", None) or {})
    size = image_size or getattr(model.visual, "image_size", None) or cfg.get("size", 224)
    cfg["size"] = tuple(size) if isinstance(size, (tuple, list)) else size
    return image_transform_v2(PreprocessCfg(**cfg), is_train=False)


def eval_tokenizer(model_name: str, model: torch.nn.Module, bert_vocab: str | None = None):
    """The model's deterministic tokenizer at its context length (never a reduction mask); `bert_vocab`
    (a folder with vocab.txt) stands in for the hub for BERT-tokenized (CLIPA text) models."""
    tokenizer = clip_tokenizer(model_name, context_length=getattr(model, "context_length", None), bert_vocab=bert_vocab)
    # A config's tokenizer_kwargs may carry a training reduction mask (random/syntax/...): evaluation truncates.
    if getattr(tokenizer, "reduction_fn", None) is not None:
        tokenizer.reduction_fn = None
    return tokenizer


def load_eval_model(model: str, pretrained: str | None = None, image_size: int | None = None, device="cpu",
                    precision: str = "fp32", bert_vocab: str | None = None):
    """(model, preprocess, tokenizer, model_name) from a name + weights file (ours or the official
    CRATE-alpha-CLIPA layout), `local-dir:`, or a DeepSpeed checkpoint.

    Weights stay fp32 (`precision='bf16'` evaluates under autocast); a checkpoint that does not fit the
    model config raises CheckpointMismatchError naming the missing and unexpected keys. The tokenizer is
    the one recorded in a DeepSpeed checkpoint unless `bert_vocab` is given.
    """
    if model.startswith(LOCAL_DIR):
        clip, model_name, info = _from_local_dir(model, image_size), model, {}
    elif is_deepspeed_checkpoint(model) or is_deepspeed_checkpoint(pretrained):
        clip, model_name, info = _from_deepspeed(model, pretrained, image_size)
    elif Path(model).is_file():
        raise ValueError(f"--model {model} is a weights file: pass the model name as --model and the file as "
                         f"--pretrained (or use local-dir:FOLDER for an exported model with open_clip_config.json)")
    else:
        clip, model_name, info = create_clip(model, image_size=image_size, pretrained=pretrained), model, {}
    clip = clip.to(device).eval()
    bert_vocab = bert_vocab or _recorded_vocab(info)
    return clip, eval_transform(clip, image_size), eval_tokenizer(model_name, clip, bert_vocab), model_name


def _recorded_vocab(info: dict) -> str | None:
    # the vocabulary a run was trained with, when it is still where the run found it
    vocab = (info.get("tokenizer") or {}).get("bert_vocab")
    return vocab if vocab and Path(vocab).is_dir() else None


def _from_local_dir(model: str, image_size: int | None):
    # Build at the requested size, then load with pos-embed resizing (open_clip alone cannot resize a timm tower).
    folder = Path(model[len(LOCAL_DIR):])
    weights = open_clip.factory._find_checkpoint_in_dir(folder)
    if weights is None:
        raise FileNotFoundError(f"{folder}: no open_clip_model.safetensors / open_clip_pytorch_model.bin weights")
    clip = open_clip.create_model(model, load_weights=False, force_image_size=image_size)
    load_clip_weights(clip, read_state_dict(weights), pos_embed_resize="grid_2d")
    return clip


def _from_deepspeed(model: str, pretrained: str | None, image_size: int | None):
    checkpoint = model if is_deepspeed_checkpoint(model) else pretrained
    state, info = consolidate_deepspeed_checkpoint(checkpoint)
    model_name = info.get("model_name") if checkpoint == model else model
    if not model_name:
        raise ValueError(f"{checkpoint}: no {RUN_INFO_FILE} naming the model; pass --model NAME --pretrained {checkpoint}")
    clip = create_clip(model_name, image_size=image_size or info.get("image_size"),
                       context_length=info.get("context_length"))
    load_clip_weights(clip, state, pos_embed_resize="grid_2d")
    return clip, model_name, info
