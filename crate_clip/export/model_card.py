"""The model card (README.md) of an export: what the model is and is for, how it was trained, what it scored, how
to load and cite it.

Hugging Face shows a repository's README.md as its model card and reads the YAML block at its top
(`library_name: open_clip` links open_clip's loading snippet; `model-index` lists the results of these weights).
Its sections follow the Hub's card template (uses, limitations, training, evaluation, citation), each written for
the reader of a published model. Everything comes from the checkpoint and results.jsonl, nothing from the clock,
so the card of one checkpoint is the same file every time.
"""
from __future__ import annotations

import configparser
import hashlib
from importlib import metadata
from pathlib import Path, PurePosixPath

import yaml

from crate_clip.core.dataset_records import BUILTIN_EVAL_SETS, DatasetRecord, read_dataset_record
from crate_clip.export.source import ExportSource
from crate_clip.models.export_files import WEIGHTS_FILE

DISTRIBUTION = "crate-clip"
SETUP_CFG = Path(__file__).resolve().parents[2] / "setup.cfg"   # a source checkout that is not installed
INSTALL = ("Loading it needs the crate-clip package, which no package registry serves: install it from its "
           "source (`pip install .` in a checkout) or from a wheel built there (`pip wheel --no-deps .`, then "
           "`pip install crate_clip-*.whl`), and `import crate_clip`, which registers the CRATE-alpha towers "
           "with timm.")

INTENDED_USE = [
    "- Research on white-box image towers in contrastive image-text models: zero-shot classification and "
    "image-text retrieval, linear probes on its features, and the CRATE-alpha tower's attention maps and sparse "
    "codes (`crate-clip inspect`, `crate-clip segment`).",
    "- Zero-shot classification of images like its training images into classes named in words like its "
    "training captions, after measuring it on the task's own data."]
OUT_OF_SCOPE = [
    "- Deployed use of any kind without testing on the images and classes it would meet there: the results "
    "below hold for the evaluation sets named, at the input size named, and say nothing about other data.",
    "- Decisions about people: surveillance, identifying people, or classifying them by any attribute.",
    "- Images unlike its training images and text in other words or languages than its training captions'."]
LIMITATIONS = [
    "- Zero-shot accuracy depends on the class names and prompt templates; the results below use each "
    "evaluation's own.",
    "- The model knows what its training data shows and inherits the biases of its images and captions "
    "(below); it has not been evaluated for fairness or robustness."]
# what the card can say about a data set it knows by its Hub id (crate-clip writes these data sets' shards)
DATA_NOTES = {
    "zalando-datasets/fashion_mnist":
        "Fashion-MNIST: 70,000 grayscale 28 x 28 px photos of Zalando's articles (60,000 train, 10,000 test) in "
        "10 clothing classes, one centred article on a black background per image. It has no captions: crate-clip's "
        "shard writer captions each image from its class name or a synonym in one of ten prompt forms, so the "
        "text tower has learned these 10 classes, not language, and the image tower has seen these articles "
        "alone, in grayscale: no scenes, no colour."}
CITATION = """```bibtex
@inproceedings{yang2024scaling,
  title     = {Scaling White-Box Transformers for Vision},
  author    = {Yang, Jinrui and Li, Xianhang and Pai, Druv and Zhou, Yuyin and Ma, Yi and Yu, Yaodong and Xie, Cihang},
  booktitle = {Advances in Neural Information Processing Systems (NeurIPS)},
  year      = {2024},
  eprint    = {2405.20299},
  archivePrefix = {arXiv}
}

@inproceedings{li2023inverse,
  title     = {An Inverse Scaling Law for {CLIP} Training},
  author    = {Li, Xianhang and Wang, Zeyu and Xie, Cihang},
  booktitle = {Advances in Neural Information Processing Systems (NeurIPS)},
  year      = {2023},
  eprint    = {2305.07017},
  archivePrefix = {arXiv}
}

@software{ilharco_gabriel_2021_5143773,
  title     = {{OpenCLIP}},
  author    = {Ilharco, Gabriel and Wortsman, Mitchell and Wightman, Ross and Gordon, Cade and Carlini, Nicholas
               and Taori, Rohan and Dave, Achal and Shankar, Vaishaal and Namkoong, Hongseok and Miller, John
               and Hajishirzi, Hannaneh and Farhadi, Ali and Schmidt, Ludwig},
  publisher = {Zenodo},
  month     = jul,
  year      = {2021},
  version   = {0.1},
  doi       = {10.5281/zenodo.5143773},
  url       = {https://doi.org/10.5281/zenodo.5143773}
}
```""".splitlines()

