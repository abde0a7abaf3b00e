"""Planning a run before it starts, without torch: what fits in memory, the micro-batch, FLOP and token counts,
wall time and GPU-hours of each stage (`crate-clip plan`, the trainer's micro-batch choice).

plan_inputs.py   the planner's command-line inputs: known GPUs, the assumed efficiency (HFU or MFU), byte sizes
planner.py       memory fit, micro-batch, FLOP and token counts, wall time and GPU-hours of a stage
"""
