"""CLIPA-style multi-stage training under DeepSpeed ZeRO.

run_config.py   typed run config (YAML), `--set` overrides, validation naming key + fix
optim.py        AdamW parameter groups (no decay: norms, biases, embeddings, D/D1, logit scale), warm-up + cosine
engine.py       process group, the DeepSpeed JSON derived from the run config, deepspeed.initialize
stage_loop.py   the run: stages, steps (ClipLoss, non-finite guard), checkpoints, eval after each stage, export
checkpoints.py  atomic, resumable DeepSpeed checkpoints with per-rank client state; retention
export.py       open_clip `local-dir:` export (safetensors + open_clip_config.json)
metrics_log.py  progress bar, TensorBoard, metrics.jsonl / results.jsonl, the PNG curve
cli.py          `crate-clip train`;  demo.py: the README's first command
"""
