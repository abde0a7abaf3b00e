"""Zero-shot evaluation: agreement with open_clip's own path, data layouts, cache, precision, bad input."""
import shutil
from argparse import Namespace

import numpy as np
import open_clip
import pytest
import torch
import open_clip_train.zero_shot as open_clip_zero_shot
from torchvision.datasets import ImageFolder

from crate_clip.eval.class_sets import FASHION_MNIST_CLASSNAMES, FASHION_MNIST_TEMPLATES, resolve_templates
from crate_clip.eval.eval_datasets import classification_dataset, imagenet_wnids, read_label_file
from crate_clip.eval.model_loading import eval_transform
from crate_clip.eval.unreadable_images import UnreadableDataError
from crate_clip.eval.tasks.zeroshot import build_text_classifier, zero_shot_evaluate
from eval_fixtures import CRATE_TINY, PER_CLASS, assert_accuracies_agree, shared_crate_tiny

NAMES = list(FASHION_MNIST_CLASSNAMES)
TEMPLATES = list(FASHION_MNIST_TEMPLATES)


def ours(model, name, data, **kwargs):
    """Our zero-shot numbers for `model` on the Fashion-MNIST folder/shards at `data`."""
    preprocess = eval_transform(model)
    dataset = classification_dataset(data, preprocess, dataset="fashion_mnist", num_classes=10,
                                     labels_file=kwargs.pop("labels_file", None))
    return zero_shot_evaluate(model, open_clip.get_tokenizer(name), dataset, NAMES, kwargs.pop("templates", TEMPLATES),
                              batch_size=kwargs.pop("batch_size", 48), progress=False, **kwargs)


def _accuracy_numpy2(output, target, topk=(1,)):
    # open_clip_train.zero_shot.accuracy verbatim except `.item()`: its float() of a 1-element array is a
    # TypeError under numpy 2.x.
    pred = output.topk(max(topk), 1, True, True)[1].t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return [float(correct[:k].reshape(-1).float().sum(0, keepdim=True).item()) for k in topk]


def open_clip_reference(model, name, folder, monkeypatch) -> tuple[float, float, float]:
    """open_clip's zero-shot path: build_zero_shot_classifier + open_clip_train.zero_shot.run on an ImageFolder."""
    monkeypatch.setattr(open_clip_zero_shot, "accuracy", _accuracy_numpy2)
    tokenizer = open_clip.get_tokenizer(name)
    classifier = open_clip.build_zero_shot_classifier(model, tokenizer, NAMES, TEMPLATES, num_classes_per_batch=10)
    loader = torch.utils.data.DataLoader(ImageFolder(str(folder), transform=eval_transform(model)), batch_size=32)
    top1, top5 = open_clip_zero_shot.run(model, classifier, loader,
                                         Namespace(device="cpu", precision="fp32", batch_size=32))
    # mean per-class accuracy from the same classifier, for our extra metric
    preds, targets = [], []
    with torch.no_grad():
        for images, target in loader:
            preds.append((model.encode_image(images, normalize=True) @ classifier).argmax(dim=1))
            targets.append(target)
    preds, targets = torch.cat(preds), torch.cat(targets)
    mean_per_class = float(np.mean([(preds[targets == c] == c).float().mean() for c in range(10)]))
    return top1, top5, mean_per_class


def test_trained_model_matches_open_clip_zero_shot(sets, vit, monkeypatch):
    model, name = vit
    result = ours(model, name, sets["folder"])
    top1, top5, mean_per_class = open_clip_reference(model, name, sets["folder"], monkeypatch)
    assert result["n_images"] == 10 * PER_CLASS and result["n_unreadable"] == 0
    # open_clip builds the classifier by its own code and forwards batches of 32 (ours: 48)
    assert_accuracies_agree(result, {"top1": top1, "top5": top5, "mean_per_class": mean_per_class})
    assert result["top1"] > 0.25          # trained: well above the 10 % of chance
    assert result["top5"] > result["top1"]
    assert [c["n"] for c in result["per_class"]] == [PER_CLASS] * 10
    assert np.mean([c["top1"] for c in result["per_class"]]) == pytest.approx(result["mean_per_class"])


