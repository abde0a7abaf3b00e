"""Evaluations that would report a wrong number refuse instead (exit code 2, one line): unreadable images,
class folders that do not match the class names, weights that are not finite or not the exported ones."""
import json
import shutil

import pytest
import webdataset as wds

from crate_clip.cli import main as crate_clip_main
from crate_clip.eval.class_sets import FASHION_MNIST_CLASSNAMES
from crate_clip.eval.stage_hook import evaluate_stage
from crate_clip.eval.unreadable_images import UnreadableDataError
from eval_fixtures import CRATE_TINY, class_dir, shared_crate_tiny

GARBAGE = b"this is text with a .jpg name, not an image\n"


@pytest.fixture
def unreadable_sets(tmp_path):
    """A 10-class ImageFolder and a captioned shard whose 50 images are all unreadable."""
    folder, shards = tmp_path / "folder", tmp_path / "captions"
    shards.mkdir()
    with wds.TarWriter(str(shards / "00000000.tar")) as sink:
        for i in range(50):
            (folder / class_dir(i % 10)).mkdir(parents=True, exist_ok=True)
            (folder / class_dir(i % 10) / f"{i:03d}.jpg").write_bytes(GARBAGE)
            sink.write({"__key__": f"{i:06d}", "jpg": GARBAGE, "txt": b"a photo of a bag."})
    (folder / "classnames.txt").write_text("\n".join(FASHION_MNIST_CLASSNAMES) + "\n")
    return {"folder": folder, "captions": shards}


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("task", ["zeroshot", "linear-probe", "retrieval"])
def test_an_eval_that_reads_no_image_exits_2_and_writes_no_result(task, sets, unreadable_sets, vit_file, tmp_path,
                                                                  capsys):
    name, weights = vit_file
    data = unreadable_sets["captions" if task == "retrieval" else "folder"]
    args = ["eval", task, "--model", name, "--pretrained", str(weights), "--data", str(data), "--no-progress",
            "--cache-dir", "", "--output", str(tmp_path / "out.json")]
    if task != "retrieval":
        args += ["--dataset", "fashion_mnist"]
    if task == "linear-probe":
        args += ["--train-data", str(sets["folder"]), "--weight-decay", "1e-4"]
    assert crate_clip_main(args) == 2
    err = _one_line_error(capsys)
    assert str(data) in err and "none of its 50 images could be read" in err and "no result" in err
    assert not (tmp_path / "out.json").exists()


def test_the_threshold_is_an_option_with_its_default_in_the_help():
    from crate_clip.eval.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices
    for task in ("zeroshot", "linear-probe", "retrieval"):
        text = " ".join(sub[task].format_help().split())
        assert "--max-unreadable-fraction" in text and "cannot be read (always when none can) (default: 0.01)" in text
    args = build_parser().parse_args(["zeroshot", "--model", "m", "--data", "d", "--max-unreadable-fraction", "0.2"])
    assert args.max_unreadable_fraction == 0.2


def test_a_training_run_evaluation_refuses_the_same_way(unreadable_sets):
    evals = [{"name": "fmnist", "type": "zeroshot", "dataset": "fashion_mnist", "data": str(unreadable_sets["folder"]),
              "templates": "plain", "batch_size": 40}]
    with pytest.raises(UnreadableDataError, match="none of its 50 images could be read"):
        evaluate_stage(shared_crate_tiny(), model_name=CRATE_TINY, evals=evals, image_size=28, progress=False)
    evals[0]["max_unreadable_fraction"] = 1.0   # nothing read is refused whatever the threshold
    with pytest.raises(UnreadableDataError, match="no result"):
        evaluate_stage(shared_crate_tiny(), model_name=CRATE_TINY, evals=evals, image_size=28, progress=False)


