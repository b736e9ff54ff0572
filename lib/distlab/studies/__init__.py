"""Studies: experiments that run in the notebook's own process, not in ranks. Mixed precision's
lessons (precision_lessons.py), FLOPs counted by PyTorch (flop_count.py), what a GPU adds
(gpu.py), and out of memory after hours: long sequences (long_sequences.py) against a memory
budget (memory_budget.py), graphs kept alive (leak.py), the CUDA allocator (fragmentation.py).
Two run in the ranks of a torchrun job across simulated nodes instead, each rank reading its
node's link: all-reduce algorithms (two_tier.py) and HSDP against sharding over every rank
(hsdp.py); `report` is how they end.

May import: everything but the workbook layer (lab/); nothing below imports them.
"""


def report(result: dict) -> None:
    """End a study run by torchrun: rank 0 prints `result` as one JSON line (what the benchmark
    that started the job reads), then every rank leaves the process group."""
    import json

    import torch.distributed as dist
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
