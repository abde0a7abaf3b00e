"""create_clip, the one front door for models: its options (name, patch_size, image_size, pretrained from a state
dict, a weights file or an export folder, and `local-dir:`). A DeepSpeed checkpoint folder as `pretrained` is
tested beside the checkpoints test_eval_checkpoints.py's ranks write."""
import pytest
import torch
from safetensors.torch import save_file

import crate_clip
from crate_clip.checkpoint_io.file_checksums import ChecksumMismatchError
from crate_clip.export.writer import export_open_clip
from crate_clip.models import CheckpointMismatchError, create_clip
from crate_clip.models.export_files import WEIGHTS_FILE

TINY = "CRATE-alpha-CLIPA-tiny"   # patch 4 at 28 px: a 7x7 grid


def outputs(model, size: int, context: int):
    torch.manual_seed(1)
    images, text = torch.randn(2, 3, size, size), torch.randint(1, 1000, (2, context))
    with torch.no_grad():
        return model.eval()(images, text)[:2]


@pytest.fixture(scope="module")
def staged():
    """A tiny CLIP as a later stage holds it: patch 7 at 21 px (a 3x3 grid), 16 text tokens."""
    torch.manual_seed(0)
    return create_clip(TINY, image_size=21, context_length=16, patch_size=7)


def test_name_alone_is_the_config_at_its_own_sizes_and_the_package_exports_it():
    assert crate_clip.create_clip is create_clip
    model = create_clip(TINY)
    trunk = model.visual.trunk
    assert (trunk.patch_size, trunk.img_size, model.context_length) == (4, (28, 28), 32)
    assert model.visual.preprocess_cfg["size"] == (28, 28)
    with pytest.raises(RuntimeError, match="not-a-model"):
        create_clip("not-a-model")


def test_patch_size_and_image_size_set_the_tower_and_its_grid(staged):
    trunk = staged.visual.trunk
    assert (trunk.patch_size, trunk.img_size, staged.context_length) == (7, (21, 21), 16)
    assert trunk.patch_embed.proj.weight.shape[-2:] == (7, 7) and trunk.pos_embed.shape[1] == 1 + 3 * 3


def test_pretrained_state_dict_and_file_take_the_weights_patch_size(staged, tmp_path):
    expected = outputs(staged, 21, 16)
    path = tmp_path / "stage.safetensors"
    save_file({k: v.contiguous() for k, v in staged.state_dict().items()}, str(path))
    for source in (staged.state_dict(), path, str(path)):
        # no patch_size: the tower takes the weights' 7 px kernel, and computes what was saved
        model = create_clip(TINY, image_size=21, context_length=16, pretrained=source)
        assert model.visual.trunk.patch_size == 7
        for got, want in zip(outputs(model, 21, 16), expected):
            torch.testing.assert_close(got, want)
    # another stage: 28 px at patch 7 (a 4x4 grid): position embeddings resized, kernel kept
    bigger = create_clip(TINY, image_size=28, context_length=16, pretrained=path)
    assert bigger.visual.trunk.pos_embed.shape[1] == 1 + 4 * 4
    torch.testing.assert_close(bigger.visual.trunk.patch_embed.proj.weight, staged.visual.trunk.patch_embed.proj.weight)
    # patch_size: loaded at the weights' 7 px, then the kernel moves to 14 px (a 2x2 grid of a 28 px image)
    moved = create_clip(TINY, image_size=28, context_length=16, pretrained=path, patch_size=14)
    assert moved.visual.trunk.patch_embed.proj.weight.shape[-1] == 14
    # without a resize mode a size change is refused, naming the file
    with pytest.raises(CheckpointMismatchError, match="stage.safetensors"):
        create_clip(TINY, image_size=28, context_length=16, pretrained=path, pos_embed_resize=None)


def test_pretrained_export_folder_and_local_dir_give_the_export(staged, tmp_path):
    out = export_open_clip(staged.state_dict(), TINY, tmp_path / "export", image_size=21, context_length=16)
    expected = outputs(staged, 21, 16)
    from_folder = create_clip(TINY, image_size=21, context_length=16, pretrained=out)
    from_export = create_clip(f"local-dir:{out}")   # the export's own config, sizes and preprocessing
    assert from_export.visual.trunk.patch_size == 7 and from_export.context_length == 16
    for model in (from_folder, from_export):
        for got, want in zip(outputs(model, 21, 16), expected):
            torch.testing.assert_close(got, want)
    # local-dir: at another image size, its position embeddings resized
    assert create_clip(f"local-dir:{out}", image_size=28).visual.trunk.pos_embed.shape[1] == 1 + 4 * 4
    # an export folder's weights are checked against the checksum its config records, as local-dir: checks them
    (out / WEIGHTS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(ChecksumMismatchError, match=WEIGHTS_FILE):
        create_clip(TINY, image_size=21, context_length=16, pretrained=out)
