"""Studies: experiments that run in the notebook's own process, not in ranks. Mixed precision's
lessons (precision_lessons.py), FLOPs counted by PyTorch (flop_count.py), what a GPU adds
(gpu.py), and out of memory after hours: long sequences (long_sequences.py) against a memory
budget (memory_budget.py), graphs kept alive (leak.py), the CUDA allocator (fragmentation.py).
Two run in the ranks of a torchrun job across simulated nodes instead, each rank reading its
node's link: all-reduce algorithms (two_tier.py) and HSDP against sharding over every rank
(hsdp.py); `run_in_nodes` starts one in simulated nodes and `report` is how it ends. One kills
a node of a torchrun job mid-run and starts a replacement: the elastic restart (node_fault.py).

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


def run_in_nodes(module: str, argv: list[str], nodes: int, ranks: int, link_mbit: float,
                 timeout_s: float = 900) -> dict:
    """Run study `module` (python -m) with `argv` as a torchrun job across simulated nodes
    (distlab.caller.cluster: root only), one agent per node with `ranks` ranks, and return the
    JSON line its rank 0 reported. RuntimeError with the nodes' stderr if one failed."""
    import json
    import subprocess

    from distlab.caller.cluster import Cluster
    with Cluster(nodes, link_mbit) as cluster:
        agents = cluster.torchrun(ranks, ["-m", module, *argv], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        outs = [a.communicate(timeout=timeout_s) for a in agents]
    if any(a.returncode for a in agents):
        raise RuntimeError("a node failed:\n" + "\n".join(e[-2000:] for _, e in outs))
    return json.loads(next(line for o, _ in outs for line in o.splitlines()
                           if line.startswith("{")))
