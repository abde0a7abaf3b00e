"""Load a CLIP for evaluation from an open_clip name + weights file, `local-dir:`, or a DeepSpeed checkpoint.

--model and --pretrained are read by crate_clip.models.weights_source (the one parser of a weights source); a
checkpoint folder is chosen by crate_clip.checkpoint_io.checkpoint_choice (its EVAL rules: a checkpoints folder's
`latest`, or one tag folder, DeepSpeed's files sufficing for a checkpoint from elsewhere).

DeepSpeed checkpoints (`<run>/checkpoints/` with a `latest` file, or one `<tag>/` folder) of any ZeRO stage
are consolidated to fp32 by crate_clip.checkpoint_io, the one owner of the checkpoint layout. Whatever the
source, weights that are not finite are refused (a NaN/inf tensor would only give a chance-level number), and
an export's weights file is verified against the checksum its open_clip_config.json records, when it does.
"""
import pickle
import sys
import zipfile
from pathlib import Path

import open_clip
import torch
from open_clip.transform import PreprocessCfg, image_transform_v2

from crate_clip.checkpoint_io.checkpoint_choice import EVAL, choose_checkpoint
from crate_clip.checkpoint_io.checkpoint_record import INFO_FILE, CheckpointInfo, newest_complete_tag, read_record
from crate_clip.checkpoint_io.deepspeed_checkpoints import consolidate_deepspeed_checkpoint
from crate_clip.checkpoint_io.run_layout import LATEST_FILE, checkpoints_dir
from crate_clip.core.errors import UserError
from crate_clip.core.patch_tiling import PatchTilingError
from crate_clip.core.resize_modes import RESOLUTION_RESIZE_MODES
from crate_clip.models.clip_factory import create_clip, read_state_dict
from crate_clip.models.clip_tokenizers import clip_tokenizer
from crate_clip.models.export_files import CONFIG_FILE
from crate_clip.models.model_cfg_check import check_recorded_normalisation
from crate_clip.models.patch_change import (checkpoint_input_sizes, model_tiling_problem,
                                           patch_input_size, set_resolution_by_patch, tower_patch_size)
from crate_clip.models.weights_files import CorruptWeightsError, corrupt_file_message
from crate_clip.models.weights_source import (CHECKPOINT, FILE, HF_HUB_KIND, LOCAL_DIR_KIND, NAME, WeightsSource,
                                              parse_weights_source)



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
                    precision: str = "fp32", bert_vocab: str | None = None, resize: str = "grid"):
    """(model, preprocess, tokenizer, model_name) from a name + weights file (ours or the official
    CRATE-alpha-CLIPA layout), `local-dir:`, or a DeepSpeed checkpoint.

    Weights stay fp32 (`precision='bf16'` evaluates under autocast); a checkpoint that does not fit the
    model config raises CheckpointMismatchError naming the missing and unexpected keys, one with NaN/inf
    weights NonFiniteWeightsError naming the tensors. The tokenizer is the one recorded in a DeepSpeed
    checkpoint unless `bert_vocab` is given. At another `image_size`, `resize` says how (patch_change.py's
    RESOLUTION_RESIZE_MODES): 'grid' resamples the position embedding to the new grid, 'patch' keeps the grid
    and PI-resizes the patch kernel.
    """
    if resize not in RESOLUTION_RESIZE_MODES:
        raise ValueError(f"--resize must be one of {RESOLUTION_RESIZE_MODES}, got {resize!r}")
    by_patch = resize == "patch" and image_size is not None
    requested, image_size = image_size, (None if by_patch else image_size)   # 'patch': built at its own size
    source = parse_weights_source(model)   # the one reading of a weights source (weights_source.py)
    weights = parse_weights_source(pretrained) if pretrained is not None else None
    if source.kind == LOCAL_DIR_KIND:
        # built at the requested size, then loaded with pos-embed resizing (open_clip alone cannot resize a timm tower)
        clip, model_name, record = create_clip(model, image_size=image_size), model, None
    elif source.kind == CHECKPOINT or (weights is not None and weights.kind == CHECKPOINT):
        clip, model_name, record = _from_deepspeed(source if source.kind == CHECKPOINT else weights, model,
                                                   image_size)
    elif source.kind == FILE:
        raise ValueError(f"--model {model} is a weights file: pass the model name as --model and the file as "
                         f"--pretrained (or use local-dir:FOLDER for an exported model with open_clip_config.json)")
    else:
        _check_model_name(source)
        clip, model_name, record = _from_weights_file(model, pretrained, image_size), model, None
    check_finite_weights(clip, pretrained or model)
    if by_patch:
        old = tower_patch_size(clip)
        patch = set_resolution_by_patch(clip, requested)   # refuses a size the grid does not tile
        image_size = patch_input_size(clip)
        print(f"note: --resize patch: kernel {old} -> {patch} px (PI-resize), patch grid kept, images at "
              f"{image_size} px", file=sys.stderr)
    _check_tiling(clip, model, requested)
    clip = clip.to(device).eval()
    bert_vocab = bert_vocab or _recorded_vocab(record)
    return clip, eval_transform(clip, image_size), eval_tokenizer(model_name, clip, bert_vocab), model_name


