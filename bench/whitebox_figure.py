"""The white-box figure of docs/whitebox.md: for a few composite scenes, the trained tower's head-average class-token
attention, the joint PCA of patch features and the MaskCut masks (CRATE-alpha demo tower; ViT for comparison).

    python bench/whitebox_figure.py [--scenes data/fmnist_scenes] [--out docs/whitebox_demo.png]
"""
import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rows_for(model: str, images: list, size: int = 56) -> list:
    """Per image: [attention overlay, PCA overlay, MaskCut overlay] tiles, each image-size x display scale."""
    from crate_clip.eval.model_loading import load_eval_model
    from crate_clip.eval.segmentation import overlay_masks, segment_batch, to_tensor
    from crate_clip.eval.whitebox_maps import block_maps, display_scale, grid_to_image, joint_pca, overlay

    torch.manual_seed(0)
    clip = load_eval_model(model, None, size)[0].float().eval()
    with torch.no_grad():
        maps = block_maps(clip, to_tensor(images, clip), -1)
        masks = segment_batch(clip, images)
    pca = joint_pca(maps.patch_features("projection").numpy(), 4)
    attn = maps.cls_attention().numpy().mean(axis=1)
    rows = []
    for im, a, p, m in zip(images, attn, pca, masks):
        s = display_scale(im.size, 112)
        big = im.resize((im.width * s, im.height * s), Image.NEAREST)
        rows.append([overlay(big, grid_to_image(a, big.size)),
                     overlay(big, grid_to_image(p[:, 1:4].reshape(*maps.grid, 3), big.size), 0.7),
                     overlay_masks(im, m).resize(big.size, Image.NEAREST)])
    return rows


def main(argv=None) -> int:
    """Compose the figure."""
    from crate_clip.eval.whitebox_cli import scene_shards

    p = argparse.ArgumentParser()
    p.add_argument("--scenes", default=str(ROOT / "data" / "fmnist_scenes"))
    p.add_argument("--out", default=str(ROOT / "docs" / "whitebox_demo.png"))
    p.add_argument("--indices", default="2,3,5,9")
    p.add_argument("--crate-run", default=str(ROOT / "runs" / "crate_demo"))
    p.add_argument("--vit-run", default=str(ROOT / "runs" / "vit_demo"))
    args = p.parse_args(argv)
    wanted = [int(i) for i in args.indices.split(",")]
    scenes = [im for i, (_, im, _) in enumerate(scene_shards(args.scenes, max(wanted) + 1)) if i in wanted]
    crate = rows_for(f"local-dir:{Path(args.crate_run) / 'export'}", scenes)
    vit = rows_for(f"local-dir:{Path(args.vit_run) / 'export'}", scenes)
    tile = crate[0][0].size[0]
    header = 16
    cols = ["scene", "CRATE-a attention", "CRATE-a PCA", "CRATE-a MaskCut", "ViT attention", "ViT PCA", "ViT MaskCut"]
    out = Image.new("RGB", (len(cols) * (tile + 3), header + len(scenes) * (tile + 3)), "white")
    draw = ImageDraw.Draw(out)
    for c, name in enumerate(cols):
        draw.text((c * (tile + 3) + 2, 2), name, fill="black")
    for r, im in enumerate(scenes):
        tiles = [im.resize((tile, tile), Image.NEAREST)] + crate[r] + vit[r]
        for c, t in enumerate(tiles):
            out.paste(t, (c * (tile + 3), header + r * (tile + 3)))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    out.save(args.out, optimize=True)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
