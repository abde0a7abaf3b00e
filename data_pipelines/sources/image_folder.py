"""An ImageFolder tree (`<root>/<class>/<image>`) as captioned samples: class names become captions."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Iterator

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
TEMPLATES = ("a photo of a {}.", "a picture of the {}.", "an image of a {}.", "a close-up photo of a {}.",
             "a {}.", "a good photo of the {}.")


def class_to_caption_name(folder: str) -> str:
    """Folder name to words: 'golden_retriever' -> 'golden retriever', '03_ankle-boot' -> 'ankle-boot'."""
    name = folder.split("_", 1)[1] if folder[:1].isdigit() and "_" in folder else folder
    return name.replace("_", " ").strip()


def image_folder_samples(root: str | Path, seed: int = 0, classnames: list[str] | None = None) -> Iterator[dict]:
    """Samples of every image under root/<class>/ (sorted), captioned from the class name."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist")
    class_dirs = sorted(d for d in root.iterdir() if d.is_dir())
    if not class_dirs:
        raise ValueError(f"image folder {root} has no class sub-folders")
    names = classnames or [class_to_caption_name(d.name) for d in class_dirs]
    rng = random.Random(f"folder-{seed}")
    for label, d in enumerate(class_dirs):
        for f in sorted(p for p in d.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES):
            yield {"image": f, "caption": rng.choice(TEMPLATES).format(names[label]),
                   "uid": str(f.relative_to(root)), "url": str(f), "extra": {"label": label}}