def _check_tiling(clip: torch.nn.Module, model: str, requested: int | None) -> None:
    """Pixels in, pixels used: refuse an input size the tower's patches do not tile (crate_clip.core.patch_tiling),
    the size asked for with --image-size or, without it, the one the model was saved at."""
    problem = model_tiling_problem(clip)
    if problem:
        where = "--image-size" if requested else f"--model {model} (at the size it was saved at; pass --image-size)"
        raise PatchTilingError(f"{where}: {problem}")


class NonFiniteWeightsError(CorruptWeightsError):
    """Weights holding NaN or inf; the message names the tensors and the source."""


def check_finite_weights(model: torch.nn.Module, source) -> None:
    """NonFiniteWeightsError naming the tensors of `model` that hold NaN or inf (loaded from `source`)."""
    bad = []
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            nan, total = int(tensor.isnan().sum()), tensor.numel()
            bad.append(f"{name} ({nan} NaN, {int(tensor.isinf().sum())} inf of {total:,} values)")
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more tensors" if len(bad) > 5 else "")
        raise NonFiniteWeightsError(f"{source}: non-finite weights in {shown}; the file is damaged or the run it "
                                    f"comes from diverged: use an earlier checkpoint or export")


def _recorded_vocab(record: CheckpointInfo | None) -> str | None:
    # the vocabulary a run was trained with, when it is still where the run found it
    vocab = record.tokenizer.get("bert_vocab") if record is not None else None
    return vocab if vocab and Path(vocab).is_dir() else None


def _from_weights_file(model: str, pretrained: str | None, image_size: int | None):
    """The config `model` holding a weights file, rebuilt at the patch size, image size and context length the
    file was saved at (a stage or an export may have changed them); `image_size` overrides the file's."""
    if pretrained is None:
        return create_clip(model, image_size=image_size)
    if (Path(pretrained).parent / CONFIG_FILE).is_file():   # the weights of an export
        print(f"note: {pretrained} is part of an export; evaluating it with --model's preprocessing and tokenizer "
              f"(--model local-dir:{Path(pretrained).parent} uses the export's own)", file=sys.stderr)
    state = read_state_dict(pretrained)
    saved_size, context_length = checkpoint_input_sizes(state)
    return create_clip(model, image_size=image_size or saved_size, context_length=context_length, pretrained=state)


class ModelSourceError(UserError, ValueError):
    """A --model that names nothing loadable; the message says what it is and what to pass."""


