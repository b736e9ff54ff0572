"""The rank's side: what each rank process runs. train.py is the one training loop;
build.py builds the model and the optimizer it steps; precision.py (autocast, loss scaling,
fp32 islands), recompute.py (activation checkpointing), step_meter.py (what a step measured)
and faults.py (failures, stragglers and delays on purpose) plug into it. The same loop runs
under launch() and under torchrun.

May import: the foundation, data/, models/, parallel/, config, checkpoint/, debug/ and
finetune/. Never the caller's side, the studies or the workbook layer.
"""
