"""The run: its config, its output folder and the lock on it, the disk it writes to, and the processes that run it
(imports none of train's other subpackages).

run_dir.py        one run per output folder: refuse to mix, or move the earlier run aside (--overwrite)
run_config.py     typed run config (YAML), `--set` overrides, validation naming key + fix
launch_checks.py  the checks before any worker starts: keys, batches against processes, the output folder, data
process_info.py   what /proc says of a process (parent, start time, zombie): a live process from a gone one
run_lock.py       one writer per run folder: the lock rank 0 holds for the run's life
launcher_watch.py a process whose launcher (torchrun, deepspeed, accelerate launch) is killed stops
disk_space.py     a full disk said in one line (what to free, the last complete checkpoint); the check before a resume
"""
