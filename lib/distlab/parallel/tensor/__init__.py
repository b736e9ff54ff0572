"""Megatron tensor and sequence parallelism written here (tp.py), beside DTensor's (tp_torch.py)."""
