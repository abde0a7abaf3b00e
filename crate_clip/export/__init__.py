"""Export: a training checkpoint (or any weights) as an open_clip model folder (`local-dir:`, the hf-hub: layout).
It sits below crate_clip.train (the trainer's final export is `crate-clip export` of the last checkpoint) and
above models, data and eval, whose defaults and result summaries it records.

Modules from the bottom up (each imports only those above it in this list):
source.py      what a training checkpoint says about its export (sizes, tokenizer, normalisation, stages, results)
model_card.py  the export's README.md (Hugging Face model card)
writer.py      open_clip model folders of weights or of any checkpoint, written atomically, and their check
cli.py         `crate-clip export`
"""