STAGE_COLUMNS = (("name", "stage"), ("image_size", "image px"), ("patch_size", "patch"),
                 ("context_length", "text tokens"), ("samples", "samples"), ("global_batch", "batch"),
                 ("lr", "lr"), ("image_mask", "image mask"), ("text_mask", "text mask"))


def project_license() -> str:
    """The project's licence (setup.cfg's `license`, as the installed distribution's metadata records it)."""
    try:
        return metadata.metadata(DISTRIBUTION)["License"]
    except metadata.PackageNotFoundError:
        parser = configparser.ConfigParser()
        parser.read(SETUP_CFG)
        return parser["metadata"]["license"]


def public_name(location: str, run_dir: str | Path | None = None) -> str:
    """A data or tokenizer location fit for a published card: URLs and hub names as they are, a path inside
    the run folder relative to it, any other local path as its last component plus a hash of the whole path
    (the same path gives the same name, and nothing about the machine it was on is published)."""
    text = str(location)
    if "://" in text or text.startswith(("hf-hub:", "pipe:")) or not (text.startswith(("/", "~", ".")) or
                                                                        Path(text).exists()):
        return text
    path = Path(text).expanduser()
    if run_dir is not None:
        try:
            return str(PurePosixPath(path.resolve().relative_to(Path(run_dir).resolve())))
        except ValueError:
            pass
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    return f"{path.name or 'data'} (local path, sha256 {digest})"


def project_url() -> str | None:
    """The project's repository (setup.cfg's `url`, as the installed distribution's metadata records it), the
    default link of a card; None when it names none."""
    try:
        url = metadata.metadata(DISTRIBUTION)["Home-page"]
    except metadata.PackageNotFoundError:
        parser = configparser.ConfigParser()
        parser.read(SETUP_CFG)
        url = parser["metadata"].get("url") if parser.has_section("metadata") else None
    return url if url and url != "UNKNOWN" else None


def model_card(source: ExportSource, config: dict, hub_id: str | None = None, probes: list | None = None,
               repo_url: str | None = None) -> str:
    """The README.md of the export of `source` written with `config` (open_clip_config.json's content);
    `probes`: linear-probe metrics measured on this export after the run (the demo's), listed with the results;
    `repo_url`: the code repository linked (default: setup.cfg's `url`; none: no link)."""
    run = source.run_config
    vision = config["model_cfg"]["vision_cfg"]
    name = (run.get("run") or {}).get("name") or source.model_name
    repo_url = repo_url or project_url()
    run_dir = source.tag_dir.parent.parent
    front = yaml.safe_dump(card_metadata(source, name, probes or []), sort_keys=False, allow_unicode=True)
    lines = ["---", front.rstrip("\n"), "---", "",
             f"# {name}: {source.model_name} at {vision['image_size']} px",
             "",
             "A CLIP model whose image tower is CRATE-alpha (a white-box transformer), trained with crate-clip "
             "(CLIPA-style stages)" + (f" ({repo_url})" if repo_url else "") + ". " + INSTALL,
             "", "## Model", ""] + _model_lines(source, config, repo_url)
    lines += ["", "## Uses", "", "### Intended use", ""] + INTENDED_USE
    lines += ["", "### Out-of-scope use", ""] + OUT_OF_SCOPE
    lines += ["", "## Bias, risks and limitations", ""] + LIMITATIONS + _data_notes(run, run_dir)
    lines += ["", "## Training details", "", "### Training data", ""] + _data_lines(run, run_dir)
    lines += ["", "### Training procedure", ""] + _procedure_lines(source) + [""] + _stage_table(run)
    lines += ["", "## Evaluation", ""] + _result_lines(source, run, probes or [])
    lines += ["", "## Usage", ""] + _usage(hub_id, vision.get("timm_model_name"))
    lines += ["", "## Citation", "", "The architecture (CRATE-alpha), the training recipe (CLIPA) and the CLIP "
              "implementation (OpenCLIP) this model is built on:", ""] + CITATION
    return "\n".join(lines) + "\n"