def test_a_few_unreadable_shard_images_are_refused_above_the_threshold(sets, tmp_path):
    """Retrieval over 30 good pairs and 1 garbage one: 3.2% unreadable, above the default 1%."""
    from crate_clip.eval.eval_datasets import tar_samples

    good = [s for _, s in zip(range(30), tar_samples(str(sets["captions"] / "00000000.tar")))]
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    with wds.TarWriter(str(mixed / "00000000.tar")) as sink:
        for sample in good + [{"__key__": "garbage", "jpg": GARBAGE, "txt": b"a photo of a bag."}]:
            sink.write({k: sample[k] for k in ("__key__", "jpg", "txt")})
    evals = [{"name": "captions", "type": "retrieval", "data": str(mixed), "batch_size": 64}]
    with pytest.raises(UnreadableDataError, match=r"1 of 31 images \(3\.2%\) could not be read \(e\.g\. .*garbage"):
        evaluate_stage(shared_crate_tiny(), model_name=CRATE_TINY, evals=evals, image_size=28, progress=False)
    evals[0]["max_unreadable_fraction"] = 0.05
    result = evaluate_stage(shared_crate_tiny(), model_name=CRATE_TINY, evals=evals, image_size=28, progress=False)
    assert (result["captions"]["n_pairs"], result["captions"]["n_unreadable"]) == (30, 1)


def _renamed_folder(src, dst, rename):
    """A copy of the ImageFolder `src` with each class folder renamed by `rename(old name)`."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("classnames.txt"))
    for old in sorted(p for p in dst.iterdir() if p.is_dir()):
        old.rename(dst / rename(old.name))
    return dst


def _without_index(name: str) -> str:
    """'09_ankle_boot' -> 'Ankle_boot': named as a test split often is, sorting differently from the indexed one."""
    return name.split("_", 1)[1].capitalize()


def _eval_json(tmp_path, name, *args) -> dict:
    out = tmp_path / f"{len(list(tmp_path.glob('*.json')))}.json"
    assert crate_clip_main(["eval", *args, "--dataset", "fashion_mnist", "--no-progress", "--cache-dir", "",
                            "--output", str(out)]) == 0
    return json.loads(out.read_text())


def test_class_folders_are_matched_to_class_names_not_to_sort_order(sets, vit_file, tmp_path, capsys):
    name, weights = vit_file
    renamed = _renamed_folder(sets["folder"], tmp_path / "renamed", _without_index)
    assert sorted(p.name for p in renamed.iterdir())[:2] == ["Ankle_boot", "Bag"]   # classes 9 and 8 sort first
    model = ["--model", name, "--pretrained", str(weights)]
    # same images, same labels: the same numbers (within one image of 160: other batches, other float sums)
    zeroshot = [_eval_json(tmp_path, name, "zeroshot", *model, "--data", str(d))["top1"]
                for d in (sets["folder"], renamed)]
    assert zeroshot[0] > 0.25 and abs(zeroshot[0] - zeroshot[1]) <= 1 / 160, zeroshot
    probe = ["linear-probe", *model, "--train-data", str(sets["folder"]), "--weight-decay", "1e-4"]
    probes = [_eval_json(tmp_path, name, *probe, "--data", str(d))["top1"] for d in (sets["folder"], renamed)]
    assert probes[0] > 0.4 and abs(probes[0] - probes[1]) <= 1 / 160, probes


def test_a_class_folder_that_matches_no_class_name_is_an_error_naming_it(sets, vit_file, tmp_path, capsys):
    name, weights = vit_file
    renamed = _renamed_folder(sets["folder"], tmp_path / "renamed",
                              lambda old: "socks" if old.startswith("08") else _without_index(old))
    base = ["--model", name, "--pretrained", str(weights), "--data", str(renamed), "--dataset", "fashion_mnist",
            "--no-progress", "--cache-dir", ""]
    for task in (["zeroshot"], ["linear-probe", "--train-data", str(sets["folder"])]):
        assert crate_clip_main(["eval", *task, *base]) == 2
        err = _one_line_error(capsys)
        assert f"{renamed}: folders 'socks' match no class name" in err and "fix: name each folder" in err


def test_folder_matching_rules():
    from crate_clip.eval.class_folders import map_class_folders

    names = ["T-shirt/top", "trouser", "ankle boot"]
    assert map_class_folders("r", ["2_Ankle-Boot", "T-shirt_top", "trouser"], names) == \
        {"2_Ankle-Boot": 2, "T-shirt_top": 0, "trouser": 1}
    assert map_class_folders("r", ["002", "0_tee", "1"], names) == {"002": 2, "0_tee": 0, "1": 1}   # by index
    # the training split's folder names as the classes (a probe without class names): prefixes on either side
    assert map_class_folders("r", ["Ankle_boot", "trouser", "t_shirt_top"], ["0_t-shirt_top", "1_trouser", "2_ankle_boot"]) \
        == {"Ankle_boot": 2, "trouser": 1, "t_shirt_top": 0}
    with pytest.raises(ValueError, match=r"r: folders 'tee' match no class name"):
        map_class_folders("r", ["tee", "trouser", "ankle_boot"], names)
    with pytest.raises(ValueError, match=r"'1_trouser' and 'trouser' both match class 'trouser'"):
        map_class_folders("r", ["1_trouser", "trouser", "ankle_boot"], names)
    with pytest.raises(ValueError, match=r"folders '0', '1', '7' match no class name"):   # index 7 out of range
        map_class_folders("r", ["0", "1", "7"], names)


@pytest.fixture
def export_dir(tmp_path):
    """The tiny CRATE CLIP exported as an open_clip local-dir: folder."""
    from crate_clip.export.writer import export_open_clip

    state = shared_crate_tiny().state_dict()
    return export_open_clip(state, CRATE_TINY, tmp_path / "export", image_size=28, context_length=32)


def _overwrite_tensor_bytes(weights, key: str, byte: int, count: int) -> None:
    """Write `count` bytes of value `byte` over the start of tensor `key` of a safetensors file, in place."""
    data = bytearray(weights.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    begin = 8 + header_len + json.loads(data[8:8 + header_len])[key]["data_offsets"][0]
    data[begin:begin + count] = bytes([byte]) * count
    weights.write_bytes(bytes(data))


def _record_checksum(export_dir) -> None:
    """Record the weights file's checksum as it is now (as a writer that saved these weights would)."""
    from crate_clip.checkpoint_io.file_checksums import CHECKSUMS_KEY, file_checksum

    weights, config = export_dir / "open_clip_model.safetensors", export_dir / "open_clip_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), CHECKSUMS_KEY: {weights.name: file_checksum(weights)}}))


