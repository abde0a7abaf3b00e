"""Emoji images rendered from Noto Color Emoji, captioned with their Unicode names (real captions)."""
from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Iterator

from PIL import Image, ImageDraw, ImageFont

from crate_clip.data.sources.debian_packages import DEBIAN_PACKAGES

FONT_PATHS = ("/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf", "/usr/share/fonts/noto/NotoColorEmoji.ttf")
EMOJI_TEST_PATHS = ("/usr/share/unicode/emoji/emoji-test.txt", "/usr/share/unicode-data/emoji/emoji-test.txt")
NOTO_BITMAP_SIZE = 109  # the only size Noto's CBDT bitmap strikes render at
TEMPLATES = ("{}", "an emoji of {}", "a picture of {}", "{} icon", "a cartoon of {}", "the {} emoji")
_LINE = re.compile(r"^([0-9A-F ]+?)\s*;\s*fully-qualified\s*#\s*\S+\s+E[\d.]+\s+(.+)$")


def _first_existing(paths, package: str) -> Path:
    """The first of `paths` that exists (FileNotFoundError naming the Debian package otherwise)."""
    for p in paths:
        if Path(p).is_file():
            return Path(p)
    raise FileNotFoundError(f"none of {paths} exists; install Debian's {DEBIAN_PACKAGES[package]}")


def emoji_names(emoji_test: str | Path | None = None) -> list[tuple[str, str]]:
    """(emoji string, Unicode CLDR name) of every fully-qualified emoji in emoji-test.txt."""
    path = Path(emoji_test) if emoji_test else _first_existing(EMOJI_TEST_PATHS, "emoji_names")
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        m = _LINE.match(line)
        if m:
            out.append(("".join(chr(int(cp, 16)) for cp in m.group(1).split()), m.group(2).strip()))
    return out


def render_emoji(text: str, font: ImageFont.FreeTypeFont, size: int = 136, background=None) -> Image.Image | None:
    """The emoji drawn centred on a size x size RGBA canvas (None when the font has no glyph for it)."""
    canvas = Image.new("RGBA", (size, size), background or (0, 0, 0, 0))
    draw = ImageDraw.Draw(canvas)
    box = draw.textbbox((0, 0), text, font=font, embedded_color=True)
    w, h = box[2] - box[0], box[3] - box[1]
    if w <= 0 or h <= 0 or w > 2 * NOTO_BITMAP_SIZE:  # no glyph: fell apart into several .notdef boxes
        return None
    draw.text(((size - w) / 2 - box[0], (size - h) / 2 - box[1]), text, font=font, embedded_color=True)
    if canvas.getchannel("A").getbbox() is None:
        return None
    return canvas


def emoji_samples(limit: int | None = None, size: int = 136, seed: int = 0, font_path=None,
                  emoji_test=None, background=(255, 255, 255, 255)) -> Iterator[dict]:
    """Rendered emoji with captions from their names, for write_shards (images rendered lazily)."""
    font = ImageFont.truetype(str(font_path or _first_existing(FONT_PATHS, "emoji_images")), NOTO_BITMAP_SIZE)
    rng = random.Random(f"emoji-{seed}")
    count = 0
    for i, (text, name) in enumerate(emoji_names(emoji_test)):
        image = render_emoji(text, font, size, background)
        if image is None:
            continue
        yield {"image": image, "caption": rng.choice(TEMPLATES).format(name), "uid": f"emoji/{i}",
               "url": "emoji://" + "-".join(f"{ord(c):x}" for c in text), "extra": {"name": name}}
        count += 1
        if limit is not None and count >= limit:
            return
