"""`crate-clip inspect maps ...`: attention and PCA maps of an image tower (see eval.whitebox_cli)."""
from eval.whitebox_cli import inspect_entry as main  # noqa: F401
