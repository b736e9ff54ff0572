"""ZeRO-1/2/3 and FSDP: the strategies (stages.py) on ZeroOptimizer's flat padded units
(optimizer.py) and fully_shard (fsdp.py), beside torch's ZeroRedundancyOptimizer and FSDP2
(zero_torch.py). fully_shard's per-parameter layout (per_param.py) registers itself here."""

from distlab.parallel.zero import per_param  # noqa: F401 (fully_shard's layout="per_param")