def test_any_map_style_dataset_of_pairs_is_accepted(sets, vit):
    model, name = vit
    pairs = ImageFolder(str(sets["folder"]), transform=eval_transform(model))
    result = zero_shot_evaluate(model, open_clip.get_tokenizer(name), pairs, NAMES, TEMPLATES, batch_size=64,
                                progress=False)
    assert_accuracies_agree(result, ours(model, name, sets["folder"]))   # batches of 64 vs 48
    with pytest.raises(ValueError, match="9 class names but the data set has 10 classes"):
        zero_shot_evaluate(model, open_clip.get_tokenizer(name), pairs, NAMES[:9], TEMPLATES, progress=False)


def test_crate_alpha_tiny_matches_open_clip_zero_shot(sets, monkeypatch):
    model = shared_crate_tiny()
    result = ours(model, CRATE_TINY, sets["folder"])
    top1, top5, _ = open_clip_reference(model, CRATE_TINY, sets["folder"], monkeypatch)
    assert_accuracies_agree(result, {"top1": top1, "top5": top5})   # open_clip's classifier code, batches of 32


def test_folder_flat_and_shards_give_the_same_numbers(sets, vit):
    model, name = vit
    folder = ours(model, name, sets["folder"])
    flat = ours(model, name, sets["flat"], labels_file=sets["labels"])
    shards = ours(model, name, sets["shards"], batch_size=7)
    assert_accuracies_agree(flat, folder)     # data order vs class order: each image in another batch
    assert_accuracies_agree(shards, folder)   # batches of 7 vs 48


def test_classifier_cache_hits_and_is_keyed_by_weights_and_templates(sets, vit, tmp_path):
    model, name = vit
    first = ours(model, name, sets["shards"], cache_dir=tmp_path)
    second = ours(model, name, sets["shards"], cache_dir=tmp_path)
    assert (first["cache_hit"], second["cache_hit"]) == (False, True)
    assert second["cache_path"] == first["cache_path"] and second["top1"] == first["top1"]
    other_templates = ours(model, name, sets["shards"], cache_dir=tmp_path, templates=TEMPLATES[:2])
    assert not other_templates["cache_hit"] and other_templates["cache_path"] != first["cache_path"]
    changed = open_clip.create_model(name)
    changed.load_state_dict(model.state_dict())
    with torch.no_grad():
        changed.text_projection.mul_(1.01)
    assert ours(changed, name, sets["shards"], cache_dir=tmp_path)["cache_path"] != first["cache_path"]
    assert len(list(tmp_path.glob("zeroshot_classifier_*.pt"))) == 3


def test_bf16_evaluation_is_close_to_fp32(sets, vit):
    model, name = vit
    fp32 = ours(model, name, sets["shards"])
    bf16 = ours(model, name, sets["shards"], precision="bf16")
    assert bf16["n_images"] == fp32["n_images"]
    assert abs(bf16["top1"] - fp32["top1"]) <= 0.05


