"""Pipeline schedules (naive, GPipe, 1F1B, interleaved) written here (pp.py), beside
torch.distributed.pipelining (pp_torch.py)."""