def _model_lines(source: ExportSource, config: dict, repo_url: str | None) -> list[str]:
    vision, text = config["model_cfg"]["vision_cfg"], config["model_cfg"]["text_cfg"]
    record, progress, pre = source.record, source.record.progress, config["preprocess_cfg"]
    lines = [f"- open_clip config: `{source.model_name}`; image tower `{vision.get('timm_model_name', 'ViT')}` "
             f"(patch {vision.get('patch_size')} px, {vision['image_size']} px input); text context "
             f"{text['context_length']} tokens, tokenizer `{public_name(text.get('hf_tokenizer_name') or 'CLIP BPE')}`",
             f"- checkpoint `{source.tag_dir.name}`: stage {progress.stage_index} "
             f"({record.stage_name}), step {progress.step} of {record.stage_steps}, "
             f"{progress.samples_seen:,} samples seen, {record.precision} training",
             f"- preprocessing: resize ({pre['resize_mode']}, {pre['interpolation']}) and center crop to "
             f"{vision['image_size']} px, mean {_numbers(pre['mean'])}, std {_numbers(pre['std'])}"]
    if source.weights == "ema":
        ema = (source.run_config.get("train") or {}).get("ema") or {}
        lines.append(f"- weights: the exponential moving average of the trained weights over the stage (train.ema: "
                     f"decay {ema.get('decay')}, every {ema.get('every_steps')} steps from stage step "
                     f"{ema.get('start_step')}), not the trained weights themselves")
    return lines + ([f"- code: {repo_url}"] if repo_url else [])


def exported_weights_results(source: ExportSource) -> list[dict]:
    """The results.jsonl rows measured on the exported weights: the evaluations after the checkpoint's own stage
    (rows of earlier stages measured earlier weights)."""
    return [row for row in source.results if row.get("stage_index") == source.record.progress.stage_index]


def card_metadata(source: ExportSource, name: str, probes: list) -> dict:
    """The card's YAML front matter, which the Hugging Face Hub reads: licence, library, tags, the data sets by
    their Hub ids, and a model-index of the zero-shot top-1 / top-5 (and linear probes) measured on these weights."""
    run = source.run_config
    train = [r for r in (read_dataset_record(s) for s in (run.get("data") or {}).get("sources") or []) if r]
    evals = {e.get("name"): e for e in (run.get("eval") or {}).get("evals") or []}
    results = [_zeroshot_result(row, evals.get(row.get("eval")) or {}) for row in exported_weights_results(source)
               if row.get("top1") is not None and (evals.get(row.get("eval")) or {}).get("type", "zeroshot")
               == "zeroshot"]
    results += [_probe_result(m, train[0] if train else None) for m in probes if m.get("top1") is not None]
    hub_ids = list(dict.fromkeys(r.hub_id for r in train if r.hub_id))
    hub_ids += [r["dataset"]["type"] for r in results if "/" in r["dataset"]["type"]]
    meta = {"license": project_license().lower(), "library_name": "open_clip",
            "pipeline_tag": "zero-shot-image-classification",
            "tags": ["clip", "crate-alpha", "crate-clip", "zero-shot-image-classification"]}
    if hub_ids:
        meta["datasets"] = list(dict.fromkeys(hub_ids))
    if results:
        meta["metrics"] = ["accuracy"]
        meta["model-index"] = [{"name": name, "results": results}]
    return meta


def _eval_record(spec: dict) -> DatasetRecord | None:
    """What an evaluation's data is: its folder's dataset.json, else its built-in data set's name."""
    record = read_dataset_record(spec["data"]) if spec.get("data") else None
    return record or BUILTIN_EVAL_SETS.get(spec.get("dataset"))


def _subset(row: dict, spec: dict) -> str:
    """' (a subset: max_images N)' when the evaluation scored part of its data, else ''."""
    return f" (a subset: max_images {spec['max_images']})" if spec.get("max_images") else ""


def _eval_dataset(row: dict, spec: dict) -> dict:
    """model-index's `dataset` of an evaluation: the eval folder's recorded name, else the eval's own keys; a
    subset (max_images) is named as one, with its image count."""
    record = _eval_record(spec)
    if record is not None:
        dataset = {"name": record.name, "type": record.hub_id or record.name, "split": record.split or "test"}
    else:
        key = str(spec.get("dataset") or row.get("eval") or "unknown")
        dataset = {"name": key, "type": key, "split": "test"}
    if spec.get("max_images") and row.get("n_images"):
        dataset["name"] += f" ({row['n_images']:,}-image subset)"
    return dataset


