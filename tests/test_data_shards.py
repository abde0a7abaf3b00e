"""Shard writing (DataComp layout, atomic, idempotent), local sources, eval sets, the shards CLI."""
import json
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from crate_clip.data.cli import main as shards_main
from crate_clip.data.shard_reader import expand_source, iter_shard_samples
from crate_clip.data.shard_writer import write_shards
from crate_clip.data.sources.fashion_mnist import CLASSNAMES, write_fashion_mnist_classification_shards, \
    write_fashion_mnist_shards
from crate_clip.data.sources.image_folder import image_folder_samples
from crate_clip.data.sources.table import table_samples
from crate_clip.eval.class_sets import resolve_classnames

from data_fixtures import numbered_samples


def read_all(pattern):
    """Every raw sample of a shard pattern, with the skip counter."""
    skips = Counter()
    return [s for url in expand_source(pattern) for s in iter_shard_samples(url, skips)], skips


def test_write_read_round_trip(tmp_path, fashion_mnist_dir):
    expected = list(numbered_samples(120, fashion_mnist_dir))
    result = write_shards(numbered_samples(120, fashion_mnist_dir), tmp_path, 50, max_side=None, progress=False,
                          num_workers=2)
    assert result["samples"] == 120 and result["shards_written"] == 3
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["00000000.tar", "00000000_stats.json", "00000001.tar", "00000001_stats.json",
                     "00000002.tar", "00000002_stats.json"]  # nothing temporary left behind
    assert [json.loads((tmp_path / f"0000000{i}_stats.json").read_text())["successes"] for i in range(3)] == [50, 50, 20]
    samples, skips = read_all(result["pattern"])
    assert sum(skips.values()) == 0 and len(samples) == 120
    assert samples[0]["__key__"] == "000000000000" and samples[51]["__key__"] == "000000010001"
    assert all(len(s["__key__"]) == 12 for s in samples)
    assert [s["txt"].decode() for s in samples] == [e["caption"] for e in expected]
    meta = json.loads(samples[7]["json"])
    assert {"uid", "caption", "key", "status", "width", "height", "original_width", "original_height",
            "sha256"} <= set(meta)
    assert (meta["width"], meta["height"], meta["key"], meta["uid"]) == (28, 28, "000000000007", "t/7")
    import io
    assert Image.open(io.BytesIO(samples[7]["jpg"])).size == (28, 28)
    # Idempotent: a second run finds every shard complete and rewrites nothing.
    mtimes = [p.stat().st_mtime_ns for p in sorted(tmp_path.glob("*.tar"))]
    again = write_shards(numbered_samples(120, fashion_mnist_dir), tmp_path, 50, max_side=None, progress=False,
                         num_workers=1)
    assert again["shards_skipped"] == 3 and again["shards_written"] == 0 and again["samples"] == 120
    assert mtimes == [p.stat().st_mtime_ns for p in sorted(tmp_path.glob("*.tar"))]


def test_big_images_shrunk_to_max_side_and_failures_counted(tmp_path):
    good = Image.new("RGB", (1024, 600), (10, 200, 30))
    samples = [{"image": good, "caption": "a green rectangle", "uid": "a"},
               {"image": b"not an image", "caption": "broken", "uid": "b"},
               {"image": Image.new("RGBA", (40, 40)), "caption": "transparent square", "uid": "c"}]
    result = write_shards(samples, tmp_path, 10, progress=False)
    assert (result["samples"], result["failed"]) == (2, 1)
    raw, _ = read_all(str(tmp_path))
    meta = [json.loads(s["json"]) for s in raw]
    assert (meta[0]["width"], meta[0]["height"], meta[0]["original_width"]) == (512, 300, 1024)
    assert [m["key"] for m in meta] == ["000000000000", "000000000002"]  # keys keep the input position
    stats = json.loads((tmp_path / "00000000_stats.json").read_text())
    assert (stats["count"], stats["successes"], stats["failed_to_resize"]) == (3, 2, 1)


def test_folder_and_table_sources(tmp_path, capsys):
    root = tmp_path / "folder"
    for cls, color in (("golden_retriever", (200, 150, 50)), ("red_car", (220, 0, 0))):
        (root / cls).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (64, 48), color).save(root / cls / f"{i}.png")
    samples = list(image_folder_samples(root))
    assert len(samples) == 6 and "golden retriever" in samples[0]["caption"] and "red car" in samples[5]["caption"]
    (tmp_path / "t.tsv").write_text("image\tcaption\nfolder/red_car/0.png\ta red car parked\n"
                                    "folder/golden_retriever/1.png\ta happy dog\n")
    result = write_shards(table_samples(tmp_path / "t.tsv"), tmp_path / "out", 10, progress=False)
    raw, _ = read_all(str(tmp_path / "out"))
    assert result["samples"] == 2 and [s["txt"].decode() for s in raw] == ["a red car parked", "a happy dog"]
    with pytest.raises(KeyError, match="caption_text"):
        list(table_samples(tmp_path / "t.tsv", caption_col="caption_text"))
    from crate_clip.core.dataset_records import read_dataset_record   # a name for model cards, given by the user
    capsys.readouterr()
    assert shards_main(["folder", str(root), "--out", str(tmp_path / "named"), "--dataset-name", "Dogs and cars"]) == 0
    assert read_dataset_record(tmp_path / "named").name == "Dogs and cars"
    err = capsys.readouterr().err   # stderr is no terminal here: a plain line, no bar (docs/cli.md#progress)
    assert err.startswith(f"[progress] folder {root}: done, 6 images in ") and "\r" not in err, err


