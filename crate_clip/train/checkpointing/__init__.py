"""What a run saves and resumes from: DeepSpeed checkpoints with per-rank client state, a resume at another world
size or ZeRO stage, and what a resume changed of the run config.

checkpoints.py     atomic, durable, resumable DeepSpeed checkpoints with per-rank client state and file checksums;
                   retention; the records they carry (Progress, CheckpointInfo, ResumePoint); the layout and
                   consolidation live in crate_clip/checkpoint_io, shared with eval/; a resume verifies its
                   checkpoint and takes the newest intact one, naming the damaged
elastic_resume.py  resume at another world size or ZeRO stage (DeepSpeed's universal checkpoint, the
                   stream-state table), --resume auto
config_changes.py  a resume's run config against the recorded one, key by key: what may change, what is recorded
"""
