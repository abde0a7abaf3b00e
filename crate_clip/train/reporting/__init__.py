"""What a run reports while it trains: the progress bar, the step meter, trackers, metrics.jsonl / results.jsonl,
the PNG curve, white-box diagnostics, DeepSpeed's own output (imports crate_clip.train.planning only).

progress_display.py  the progress bar of a stage
trackers.py          TensorBoard, csv and Weights & Biases trackers (logging.report_to)
whitebox_log.py      white-box diagnostics of the image tower during training
training_curve.py    the PNG training curve
throughput.py        the step meter: samples/s, tokens/s, TFLOP/s and MFU, data wait
metrics_log.py       progress bar, trackers, metrics.jsonl / results.jsonl, the PNG curve, behind one MetricsLog
deepspeed_output.py  DeepSpeed's prints and per-rank logs kept out of the console
"""
