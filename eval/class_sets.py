"""Built-in class names and prompt templates (ImageNet-1K from open_clip, Fashion-MNIST from crate_clip.class_names)."""
from pathlib import Path

from open_clip import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES, SIMPLE_IMAGENET_TEMPLATES

from crate_clip.class_names import FASHION_MNIST_CLASSNAMES

FASHION_MNIST_TEMPLATES = (
    "a photo of a {}.",
    "a black and white photo of a {}.",
    "a low resolution photo of a {}.",
    "a photo of the {}, a type of clothing.",
    "a product photo of a {}.",
)
BUILTIN_CLASSNAMES = {"imagenet1k": tuple(IMAGENET_CLASSNAMES), "fashion_mnist": FASHION_MNIST_CLASSNAMES}
BUILTIN_TEMPLATES = {
    "openai": tuple(OPENAI_IMAGENET_TEMPLATES),   # callables: lambda c: f"... {c}."
    "simple": tuple(SIMPLE_IMAGENET_TEMPLATES),
    "fashion_mnist": FASHION_MNIST_TEMPLATES,
    "plain": ("a photo of a {}.",),
}
DEFAULT_TEMPLATES = {"imagenet1k": "openai", "fashion_mnist": "fashion_mnist"}
CLASSNAMES_FILE = "classnames.txt"


def read_lines(path: str | Path) -> list[str]:
    """Non-empty stripped lines of a text file."""
    return [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def resolve_classnames(dataset: str, data: str | Path | None = None, classnames_file: str | Path | None = None) -> list[str]:
    """Class names in label order: an explicit file, a built-in set, or `classnames.txt` beside the data."""
    if classnames_file:
        return read_lines(classnames_file)
    if dataset in BUILTIN_CLASSNAMES:
        return list(BUILTIN_CLASSNAMES[dataset])
    candidates = []
    if data is not None:
        root = Path(str(data).split("{")[0])
        root = root if root.is_dir() else root.parent
        candidates = [root / CLASSNAMES_FILE, root.parent / CLASSNAMES_FILE]
    for path in candidates:
        if path.is_file():
            return read_lines(path)
    raise FileNotFoundError(
        f"no class names for dataset {dataset!r}: pass a class-names file (one name per line, in label order) "
        f"or put {CLASSNAMES_FILE} beside the data (looked at {[str(p) for p in candidates]})")


def resolve_templates(templates: str | None, dataset: str) -> list:
    """Prompt templates by built-in name ('openai', 'simple', ...) or from a file of '{}' lines."""
    name = templates or DEFAULT_TEMPLATES.get(dataset, "simple")
    if name in BUILTIN_TEMPLATES:
        return list(BUILTIN_TEMPLATES[name])
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"templates must be one of {sorted(BUILTIN_TEMPLATES)} or a file with one '{{}}' "
                         f"template per line; {name!r} is neither")
    lines = read_lines(path)
    bad = [t for t in lines if "{}" not in t]
    if bad or not lines:
        raise ValueError(f"{path}: every template line needs a '{{}}' for the class name; bad lines: {bad[:3]}")
    return lines


def template_text(template, classname: str) -> str:
    """Apply one template (a '{}' format string or open_clip's callable) to a class name."""
    return template.format(classname) if isinstance(template, str) else template(classname)