def _check_model_name(source: WeightsSource) -> None:
    """A --model that is a folder but no checkpoint or export, a path that does not exist, or a name open_clip has
    no config for: one line saying what it is and what to pass (open_clip would take the folder's path for a
    model name and raise its own error with the list of every config)."""
    model, folder = source.spec, source.path
    if folder is not None and folder.is_dir():
        newest = newest_complete_tag(folder)
        if newest is not None:
            fix = (f"a checkpoints folder without its `{LATEST_FILE}` file (a run cut short before it was written?); "
                   f"fix: pass one checkpoint folder, e.g. --model {folder / newest} (the newest complete one)")
        elif checkpoints_dir(folder).is_dir():
            fix = f"a run folder; fix: pass its checkpoints, --model {checkpoints_dir(folder)}"
        elif (folder / CONFIG_FILE).is_file():
            fix = f"an export; fix: pass --model local-dir:{model}"
        else:
            fix = ("a folder that is neither a DeepSpeed checkpoint (<run>/checkpoints with a `latest` file, or one "
                   "checkpoint folder holding crate_clip.json) nor an export (open_clip_config.json); fix: pass one "
                   "of those, or an open_clip model name with --pretrained FILE")
        raise ModelSourceError(f"--model {model}: {fix}")
    _check_not_a_missing_path(source)
    if source.kind != HF_HUB_KIND and open_clip.get_model_config(model) is None:
        known = [m for m in open_clip.list_models() if m.startswith("CRATE")]
        raise ModelSourceError(f"--model {model}: no such open_clip model config (CRATE-alpha ones: {', '.join(known)}); "
                         f"fix: pass a registered name, local-dir:EXPORT or a checkpoint folder")


def _check_not_a_missing_path(source: WeightsSource) -> None:
    """A --model that looks like a path (model names have no '/') but does not exist: say so."""
    model = source.spec
    if source.kind == NAME and ("/" in model or model.startswith((".", "~"))) and not source.path.exists():
        raise FileNotFoundError(f"--model {model}: does not exist (a checkpoint folder or file was meant; an open_clip "
                                f"model name has no '/'): check the path")


def _from_deepspeed(source: WeightsSource, model: str, image_size: int | None):
    """The checkpoint folder `source` (--model's, else --pretrained's; then --model names the config)."""
    checkpoint = source.spec
    _check_normalisation(source.path)
    try:
        state, record = consolidate_deepspeed_checkpoint(source.path)   # all None for one from elsewhere
    except (pickle.UnpicklingError, EOFError, RuntimeError, zipfile.BadZipFile) as exn:   # truncated / corrupt
        raise CorruptWeightsError(corrupt_file_message(checkpoint, exn)) from exn
    model_name = record.model_name if checkpoint == model else model
    if not model_name:
        raise ValueError(f"{checkpoint}: no {INFO_FILE} naming the model; pass --model NAME --pretrained {checkpoint}")
    # at the patch size the checkpoint was trained with (a stage may have changed it)
    clip = create_clip(model_name, image_size=image_size or record.image_size,
                       context_length=record.context_length, pretrained=state)
    _adopt_training_preprocess(clip, record)
    return clip, model_name, record


def _check_normalisation(checkpoint) -> None:
    """A NaN mean or a zero std in the checkpoint's record is said to be one before its weights are read (an
    evaluation with it would find no image readable)."""
    try:
        tag_dir = choose_checkpoint(checkpoint, EVAL).tag_dir
    except (OSError, ValueError):
        return   # the consolidation says what is wrong with the folder
    record = read_record(tag_dir)
    check_recorded_normalisation(record.normalisation if record else None, tag_dir / INFO_FILE,
                                 "the checkpoint's record is damaged: use another checkpoint")


def _adopt_training_preprocess(clip: torch.nn.Module, record: CheckpointInfo) -> None:
    """The preprocessing the run trained with (its normalisation, its crops' resampling filter), as the stage's
    evaluations and the run's export use it, where the checkpoint records it."""
    trained = {k: v for k, v in record.normalisation.items() if k in ("mean", "std")}
    interpolation = (record.run_config.get("data") or {}).get("crop_interpolation")
    if interpolation:
        trained["interpolation"] = interpolation
    if trained and hasattr(clip, "visual"):
        clip.visual.preprocess_cfg = {**(getattr(clip.visual, "preprocess_cfg", None) or {}), **trained}
