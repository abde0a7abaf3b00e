"""`crate-clip segment ...`: zero-shot MaskCut segmentation (see eval.whitebox_cli)."""
from eval.whitebox_cli import segment_entry as main  # noqa: F401
