"""The training loop: one optimizer step, batches fetched in agreement, stop requests, the evaluations due after a
stage, and the run from the entry point down (stage_loop).

train_step.py       one optimizer step: forward, contrastive loss, backward (k micro-batches, exact gradients)
stop_requests.py    a preemption signal (or a data source given up on) stops the run at a step boundary, saved
stop_sharing.py     a stop passed on at once to the rank's DataLoader workers and (the job's store) to the other ranks
batch_agreement.py  batches fetched in agreement: a data error on one rank stops every rank with its message
stage_evals.py      the evaluations due after each stage (exactly the missing ones on resume)
stage_loop.py       the run, from the entry point down: where to resume, one stage, its steps, checkpoints, export
                    (crate_clip/export); the stage functions share one RunContext (config, processes, checkpoints, log)
"""
