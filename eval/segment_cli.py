"""`crate-clip segment ...`: zero-shot MaskCut segmentation (see crate_clip.eval.whitebox_cli)."""
from crate_clip.eval.whitebox_cli import segment_entry as main  # noqa: F401