def _zeroshot_result(row: dict, spec: dict) -> dict:
    how = ", grid kept, kernel PI-resized" if row.get("resize") == "patch" else ""
    count = f", {row['n_images']:,} images" if row.get("n_images") else ""
    where = f"stage {row.get('stage_index')} ({row.get('stage_name')}), {row.get('image_size')} px{how}{count}"
    metrics = [{"type": "accuracy", "value": round(100 * row["top1"], 2), "name": f"zero-shot top-1, {where}"}]
    if row.get("top5") is not None:
        metrics.append({"type": "top-5-accuracy", "value": round(100 * row["top5"], 2),
                        "name": f"zero-shot top-5, {where}"})
    return {"task": {"type": "zero-shot-image-classification", "name": "Zero-shot image classification"},
            "dataset": _eval_dataset(row, spec), "metrics": metrics}


def _probe_result(metrics: dict, train: DatasetRecord | None) -> dict:
    dataset = ({"name": train.name, "type": train.hub_id or train.name, "split": "test"} if train
               else {"name": "linear-probe data", "type": "linear-probe data", "split": "test"})
    return {"task": {"type": "image-classification", "name": "Linear probe"}, "dataset": dataset,
            "metrics": [{"type": "accuracy", "value": round(100 * metrics["top1"], 2),
                         "name": f"linear-probe top-1 ({_count(metrics.get('n_train'))} training images, "
                                 f"{_count(metrics.get('n_test'))} test images)"}]}


def _count(value) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)


def _numbers(values) -> str:
    return "(" + ", ".join(f"{float(v):.4g}" for v in values) + ")"


def _stage_table(run: dict) -> list[str]:
    stages = run.get("stages") or []
    rows = ["| # | " + " | ".join(label for _, label in STAGE_COLUMNS) + " |",
            "|---" * (len(STAGE_COLUMNS) + 1) + "|"]
    patch = None
    for i, stage in enumerate(stages):
        patch = stage.get("patch_size") or patch   # a stage keeps the patch size set before it
        values = {**stage, "patch_size": patch or "config's"}
        rows.append(f"| {i} | " + " | ".join(str(values.get(key, "")) for key, _ in STAGE_COLUMNS) + " |")
    return rows if stages else ["(the checkpoint records no stages)"]


def _source_name(source: str, run_dir: Path) -> str:
    """A data source as a card names it: the data set its folder records (dataset.json; its path then says nothing
    more), else its public path."""
    record = read_dataset_record(source)
    if record is None:
        return f"`{public_name(source, run_dir)}`"
    about = [f"{record.split} split" if record.split else "", record.url or "",
             f"Hugging Face Hub `{record.hub_id}`" if record.hub_id else ""]
    about = ", ".join(a for a in about if a)
    return f"{record.name}" + (f" ({about})" if about else "")


def _data_lines(run: dict, run_dir: Path) -> list[str]:
    data = run.get("data") or {}
    sources = ", ".join(_source_name(s, run_dir) for s in data.get("sources") or []) or "(not recorded)"
    return [f"- shards: {sources} ({data.get('mode', 'resampled')})",
            f"- random-resized crops of scale {data.get('crop_scale')}; seed {(run.get('run') or {}).get('seed')}"]


def _data_notes(run: dict, run_dir: Path) -> list[str]:
    """What the training data is, for its limitations: a known data set's description, else its name."""
    lines = []
    for source in (run.get("data") or {}).get("sources") or []:
        record = read_dataset_record(source)
        note = DATA_NOTES.get(record.hub_id) if record else None
        lines.append(f"- {note}" if note else f"- {_source_name(source, run_dir)}: what the model knows, and the "
                                               "biases it carries, are this data's.")
    return list(dict.fromkeys(lines))


