"""Checkpoint and file I/O at the bottom of the stack: train/, eval/ and data_pipelines/ import it, it imports
none of them (tests/test_architecture_imports.py).

run_layout.py             the run folder's layout: every folder and file a run writes, the lock
checkpoint_record.py      crate_clip.json (CheckpointInfo, Progress, its schema; read as CheckpointInfo), complete checkpoints
                          listed by step, and which checkpoint a user means (latest, a tag, a stage's final, a path)
atomic_files.py           write-then-rename for files and folders, fsync of files and their folders
deepspeed_checkpoints.py  a DeepSpeed checkpoint's files verified against its record, and
                          their consolidation to one fp32 state dict, for any ZeRO stage
ema_state.py              the EMA weights (train.ema) in a checkpoint's rank 0 file, merged into its consolidated weights
safe_unpickling.py        torch files read with weights_only=True and the allow-list of DeepSpeed's classes;
                          the one-line refusal and the --trust-checkpoint opt-in
trust_flag.py             that opt-in's flag, help and warning (no torch: the command parsers take them)
deepspeed_objects.py      the allow-listed DeepSpeed objects rebuilt from validated fields (no other state)
deepspeed_notices.py      DeepSpeed's import notice ("Setting accelerator to CPU") kept off a reader's console
bounded_reads.py          record files (crate_clip.json, latest, configs) read only as small regular files
weights_headers.py        what a weights file holds, from its safetensors header or zip directory held to its size
manifest_schema.py        what a well-formed file_checksums record holds, JSON type checks
file_checksums.py         size and sha256 of written files, recorded by their writer, verified by readers
checkpoint_manifest.py    those records for every file of a checkpoint, the hashing shared by the ranks
write_failures.py         a save's failed writes (a full disk) recorded, so that all ranks stop together
"""
