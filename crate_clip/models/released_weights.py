"""The released weights crate-clip knows, and how each loads: what `crate-clip models --weights` lists.

Facts from the papers' repositories (UCSC-VLAA/CRATE-alpha README.md, its Hugging Face repository's files and
`torch_inference/`, UCSC-VLAA/CLIPA clipa_torch/README.md) and open_clip's pretrained registry and model configs.
Data only: nothing is downloaded here, and none of these files is in this repository (docs/models.md#released-weights).
"""
from __future__ import annotations

from dataclasses import dataclass

CRATE_ALPHA_HUB = "https://huggingface.co/UCSC-VLAA/CRATE-alpha/blob/main"


@dataclass(frozen=True)
class ReleasedWeights:
    """One set of released weights: what it is, where it is, its size and reported accuracy where the source
    states them, and how crate-clip loads it."""
    name: str
    what: str
    where: str            # the file's address (or the hub repository / open_clip tag)
    size: str             # as the source states it; "" when it states none
    reported: str         # the accuracy the source reports, "" when it reports none here
    load: str             # how crate-clip (or open_clip / timm after `import crate_clip`) loads it
    source: str           # where these facts are written
    loads_into: str = ""  # the model it loads into: "open_clip:CONFIG", "open_clip:CONFIG:TAG", "timm:NAME"


def _crate_alpha_clipa(size: str, file: str, stated: str, top1: str) -> ReleasedWeights:
    config = f"CRATE-alpha-CLIPA-{size}"
    return ReleasedWeights(
        f"CRATE-α-CLIPA-{size.replace('-', '/')}", "the paper's CLIP: CRATE-α image tower, CLIPA text tower "
        "(DataComp-1B, 2.56B samples at 84 px + 512.5M at 224 px)", f"{CRATE_ALPHA_HUB}/torch/{file}", stated,
        f"{top1} zero-shot top-1, ImageNet-1K", f"crate-clip convert official {file} --model {config} --out DIR "
        f"(then local-dir:DIR); or --pretrained {file} / model.pretrained with model {config}",
        "UCSC-VLAA/CRATE-alpha README.md; the size: the released file", f"open_clip:{config}")


def _crate_alpha_classifier(size: str, file: str, timm_name: str, top1: str) -> ReleasedWeights:
    return ReleasedWeights(
        f"CRATE-α-{size}", "image classifier (ImageNet-21K pre-training, ImageNet-1K fine-tuning), PyTorch port",
        f"{CRATE_ALPHA_HUB}/torch/{file}", "", f"{top1} top-1, ImageNet-1K",
        f"timm.create_model('{timm_name}', pretrained=True, pretrained_cfg_overlay=dict(file='{file}'))",
        "UCSC-VLAA/CRATE-alpha README.md", f"timm:{timm_name}")


def _clipa(config: str, tag: str, hub: str, text_width: int) -> ReleasedWeights:
    opened = f"open_clip.create_model_and_transforms('{config}', pretrained='{tag}')"
    if text_width == CRATE_ALPHA_CLIPA_TEXT_WIDTH:   # the text tower of CRATE-alpha-CLIPA-{B-16,L-14,H-14}
        what, load = ("CLIPA-v2 CLIP (ViT image tower); its text tower has CRATE-α-CLIPA's shape (width 1024, 24 "
                      "layers, 336,160,768 values): the pretrained, frozen text tower its training takes"), \
            f"model.text_pretrained: {config}:{tag} (or the downloaded file's path); {opened}"
        return ReleasedWeights(f"{config} ({tag})", what, f"hf-hub:{hub}", "", "", load, CLIPA_SOURCE,
                               f"open_clip:{config}:{tag}")
    what = f"CLIPA-v2 CLIP (ViT image tower; text tower of width {text_width}, not CRATE-α-CLIPA's 1024)"
    return ReleasedWeights(f"{config} ({tag})", what, f"hf-hub:{hub}", "", "", opened, CLIPA_SOURCE,
                           f"open_clip:{config}:{tag}")


CRATE_ALPHA_CLIPA_TEXT_WIDTH = 1024
CLIPA_SOURCE = "open_clip's pretrained registry and model configs; UCSC-VLAA/CLIPA clipa_torch/README.md"

RELEASED_WEIGHTS = (
    _crate_alpha_clipa("L-14", "crate_alpha_CLIPA_L14.pth", "2.56 GB, 640,165,889 fp32 values", "69.8%"),
    _crate_alpha_clipa("H-14", "crate_alpha_CLIPA_H14.pth", "3.87 GB, 967,866,369 fp32 values", "72.3%"),
    _crate_alpha_classifier("B/16", "crate_alpha_B16.pth", "crate_alpha_base_patch16_224", "81.2%"),
    _crate_alpha_classifier("L/14", "crate_alpha_L14.pth", "crate_alpha_large_patch14_224", "83.9%"),
    ReleasedWeights("CRATE-α (JAX)", "the JAX/Flax training checkpoints", "https://huggingface.co/UCSC-VLAA/"
                     "CRATE-alpha/tree/main/jax", "", "", "not read by crate-clip: use the PyTorch files above",
                     "UCSC-VLAA/CRATE-alpha README.md"),
    _clipa("ViT-L-14-CLIPA", "datacomp1b", "UCSC-VLAA/ViT-L-14-CLIPA-datacomp1B", 768),
    _clipa("ViT-L-14-CLIPA-336", "datacomp1b", "UCSC-VLAA/ViT-L-14-CLIPA-336-datacomp1B", 768),
    _clipa("ViT-H-14-CLIPA", "datacomp1b", "UCSC-VLAA/ViT-H-14-CLIPA-datacomp1B", 1024),
    _clipa("ViT-H-14-CLIPA-336", "datacomp1b", "UCSC-VLAA/ViT-H-14-CLIPA-336-datacomp1B", 1024),
    _clipa("ViT-H-14-CLIPA-336", "laion2b", "UCSC-VLAA/ViT-H-14-CLIPA-336-laion2B", 1024),
    _clipa("ViT-bigG-14-CLIPA", "datacomp1b", "UCSC-VLAA/ViT-bigG-14-CLIPA-datacomp1B", 1280),
    _clipa("ViT-bigG-14-CLIPA-336", "datacomp1b", "UCSC-VLAA/ViT-bigG-14-CLIPA-336-datacomp1B", 1280),
)

# weights of your own: a run's export (or `crate-clip export` of a checkpoint)
LOCAL_EXPORT = ReleasedWeights(
    "your export", "a run's export/ folder, or `crate-clip export` of any checkpoint: open_clip weights, config with "
    "its preprocessing, tokenizer files, model card", "EXPORT (a local folder)", "", "its model card's results",
    "open_clip.create_model_and_transforms('local-dir:EXPORT') after `import crate_clip`; crate-clip eval zeroshot "
    "--model local-dir:EXPORT; model.pretrained: EXPORT; the image tower alone in timm: docs/export.md",
    "docs/export.md")
