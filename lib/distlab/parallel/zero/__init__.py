"""ZeRO-1/2/3 and FSDP: the strategies (stages.py) on ZeroOptimizer's flat padded units
(optimizer.py) and fully_shard (fsdp.py), beside torch's ZeroRedundancyOptimizer and FSDP2
(zero_torch.py)."""
