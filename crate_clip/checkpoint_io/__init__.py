"""Checkpoint and file I/O at the bottom of the stack: train/, eval/ and data_pipelines/ import it, it imports
none of them (tests/test_architecture_imports.py).

run_layout.py             the run folder's layout: checkpoints/, latest, metrics, results, exports, the lock
atomic_files.py           write-then-rename for files and folders, fsync of files and their folders
deepspeed_checkpoints.py  the layout of a DeepSpeed checkpoint (tag folders, `latest`, crate_clip.json) and
                          its consolidation to one fp32 state dict, for any ZeRO stage
safe_unpickling.py        torch files read with weights_only=True and the allow-list of DeepSpeed's classes;
                          the one-line refusal and the --trust-checkpoint opt-in
trust_flag.py             that opt-in's flag, help and warning (no torch: the command parsers take them)
deepspeed_objects.py      the allow-listed DeepSpeed objects rebuilt from validated fields (no other state)
bounded_reads.py          record files (crate_clip.json, latest, configs) read only as small regular files
manifest_schema.py        what a well-formed crate_clip.json and file_checksums record hold
file_checksums.py         size and sha256 of written files, recorded by their writer, verified by readers
checkpoint_manifest.py    those records for every file of a checkpoint, the hashing shared by the ranks
write_failures.py         a save's failed writes (a full disk) recorded, so that all ranks stop together
"""
