"""Megatron tensor and sequence parallelism written here, one concept a file (operators.py,
layers.py, styles.py, plans.py, parallelize.py; the `tp` strategy in tp.py, which re-exports
them all), beside DTensor's (tp_torch.py)."""
