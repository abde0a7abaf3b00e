"""`crate-clip inspect maps|text ...`: image-tower attention and PCA maps, or a caption through a CRATE-alpha text
tower (see crate_clip.eval.whitebox_cli)."""
from crate_clip.eval.whitebox_cli import inspect_entry as main  # noqa: F401
