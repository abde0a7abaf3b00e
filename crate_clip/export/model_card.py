"""The model card (README.md) of an export: what the model is, how it was trained, what it scored, how to load it.

Hugging Face shows a repository's README.md as its model card and reads the YAML block at its top
(`library_name: open_clip` links open_clip's loading snippet). Everything comes from the checkpoint and
results.jsonl, nothing from the clock, so the card of one checkpoint is the same file every time.
"""
from __future__ import annotations

import configparser
import hashlib
from importlib import metadata
from pathlib import Path, PurePosixPath

import yaml

from crate_clip.core.dataset_records import BUILTIN_EVAL_SETS, DatasetRecord, read_dataset_record
from crate_clip.export.source import ExportSource

DISTRIBUTION = "crate-clip"
SETUP_CFG = Path(__file__).resolve().parents[2] / "setup.cfg"   # a source checkout that is not installed
INSTALL = ("Loading it needs the crate-clip package, which no package registry serves: install it from its "
           "source (`pip install .` in a checkout) or from a wheel built there (`pip wheel --no-deps .`, then "
           "`pip install crate_clip-*.whl`), and `import crate_clip`, which registers the CRATE-alpha towers "
           "with timm.")

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
    `repo_url`: the code repository linked (default: setup.cfg's `url`)."""
    run = source.run_config
    vision, text = config["model_cfg"]["vision_cfg"], config["model_cfg"]["text_cfg"]
    name = (run.get("run") or {}).get("name") or source.model_name
    record, progress = source.record, source.record.progress
    repo_url = repo_url or project_url()
    front = yaml.safe_dump(card_metadata(source, name, probes or []), sort_keys=False, allow_unicode=True)
    lines = ["---", front.rstrip("\n"), "---", "",
             f"# {name}: {source.model_name} at {vision['image_size']} px",
             "",
             "A CLIP model whose image tower is CRATE-alpha (a white-box transformer), trained with crate-clip "
             "(CLIPA-style stages)" + (f" ({repo_url})" if repo_url else "") + ". " + INSTALL,
             "", "## Model", "",
             f"- open_clip config: `{source.model_name}`; image tower `{vision.get('timm_model_name', 'ViT')}` "
             f"(patch {vision.get('patch_size')} px, {vision['image_size']} px input); text context "
             f"{text['context_length']} tokens, tokenizer `{public_name(text.get('hf_tokenizer_name') or 'CLIP BPE')}`",
             f"- checkpoint `{source.tag_dir.name}`: stage {progress.stage_index} "
             f"({record.stage_name}), step {progress.step} of {record.stage_steps}, "
             f"{progress.samples_seen:,} samples seen, {record.precision} training",
             f"- preprocessing: resize ({config['preprocess_cfg']['resize_mode']}, "
             f"{config['preprocess_cfg']['interpolation']}) and center crop to {vision['image_size']} px, mean "
             f"{_numbers(config['preprocess_cfg']['mean'])}, std {_numbers(config['preprocess_cfg']['std'])}",
             f"- code: {repo_url}" if repo_url else "- code: crate-clip (no repository link was configured: "
                                                    "`crate-clip export --repo-url URL`, or setup.cfg's `url`)",
             "", "## Training stages", ""]
    lines += _stage_table(run)
    lines += ["", "## Data", ""] + _data_lines(run, source.tag_dir.parent.parent)
    lines += ["", "## Results", ""] + _result_lines(source, run) + _probe_lines(probes or [])
    lines += ["", "## Usage", ""] + _usage(hub_id)
    return "\n".join(lines) + "\n"


def card_metadata(source: ExportSource, name: str, probes: list) -> dict:
    """The card's YAML front matter, which the Hugging Face Hub reads: licence, library, tags, the data sets by
    their Hub ids, and a model-index of every zero-shot top-1 (and linear probe) measured up to the checkpoint."""
    run = source.run_config
    train = [r for r in (read_dataset_record(s) for s in (run.get("data") or {}).get("sources") or []) if r]
    evals = {e.get("name"): e for e in (run.get("eval") or {}).get("evals") or []}
    results = [_zeroshot_result(row, evals.get(row.get("eval")) or {}) for row in source.results
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


def _eval_dataset(row: dict, spec: dict) -> dict:
    """model-index's `dataset` of an evaluation: the eval folder's recorded name, else the eval's own keys."""
    record = _eval_record(spec)
    if record is not None:
        return {"name": record.name, "type": record.hub_id or record.name, "split": record.split or "test"}
    key = spec.get("dataset") or row.get("eval") or "unknown"
    return {"name": str(key), "type": str(key), "split": "test"}


def _zeroshot_result(row: dict, spec: dict) -> dict:
    how = ", grid kept, kernel PI-resized" if row.get("resize") == "patch" else ""
    where = f"stage {row.get('stage_index')} ({row.get('stage_name')}), {row.get('image_size')} px{how}"
    metrics = [{"type": "accuracy", "value": round(100 * row["top1"], 2), "name": f"zero-shot top-1, {where}"}]
    if row.get("top5") is not None:
        metrics.append({"type": "accuracy", "value": round(100 * row["top5"], 2), "name": f"zero-shot top-5, {where}"})
    return {"task": {"type": "zero-shot-image-classification", "name": "Zero-shot image classification"},
            "dataset": _eval_dataset(row, spec), "metrics": metrics}


def _probe_result(metrics: dict, train: DatasetRecord | None) -> dict:
    dataset = ({"name": train.name, "type": train.hub_id or train.name, "split": "test"} if train
               else {"name": "linear-probe data", "type": "linear-probe data", "split": "test"})
    return {"task": {"type": "image-classification", "name": "Linear probe"}, "dataset": dataset,
            "metrics": [{"type": "accuracy", "value": round(100 * metrics["top1"], 2),
                         "name": f"linear-probe top-1 ({metrics.get('n_train')} training images)"}]}


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


def _result_lines(source: ExportSource, run: dict) -> list[str]:
    """One line per evaluation in results.jsonl up to the checkpoint, in the task's own summary words."""
    from crate_clip.eval.registry import summary_line

    if not source.results:
        return ["No evaluation results recorded up to this checkpoint."]
    specs = {e.get("name"): e for e in (run.get("eval") or {}).get("evals") or []}
    types = {name: spec.get("type", "zeroshot") for name, spec in specs.items()}
    lines = []
    for row in source.results:
        try:
            summary = summary_line(row, eval_type=types.get(row.get("eval"), "zeroshot"))
        except (KeyError, TypeError, ValueError):
            summary = ", ".join(f"{k} {v}" for k, v in row.items() if isinstance(v, float))
        how = " (patch grid kept, kernel PI-resized)" if row.get("resize") == "patch" else ""
        record = _eval_record(specs.get(row.get("eval")) or {})
        data = f" ({record.name}{f' {record.split} split' if record.split else ''})" if record else ""
        lines.append(f"- stage {row.get('stage_index')} ({row.get('stage_name')}), `{row.get('eval')}`{data} at "
                     f"{row.get('image_size')} px{how}: {summary}")
    return lines


def _probe_lines(probes: list) -> list[str]:
    """One line per linear probe measured on the exported weights."""
    from crate_clip.eval.tasks.linear_probe import summary

    return [f"- measured on the exported weights after the run, {summary(m)}" for m in probes]


def _usage(hub_id: str | None) -> list[str]:
    where = f"hf-hub:{hub_id}" if hub_id else "local-dir:PATH/TO/THIS/FOLDER"
    return ["With crate-clip installed (above), `import crate_clip` comes first: it registers the CRATE-alpha "
            "towers with timm, without which open_clip cannot build this model.", "",
            "```python",
            "import crate_clip  # first: registers the CRATE-alpha towers with timm",
            "import open_clip",
            "",
            f'model, _, preprocess = open_clip.create_model_and_transforms("{where}")',
            f'tokenizer = open_clip.get_tokenizer("{where}")',
            "```"]
