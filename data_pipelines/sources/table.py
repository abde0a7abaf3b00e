"""A CSV/TSV/parquet table of image paths (or URLs to local files) and captions: img2dataset for local files."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Iterator


def read_table(path: str | Path, image_col: str = "image", caption_col: str = "caption") -> list[dict]:
    """Rows of a .csv, .tsv or .parquet table as dicts (the two named columns must exist)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"table {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        delimiter = "\t" if path.suffix in (".tsv", ".tab") else ","
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f, delimiter=delimiter))
    if rows and (image_col not in rows[0] or caption_col not in rows[0]):
        raise KeyError(f"table {path} has columns {sorted(rows[0])}; expected {image_col!r} and {caption_col!r} "
                       "(choose them with --image-col / --caption-col)")
    return rows


def table_samples(path: str | Path, image_col: str = "image", caption_col: str = "caption",
                  root: str | Path | None = None) -> Iterator[dict]:
    """Samples of a table; relative image paths resolve against `root` (default: the table's folder)."""
    path = Path(path)
    base = Path(root) if root else path.parent
    for i, row in enumerate(read_table(path, image_col, caption_col)):
        image = str(row[image_col])
        if image.startswith("file://"):
            image = image[len("file://"):]
        image_path = Path(image) if Path(image).is_absolute() else base / image
        yield {"image": image_path, "caption": str(row[caption_col] or ""), "uid": str(row.get("uid", i)),
               "url": str(image_path), "extra": {}}