def test_fashion_mnist_shards_and_eval_sets(tmp_path, fashion_mnist_dir, capsys):
    result = write_fashion_mnist_shards(tmp_path / "train", "train", samples_per_shard=100, limit=250)
    assert result["samples"] == 250 and len(result["shards"]) == 3
    raw, _ = read_all(result["pattern"])
    captions = {s["txt"].decode() for s in raw}
    assert len(captions) > 20  # varied templates and synonyms, not one caption per class
    labels = [json.loads(s["json"])["label"] for s in raw]
    assert set(labels) == set(range(10))
    from crate_clip.core.dataset_records import read_dataset_record   # the data named for model cards
    assert read_dataset_record(result["pattern"]).name == "Fashion-MNIST"

    assert shards_main(["eval-folder", "--out", str(tmp_path / "val"), "--max-images", "60"]) == 0
    summary = json.loads(capsys.readouterr().out)   # the sample count, as eval-shards says it
    folder = Path(summary["out_dir"])
    assert summary == {"out_dir": str(tmp_path / "val"), "samples": 60, "classnames": str(folder / "classnames.txt")}
    dirs = sorted(d.name for d in folder.iterdir() if d.is_dir())
    assert len(dirs) == 10 and dirs[0] == "0_T-shirt-top" and dirs[9] == "9_ankle_boot"   # "T-shirt/top", "ankle boot"
    assert (folder / "classnames.txt").read_text().splitlines() == list(CLASSNAMES)
    assert resolve_classnames("custom", folder) == resolve_classnames("fashion_mnist")   # one class list
    assert sum(len(list((folder / d).iterdir())) for d in dirs) == 60
    assert (read_dataset_record(folder).name, read_dataset_record(folder).split) == ("Fashion-MNIST", "test")

    cls = write_fashion_mnist_classification_shards(tmp_path / "cls", "test", samples_per_shard=40, limit=100)
    raw, _ = read_all(cls["pattern"])
    assert cls["samples"] == 100 and len(cls["shards"]) == 3 and all(int(s["cls"]) in range(10) for s in raw)
    # CLIP_benchmark's wds/ layout: <split>/{0..n-1}.tar with nshards.txt, class names and {c} templates at the root
    assert sorted(p.name for p in (tmp_path / "cls" / "test").iterdir()) == ["0.tar", "1.tar", "2.tar", "nshards.txt"]
    assert (tmp_path / "cls" / "test" / "nshards.txt").read_text().strip() == "3"
    assert (tmp_path / "cls" / "classnames.txt").read_text().splitlines() == list(CLASSNAMES)
    templates = (tmp_path / "cls" / "zeroshot_classification_templates.txt").read_text().splitlines()
    assert templates[0] == "a photo of a {c}." and len(templates) == 5


def test_cli_writes_emoji_and_fashion_shards(tmp_path, capsys):
    if not Path("/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf").is_file():
        pytest.skip("fonts-noto-color-emoji is not installed")
    assert shards_main(["emoji", "--out", str(tmp_path / "emoji"), "--max-images", "30", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["samples"] == 30 and summary["num_shards"] == 1
    raw, _ = read_all(str(tmp_path / "emoji"))
    img = Image.open(__import__("io").BytesIO(raw[0]["jpg"]))
    assert img.mode == "RGB" and img.size == (136, 136)
    assert "grinning face" in raw[0]["txt"].decode()
    assert shards_main(["table", str(tmp_path / "missing.csv"), "--out", str(tmp_path / "x")]) == 2
    assert "missing.csv" in capsys.readouterr().err


def test_interrupted_write_leaves_no_partial_shard(tmp_path):
    def killed():
        raise KeyboardInterrupt  # the run is killed while the second shard is being encoded

    samples = [{"image": Image.new("RGB", (20, 20)), "caption": "one", "uid": "1"},
               {"image": Image.new("RGB", (20, 20)), "caption": "two", "uid": "2"},
               {"image": killed, "caption": "three", "uid": "3"}]
    with pytest.raises(KeyboardInterrupt):
        write_shards(samples, tmp_path, 2, progress=False, num_workers=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00000000.tar", "00000000_stats.json"]


def test_parquet_metadata_and_parquet_table(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    for i in range(3):
        Image.new("RGB", (30 + i, 20), (i * 50, 0, 0)).save(tmp_path / f"{i}.png")
    pq.write_table(pa.table({"path": [f"{i}.png" for i in range(3)], "text": ["one", "two", "three"]}),
                   tmp_path / "t.parquet")
    result = write_shards(table_samples(tmp_path / "t.parquet", "path", "text"), tmp_path / "out", 10,
                          write_parquet=True, progress=False)
    rows = pq.read_table(tmp_path / "out" / "00000000.parquet").to_pylist()
    assert result["samples"] == 3 and [r["caption"] for r in rows] == ["one", "two", "three"]
    assert [r["original_width"] for r in rows] == [30, 31, 32] and rows[0]["key"] == "000000000000"
