"""timm names of CRATE-alpha CLIP image towers that carry their architecture, resolved after `import crate_clip`.

open_clip builds a timm image tower from its name alone: its TimmModel calls `timm.create_model(name,
pretrained=..., drop_path_rate/patch_drop_rate)` and passes neither the image size nor the patch size
(open_clip 3.3, timm_model.py). A tower trained at a patch size or image size that no registered variant
has is therefore named by its parameters:

    crate_alpha_clipa.w<width>_d<depth>_h<heads>_p<patch>_<px>      e.g. crate_alpha_clipa.w128_d4_h4_p7_28

timm reads `arch.tag` as an architecture and a pretrained tag and hands the tag to the architecture's entry
point (as `pretrained_cfg`). `crate_alpha_clipa` is registered once, on import, and builds the tower its tag
names, so every such name resolves in any process that imported crate_clip: nothing is registered per name.
The untagged `crate_alpha_clipa` is its default tag's tower, CRATE-alpha-CLIPA-B/16's (`.w768_d12_h12_p16_224`),
as for every timm architecture. The underscore form `crate_alpha_clipa_w.._p<patch>_<px>` names the same
towers, one registered name each (`register_clip_tower`, called for the JSONs of a config folder and by
`register_tower_of`).
"""
from typing import Dict, Optional

from timm.models import generate_default_cfgs, is_model, register_model

from crate_clip.models import crate_alpha
from crate_clip.models.crate_alpha import VARIANTS
from crate_clip.models.model_config_files import FAMILY, TAG as _TAG, parametric_tag

FORM = f"{FAMILY}.w<width>_d<depth>_h<heads>_p<patch>_<px>"
DEFAULT_TAG = "w768_d12_h12_p16_224"
WEIGHT_SOURCES = ("file", "url", "hf_hub_id", "state_dict")   # the pretrained_cfg keys timm loads weights from
# A name is read from files (an export's config): its sizes are bounded by the registered families (the largest,
# CRATE-alpha-H: width 1280, 32 blocks, 16 heads; patches up to 32 px) and the image by 1024 px (fine-tuning at
# a higher resolution than 224 px), so no name makes timm allocate more than the largest registered tower
MAX_TOWER = dict(width=max(a["embed_dim"] for a in VARIANTS.values()), depth=max(a["depth"] for a in VARIANTS.values()),
                 heads=max(a["num_heads"] for a in VARIANTS.values()),
                 patch=max(a["patch_size"] for a in VARIANTS.values()), px=1024)


def clip_tower_name(width: int, depth: int, heads: int, patch_size: int, image_size: int) -> str:
    """The parametric timm name of a CRATE-alpha CLIP tower."""
    return f"{FAMILY}.w{width}_d{depth}_h{heads}_p{patch_size}_{image_size}"


def _tag_arch(tag: str, name: str) -> Dict:
    m = _TAG.match(tag or "")
    if not m:
        raise ValueError(f"{name!r} is not a CRATE-alpha CLIP tower name of the form {FORM}")
    width, depth, heads, patch, px = map(int, m.groups())
    if min(width, depth, heads, patch, px) < 1 or width % heads or px < patch:
        raise ValueError(f"{name!r}: width must be a multiple of heads and the image at least one patch")
    sizes = dict(width=width, depth=depth, heads=heads, patch=patch, px=px)
    over = [f"{k} {v:,} > {MAX_TOWER[k]:,}" for k, v in sizes.items() if v > MAX_TOWER[k]]
    if over:
        raise ValueError(f"{name!r}: larger than any registered CRATE-alpha tower ({', '.join(over)})")
    return dict(embed_dim=width, depth=depth, num_heads=heads, patch_size=patch, img_size=px,
                **crate_alpha._CLIP_TOWER_ARGS)


def parse_clip_tower_name(name: str) -> Dict:
    """Architecture kwargs of a parametric CLIP tower name (either form); ValueError for any other name."""
    return _tag_arch(parametric_tag(name), name)


def tower_arch(name: str) -> Optional[Dict]:
    """Architecture kwargs (patch_size and img_size included) of a CRATE / CRATE-alpha tower name: parametric
    or a registered variant; None for any other name."""
    try:
        return parse_clip_tower_name(name)
    except ValueError:
        pass
    arch = VARIANTS.get(name.partition(".")[0])
    return None if arch is None else {"img_size": 224, **arch}


def tower_name_at(name: str, patch_size: int, image_size: int) -> str:
    """A name that `import crate_clip` alone resolves to tower `name`'s architecture at `patch_size` and
    `image_size`: `name` itself when it is a registered variant of that patch and size, else the parametric one."""
    arch = tower_arch(name)
    if arch is None:
        raise ValueError(f"{name!r} is not a CRATE-alpha tower: no name at another patch or image size")
    if name in VARIANTS and (arch["patch_size"], arch["img_size"]) == (patch_size, image_size):
        return name
    extra = {k: v for k, v in arch.items() if k not in ("embed_dim", "depth", "num_heads", "patch_size", "img_size")}
    if extra != crate_alpha._CLIP_TOWER_ARGS:
        raise ValueError(f"{name!r} at patch {patch_size} / {image_size} px: only CRATE-alpha CLIP towers (conv "
                         f"patches without bias, no head) have parametric names")
    return clip_tower_name(arch["embed_dim"], arch["depth"], arch["num_heads"], patch_size, image_size)


def _family_entrypoint(pretrained: bool = False, pretrained_cfg=None, **kwargs):
    """The CRATE-alpha CLIP tower its tag names (`crate_alpha_clipa.w128_d4_h4_p7_28`); no released weights, so
    `pretrained=True` loads the file the caller names (pretrained_cfg_overlay's `file`, e.g. an export's)."""
    tag = pretrained_cfg if isinstance(pretrained_cfg, str) else DEFAULT_TAG
    arch = _tag_arch(tag, f"{FAMILY}.{tag}")
    overlay = kwargs.get("pretrained_cfg_overlay") or {}
    if pretrained and not any(overlay.get(k) for k in WEIGHT_SOURCES):
        raise ValueError(f"{FAMILY}.{tag}: parametric towers have no released weights; name a file: "
                         "pretrained_cfg_overlay=dict(file=EXPORT/open_clip_model.safetensors), or checkpoint_path=")
    cfg = {**crate_alpha.clip_tower_cfg(arch["img_size"]), "tag": tag}
    return crate_alpha._create_crate_alpha(FAMILY, pretrained, pretrained_cfg=cfg, **{**arch, **kwargs})


def _register_family() -> None:
    _family_entrypoint.__name__ = _family_entrypoint.__qualname__ = FAMILY
    _family_entrypoint.__module__ = crate_alpha.__name__   # listed with the other CRATE towers
    default = {f"{FAMILY}.{DEFAULT_TAG}": crate_alpha.clip_tower_cfg(224)}
    crate_alpha.default_cfgs.update(generate_default_cfgs(default))
    setattr(crate_alpha, FAMILY, register_model(_family_entrypoint))


def register_clip_tower(name: str) -> None:
    """Register an underscore-form parametric tower name with timm (no-op when already known or tagged)."""
    if is_model(name):
        return
    arch = parse_clip_tower_name(name)
    crate_alpha.default_cfgs.update(
        crate_alpha.generate_default_cfgs({name: crate_alpha.clip_tower_cfg(arch["img_size"])}))
    setattr(crate_alpha, name, register_model(crate_alpha._make_entrypoint(name, arch)))


if not is_model(FAMILY):
    _register_family()