def test_unreadable_images_are_counted_and_refused_above_the_threshold(sets, vit, tmp_path):
    model, name = vit
    folder = tmp_path / "folder"
    shutil.copytree(sets["folder"], folder)
    (folder / "00_T-shirt_top" / "garbage.jpg").write_bytes(b"this is not a jpeg")
    good = next((folder / "01_trouser").glob("*.jpg")).read_bytes()
    (folder / "01_trouser" / "truncated.jpg").write_bytes(good[: len(good) // 2])
    clean = ours(model, name, sets["folder"])
    with pytest.raises(UnreadableDataError, match=r"2 of 162 images \(1\.2%\) could not be read .*garbage"):
        ours(model, name, folder)   # above the default 1%
    damaged = ours(model, name, folder, max_unreadable_fraction=0.02)
    assert damaged["n_unreadable"] == 2 and damaged["n_images"] == clean["n_images"]
    assert sorted(damaged["unreadable_examples"]) == ["00_T-shirt_top/garbage.jpg", "01_trouser/truncated.jpg"]
    assert_accuracies_agree(damaged, clean)   # the skipped files shift the images into other batches


def test_max_images_spreads_over_all_classes(sets, vit):
    model, name = vit
    result = ours(model, name, sets["folder"], max_images=30)
    assert result["n_images"] == 30
    assert all(c["n"] == 3 for c in result["per_class"])


def test_imagenet_folder_without_1000_classes_says_what_it_found(sets):
    with pytest.raises(ValueError, match=r"found 10 class folders \(00_T-shirt_top, 01_trouser"):
        classification_dataset(sets["folder"], lambda im: im, dataset="imagenet1k", num_classes=1000)


def test_class_names_and_labels_must_agree(sets, vit, tmp_path):
    with pytest.raises(ValueError, match="found 10 class folders but 9 class names"):
        classification_dataset(sets["folder"], lambda im: im, dataset="custom", num_classes=9)
    model, name = vit
    shards = classification_dataset(sets["shards"], eval_transform(model), dataset="custom", num_classes=9)
    with pytest.raises(ValueError, match=r"00000000.tar:\d{12}: label 9 outside 0..8"):
        zero_shot_evaluate(model, open_clip.get_tokenizer(name), shards, NAMES[:9], TEMPLATES, progress=False)
    short = tmp_path / "labels.txt"
    short.write_text("\n".join(sets["labels"].read_text().splitlines()[:-1]))
    with pytest.raises(ValueError, match="no label for 1 of 160 images"):
        classification_dataset(sets["flat"], lambda im: im, dataset="custom", num_classes=10, labels_file=short)


def test_label_files_accept_indices_wnids_and_kaggle_csv(tmp_path):
    files = ["ILSVRC2012_val_00000001.JPEG", "ILSVRC2012_val_00000002.JPEG"]
    wnids = imagenet_wnids()
    assert len(wnids) == 1000 and wnids[0] == "n01440764" and wnids == sorted(wnids)
    per_line = tmp_path / "per_line.txt"
    per_line.write_text("65\nn15075141\n")
    assert read_label_file(per_line, files, 1000, wnids) == {files[0]: 65, files[1]: 999}
    kaggle = tmp_path / "LOC_val_solution.csv"
    kaggle.write_text("ImageId,PredictionString\nILSVRC2012_val_00000002,n01443537 1 2 3 4\n"
                      "ILSVRC2012_val_00000001,n01440764 5 6 7 8 n01440764 1 1 1 1\n")
    assert read_label_file(kaggle, files, 1000, wnids) == {files[0]: 0, files[1]: 1}
    one_based = tmp_path / "ground_truth.txt"
    one_based.write_text("1000\n1\n")
    with pytest.raises(ValueError, match="label 1000 outside 0..999"):
        read_label_file(one_based, files, 1000, wnids)


def test_imagenet_templates_and_classifier_shape(vit):
    model, name = vit
    assert len(resolve_templates(None, "imagenet1k")) == 80 and len(resolve_templates("simple", "imagenet1k")) == 7
    classifier = build_text_classifier(model, open_clip.get_tokenizer(name), open_clip.IMAGENET_CLASSNAMES[:25],
                                       resolve_templates("simple", "imagenet1k"), progress=False)
    reference = open_clip.build_zero_shot_classifier(model, open_clip.get_tokenizer(name),
                                                     open_clip.IMAGENET_CLASSNAMES[:25], open_clip.SIMPLE_IMAGENET_TEMPLATES)
    assert classifier.shape == (64, 25)
    torch.testing.assert_close(classifier, reference, atol=1e-5, rtol=1e-5)