def test_an_export_with_non_finite_weights_is_refused_naming_the_tensor(export_dir, sets, capsys):
    # weights that were NaN when written: their checksum matches, the finiteness check still refuses them
    _overwrite_tensor_bytes(export_dir / "open_clip_model.safetensors", "visual.trunk.patch_embed.proj.weight", 0xFF, 64)
    _record_checksum(export_dir)
    code = crate_clip_main(["eval", "zeroshot", "--model", f"local-dir:{export_dir}", "--data", str(sets["folder"]),
                            "--dataset", "fashion_mnist", "--no-progress", "--cache-dir", ""])
    err = _one_line_error(capsys)
    assert code == 2 and "non-finite weights in visual.trunk.patch_embed.proj.weight (16 NaN, 0 inf" in err
    from crate_clip.eval.model_loading import NonFiniteWeightsError, load_eval_model
    with pytest.raises(NonFiniteWeightsError, match=r"patch_embed\.proj\.weight"):   # ours as name + weights file
        load_eval_model(CRATE_TINY, str(export_dir / "open_clip_model.safetensors"))


def test_an_export_is_verified_against_the_checksum_its_config_records(export_dir):
    from crate_clip.checkpoint_io.file_checksums import CHECKSUMS_KEY, ChecksumMismatchError, file_checksum
    from crate_clip.eval.model_loading import load_eval_model

    weights, config = export_dir / "open_clip_model.safetensors", export_dir / "open_clip_config.json"
    assert json.loads(config.read_text())[CHECKSUMS_KEY] == {weights.name: file_checksum(weights)}   # the writer's
    load_eval_model(f"local-dir:{export_dir}")
    _overwrite_tensor_bytes(weights, "logit_scale", 0x40, 1)   # a finite, plausible, different value
    with pytest.raises(ChecksumMismatchError, match=rf"{weights}: sha256 differs from the one {config} records"):
        load_eval_model(f"local-dir:{export_dir}")
    weights.write_bytes(weights.read_bytes()[:-4])
    with pytest.raises(ChecksumMismatchError, match=r"bytes where .* records"):
        load_eval_model(f"local-dir:{export_dir}")
    from crate_clip.export.writer import load_export
    with pytest.raises(ChecksumMismatchError):   # the convenience loader verifies too
        load_export(export_dir)
    unrecorded = json.loads(config.read_text())
    del unrecorded[CHECKSUMS_KEY]
    config.write_text(json.dumps(unrecorded))   # an export of an earlier version: nothing to verify against
    from crate_clip.checkpoint_io.weights_headers import WeightsHeaderError
    with pytest.raises(WeightsHeaderError, match="past the .* bytes of data the file holds"):   # still caught, from
        load_eval_model(f"local-dir:{export_dir}")                                         # its header, unbuilt
