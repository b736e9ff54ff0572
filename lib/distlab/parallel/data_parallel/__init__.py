"""Data parallelism: DP in threads (dp.py), parameter servers (ps.py), all-reduce DP
(allreduce.py) and DDP written here (ddp.py) beside torch's (ddp_torch.py), SyncBatchNorm
(syncbn.py), top-k gradient compression (compression.py)."""
