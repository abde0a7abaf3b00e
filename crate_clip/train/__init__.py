"""CLIPA-style multi-stage training under DeepSpeed ZeRO.

Modules from the bottom up (each imports only those above it in this list):
run_config.py    typed run config (YAML), `--set` overrides, validation naming key + fix
optim.py         AdamW parameter groups (no decay: norms, biases, embeddings, D/D1, logit scale), warm-up + cosine
process_info.py  what /proc says of a process (parent, start time, zombie): a live process from a gone one
launcher_watch.py  a process whose launcher (torchrun, deepspeed, accelerate launch) is killed stops
engine.py        process group, the DeepSpeed JSON derived from the run config, deepspeed.initialize
text_lock.py     a locked text tower (and logit scale): parameters as replicated fp32 buffers
disk_space.py    a full disk said in one line (what to free, the last complete checkpoint); the check before a resume
checkpoints.py   atomic, durable, resumable DeepSpeed checkpoints with per-rank client state and file checksums;
                 retention; the records they carry (Progress, CheckpointInfo, ResumePoint); the layout and
                 consolidation live in crate_clip/checkpoint_io, shared with eval/; a resume verifies its
                 checkpoint and takes the newest intact one, naming the damaged
plan_inputs.py   the planner's command-line inputs: known GPUs, default MFU, byte sizes (no torch)
planner.py       memory fit, micro-batch, FLOP and token counts, wall time and GPU-hours of a stage
stage_model.py   ResolvedStage: a stage resolved once from the run config and the launch; the one model builder
throughput.py    the step meter: samples/s, tokens/s, TFLOP/s and MFU, data wait
whitebox_log.py  white-box diagnostics of the image tower during training
metrics_log.py   progress bar, TensorBoard, metrics.jsonl / results.jsonl, the PNG curve
stage_evals.py   the evaluations due after each stage (exactly the missing ones on resume)
run_dir.py       one run per output folder: refuse to mix, or move the earlier run aside (--overwrite)
run_lock.py      one writer per run folder: the lock rank 0 holds for the run's life
elastic_resume.py  resume at another world size or ZeRO stage (DeepSpeed's universal checkpoint, the
                 stream-state table), --resume auto
train_step.py    one optimizer step: forward, contrastive loss, backward (k micro-batches, exact gradients)
batch_agreement.py  batches fetched in agreement: a data error on one rank stops every rank with its message
stage_loop.py    the run, from the entry point down: where to resume, one stage, its steps, checkpoints, export
                 (crate_clip/export); the stage functions share one RunContext (config, processes, checkpoints, log)
cli.py           `crate-clip train`;  plan_cli.py: `crate-clip plan`;
                 demo.py: the README's first command
"""
