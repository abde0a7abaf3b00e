"""What one stage trains: the stage resolved from the run config and the launch, its model (the locked text tower
included), the AdamW groups and schedule, the process group and the DeepSpeed engine.

optim.py        AdamW parameter groups (no decay: norms, biases, embeddings, D/D1, logit scale), warm-up + cosine
engine.py       process group, the DeepSpeed JSON derived from the run config, deepspeed.initialize
text_lock.py    a locked text tower (and logit scale): parameters as replicated fp32 buffers
stage_model.py  ResolvedStage: a stage resolved once from the run config and the launch; the one model builder
"""
