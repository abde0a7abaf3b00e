"""The files of an export, an open_clip model folder (`local-dir:FOLDER`, the hf-hub: layout), named once here
for its writer (crate_clip/export), its readers (export_loading.py, crate_clip.eval) and the tokenizer lookup.
Imports nothing, so any module of the package may use the names."""

LOCAL_DIR = "local-dir:"                          # open_clip's prefix of a model folder
CONFIG_FILE = "open_clip_config.json"             # model_cfg, preprocess_cfg, tokenizer record, file checksums
WEIGHTS_FILE = "open_clip_model.safetensors"      # what an export writes (open_clip's hf-hub: loader looks first)
WEIGHTS_FILES = (WEIGHTS_FILE, "open_clip_pytorch_model.bin")   # what open_clip reads, in its order
CARD_FILE = "README.md"                           # the model card of an export of a training checkpoint
