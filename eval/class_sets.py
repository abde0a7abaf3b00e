"""Built-in class names and prompt templates (ImageNet-1K from open_clip, Fashion-MNIST from crate_clip.core.class_names)
and where a data set's own ones are found. No torch at import: the zero-shot settings' help names these sets, and
open_clip's lists are imported on first use."""
from functools import cache
from pathlib import Path

from crate_clip.checkpoint_io.bounded_reads import read_small_bytes
from crate_clip.core.class_names import FASHION_MNIST_CLASSNAMES, FASHION_MNIST_TEMPLATES
from crate_clip.eval.class_folders import name_key

BUILTIN_DATASETS = ("imagenet1k", "fashion_mnist")   # the built-in class sets (their names: builtin_classnames)
MAX_LIST_BYTES = 16 << 20   # a class-name or template list: ImageNet-21k's 21,843 names are ~1 MB
TEMPLATE_SETS = ("openai", "simple", "fashion_mnist", "plain")   # the built-in template sets
DEFAULT_TEMPLATES = {"imagenet1k": "openai", "fashion_mnist": "fashion_mnist"}
DEFAULT_DATASET = "imagenet1k"   # the data set when neither a name nor the data's own classnames.txt says
CLASSNAMES_FILE = "classnames.txt"
TEMPLATES_FILE = "zeroshot_classification_templates.txt"   # CLIP_benchmark's name; `{c}` for the class


@cache
def _builtin_sets() -> tuple[dict, dict]:
    # open_clip (and with it torch) only when a built-in set is used
    from open_clip import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES, SIMPLE_IMAGENET_TEMPLATES

    classnames = {"imagenet1k": tuple(IMAGENET_CLASSNAMES), "fashion_mnist": FASHION_MNIST_CLASSNAMES}
    templates = {
        "openai": tuple(OPENAI_IMAGENET_TEMPLATES),   # callables: lambda c: f"... {c}."
        "simple": tuple(SIMPLE_IMAGENET_TEMPLATES),
        "fashion_mnist": FASHION_MNIST_TEMPLATES,
        "plain": ("a photo of a {}.",),
    }
    # the names above are what the settings' help lists without importing open_clip: they must agree
    assert tuple(classnames) == BUILTIN_DATASETS and tuple(templates) == TEMPLATE_SETS
    return classnames, templates


def builtin_classnames(dataset: str) -> tuple:
    """The class names of a built-in set (one of BUILTIN_DATASETS), in label order."""
    return _builtin_sets()[0][dataset]


def builtin_templates(name: str) -> tuple:
    """The prompt templates of a built-in set (one of TEMPLATE_SETS): '{}' strings or open_clip's callables."""
    return _builtin_sets()[1][name]


def read_lines(path: str | Path) -> list[str]:
    """Non-empty stripped lines of a text file, read only as a regular file of at most MAX_LIST_BYTES (an evaluation
    set from elsewhere brings its classnames.txt and templates)."""
    text = read_small_bytes(path, MAX_LIST_BYTES).decode("utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def _beside(data: str | Path | None, name: str) -> list[Path]:
    """Where a data set's own `name` file may be: in the data folder (or a pattern's folder) or its parent."""
    if data is None:
        return []
    root = Path(str(data).split("{")[0])
    root = root if root.is_dir() else root.parent
    return [root / name, root.parent / name]


def own_classnames_file(data: str | Path | None) -> Path | None:
    """The data set's own class-names file (CLIP_benchmark's classnames.txt in or beside the data), if any."""
    return next((p for p in _beside(data, CLASSNAMES_FILE) if p.is_file()), None)


def dataset_name(dataset: str | None, data: str | Path | None) -> str:
    """The data set meant: the name given, else 'custom' when the data has its own class names (they win over
    the default), else DEFAULT_DATASET."""
    if dataset:
        return dataset
    return "custom" if own_classnames_file(data) else DEFAULT_DATASET


def _names_shown(names: list[str]) -> str:
    return f"{len(names)} classes: " + ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")


def check_same_classes(chosen: list[str], chosen_from: str, own: list[str], own_from: str) -> None:
    """ValueError naming both class sets when they differ in count or in any name (label order counts):
    a zero-shot or probe number against the wrong class set would be silently wrong."""
    if len(chosen) == len(own) and all(name_key(a) == name_key(b) for a, b in zip(chosen, own)):
        return
    raise ValueError(f"{chosen_from} ({_names_shown(chosen)}) disagrees with {own_from} ({_names_shown(own)}); "
                     f"fix: leave out the dataset/classnames option to use the data's own class names, or "
                     f"point the data at the set those classes belong to")


def resolve_classnames(dataset: str | None, data: str | Path | None = None,
                       classnames_file: str | Path | None = None) -> list[str]:
    """Class names in label order: an explicit file or a built-in set (refused when the data's own
    classnames.txt disagrees), else the data's own classnames.txt, else the default data set's."""
    own_file = own_classnames_file(data)
    if classnames_file:
        chosen, chosen_from = read_lines(classnames_file), f"classnames file {str(classnames_file)!r}"
    elif dataset in BUILTIN_DATASETS:
        chosen, chosen_from = list(builtin_classnames(dataset)), f"dataset {dataset!r}"
    elif own_file:
        return read_lines(own_file)
    elif not dataset:
        return list(builtin_classnames(DEFAULT_DATASET))
    else:
        raise FileNotFoundError(
            f"no class names for dataset {dataset!r}: pass a class-names file (one name per line, in label order) "
            f"or put {CLASSNAMES_FILE} beside the data (looked at {[str(p) for p in _beside(data, CLASSNAMES_FILE)]})")
    if own_file:
        check_same_classes(chosen, chosen_from, read_lines(own_file), f"the data's own {own_file}")
    return chosen


def resolve_templates(templates: str | None, dataset: str, data: str | Path | None = None) -> list:
    """Prompt templates by built-in name ('openai', 'simple', ...) or from a file of '{}' (or CLIP_benchmark's
    '{c}') lines; by default the data set's own zeroshot_classification_templates.txt beside the data, else the
    dataset's built-in ones."""
    if templates is None:
        own = next((p for p in _beside(data, TEMPLATES_FILE) if p.is_file()), None)
        templates = str(own) if own else DEFAULT_TEMPLATES.get(dataset, "simple")
    if templates in TEMPLATE_SETS:
        return list(builtin_templates(templates))
    path = Path(templates)
    if not path.is_file():
        raise ValueError(f"templates must be one of {sorted(TEMPLATE_SETS)} or a file with one '{{}}' "
                         f"template per line; {templates!r} is neither")
    lines = read_lines(path)
    bad = [t for t in lines if "{}" not in t and "{c}" not in t]
    if bad or not lines:
        raise ValueError(f"{path}: every template line needs a '{{}}' (or '{{c}}') for the class name; bad lines: "
                         f"{bad[:3]}")
    return lines


def template_text(template, classname: str) -> str:
    """Apply one template (a '{}' or '{c}' format string, or open_clip's callable) to a class name."""
    return template.format(classname, c=classname) if isinstance(template, str) else template(classname)