def _procedure_lines(source: ExportSource) -> list[str]:
    """The recipe in numbers: stages and samples, the processes that trained it, the optimizer."""
    run, record = source.run_config, source.record
    stages = run.get("stages") or []
    total = sum(int(s.get("samples") or 0) for s in stages)
    sizes = " -> ".join(f"{s['image_size']} px" for s in stages if s.get("image_size"))
    lines = [f"- {len(stages)} stage{'s' if len(stages) > 1 else ''}{f' ({sizes})' if sizes else ''}, {total:,} "
             f"samples in all (the table); this checkpoint has seen {record.progress.samples_seen:,}"] if stages else []
    who = f"{record.world_size} training process{'es' if record.world_size > 1 else ''} under " \
        if record.world_size else ""
    lines.append(f"- compute: {who}DeepSpeed ZeRO stage {record.zero_stage}, {record.precision}")
    optimizer = run.get("optimizer") or {}
    if optimizer:
        lines.append("- optimizer: AdamW, " + ", ".join(f"{k} {v}" for k, v in optimizer.items()) +
                     "; per-stage learning rate, warm-up and weight decay below")
    return lines


def _result_lines(source: ExportSource, run: dict, probes: list) -> list[str]:
    """The evaluations of these weights (linear probes included), then those of earlier weights of the run, one
    line each in the task's own summary words, with the images each scored."""
    specs = {e.get("name"): e for e in (run.get("eval") or {}).get("evals") or []}
    mine = exported_weights_results(source)
    earlier = [row for row in source.results if row not in mine]
    lines = ["Measured on these weights (the model-index above):", ""] if mine or probes else \
        ["No evaluation of these weights was recorded."]
    lines += [_result_line(row, specs) for row in mine] + _probe_lines(probes)
    if earlier:
        lines += ([""] if mine else []) + ["Measured on earlier weights of the same run (the end of an earlier "
                                           "stage; not these weights):", ""]
        lines += [_result_line(row, specs) for row in earlier]
    return lines


def _result_line(row: dict, specs: dict) -> str:
    from crate_clip.eval.registry import summary_line

    spec = specs.get(row.get("eval")) or {}
    try:
        summary = summary_line(row, eval_type=spec.get("type", "zeroshot"))
    except (KeyError, TypeError, ValueError):
        summary = ", ".join(f"{k} {v}" for k, v in row.items() if isinstance(v, float))
    how = " (patch grid kept, kernel PI-resized)" if row.get("resize") == "patch" else ""
    record = _eval_record(spec)
    data = f" ({record.name}{f' {record.split} split' if record.split else ''})" if record else ""
    return (f"- stage {row.get('stage_index')} ({row.get('stage_name')}), `{row.get('eval')}`{data} at "
            f"{row.get('image_size')} px{how}: {summary}{_subset(row, spec)}")


def _probe_lines(probes: list) -> list[str]:
    """One line per linear probe measured on the exported weights."""
    from crate_clip.eval.tasks.linear_probe import summary

    return [f"- after the run, {summary(m)}" for m in probes]


def _usage(hub_id: str | None, tower: str | None) -> list[str]:
    """Loading the model in open_clip, and a CRATE tower alone in timm."""
    from crate_clip.models.clip_tower_names import tower_arch

    where = f"hf-hub:{hub_id}" if hub_id else "local-dir:PATH/TO/THIS/FOLDER"
    folder = ([f'folder = huggingface_hub.snapshot_download("{hub_id}")'] if hub_id
              else ['folder = "PATH/TO/THIS/FOLDER"'])
    lines = ["With crate-clip installed (above), `import crate_clip` comes first: it registers the CRATE-alpha "
             "towers with timm, without which open_clip cannot build this model.", "",
             "```python",
             "import crate_clip  # first: registers the CRATE-alpha towers with timm",
             "import open_clip",
             "",
             f'model, _, preprocess = open_clip.create_model_and_transforms("{where}")',
             f'tokenizer = open_clip.get_tokenizer("{where}")',
             "```"]
    if not tower or tower_arch(tower) is None:
        return lines
    timm_lines = ["import crate_clip, timm" + (", huggingface_hub" if hub_id else ""), "", *folder,
                  f'tower = timm.create_model("{tower}", pretrained=True,',
                  f'                          pretrained_cfg_overlay=dict(file=f"{{folder}}/{WEIGHTS_FILE}"))',
                  "transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=tower))"]
    return lines + ["", "The image tower alone, in timm, with this model's own preprocessing:", "",
                    "```python", *timm_lines, "```"]
