"""CLIPA-style multi-stage training under DeepSpeed ZeRO.

run_config.py   typed run config (YAML), `--set` overrides, validation naming key + fix
optim.py        AdamW parameter groups (no decay: norms, biases, embeddings, D/D1, logit scale), warm-up + cosine
engine.py       process group, the DeepSpeed JSON derived from the run config, deepspeed.initialize
stage_loop.py   the run, from the entry point down: where to resume, one stage, its steps (ClipLoss,
                non-finite guard), checkpoints, export
stage_evals.py  the evaluations due after each stage (exactly the missing ones on resume)
run_dir.py      one run per output folder: refuse to mix, or move the earlier run aside (--overwrite)
checkpoints.py  atomic, durable, resumable DeepSpeed checkpoints with per-rank client state; retention
                (the layout and consolidation live in crate_clip/checkpoint_io, shared with eval/)
export.py       open_clip model folders (local-dir:, the hf-hub: layout) of weights or of any checkpoint;
                export_source.py: what a checkpoint says about its export; model_card.py: its README.md;
                export_cli.py: `crate-clip export`
metrics_log.py  progress bar, TensorBoard, metrics.jsonl / results.jsonl, the PNG curve
cli.py          `crate-clip train`;  demo.py: the README's first command
"""
