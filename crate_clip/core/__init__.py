"""The bottom layer: what every other package of crate_clip may import, and which imports none of them
(tests/test_architecture_imports.py).

errors.py         the user-facing errors, their exit codes and the one-line report (docs/exit_codes.md)
config_schema.py  the pydantic base of every config section and its one-line error messages
shard_sources.py  shard source strings (local globs, brace ranges, https:// gs:// hf:// and pipe:) counted, expanded
read_bounds.py    what the shard readers read at most (a member, a caption, a sample, a shuffle buffer, a source)
tar_members.py    a tar's members, each size known from its header before a byte of it is read
tar_samples.py    members grouped into samples within a per-sample budget: the shard reader of training and evaluation
class_names.py    the built-in class names and prompt templates (Fashion-MNIST; ImageNet from open_clip)
image_normalization.py  the image mean and std (OpenAI's, ImageNet's) of the towers, the stream and the evaluations
resize_modes.py   the names of the ways a model runs at another image size (grid, patch)
progress_lines.py a long step's console progress: a bar on a terminal, plain lines with totals elsewhere
"""
