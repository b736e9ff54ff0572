"""Hierarchical all-reduce (distlab.parallel.data_parallel.hierarchical) equals the sum, and
only its middle step (the one that would cross the slow link between nodes) moves bytes
across nodes: 2(n-1)/n x S/g per rank, against the flat ring's 2(N-1)/N x S. Four ranks as
2 nodes x 2 on this machine's loopback (tests/test_cluster.py has the real two-tier link)."""

import torch

from distlab import run_ranks
from distlab.parallel.data_parallel.hierarchical import (hierarchical_all_reduce,
                                                        leader_all_reduce, node_groups)


def reduce_both_ways(rank, world, device, log, numel):
    intra, inter = node_groups(2)
    t = torch.arange(numel, dtype=torch.float64) * (rank + 1)
    hierarchical_all_reduce(t, intra, inter)
    lead_intra, lead_inter = node_groups(2)
    led = torch.arange(numel, dtype=torch.float64) * (rank + 1)
    leader_all_reduce(led, lead_intra, lead_inter)
    return {"t": t, "inter": inter.snapshot(), "intra": intra.snapshot(),
            "groups": (intra.world, inter.world), "led": led,
            "led inter": lead_inter.snapshot()}


def test_the_sum_and_the_bytes_across_nodes():
    for numel in (1000, 1001):  # a length the node's 2 ranks do not divide: padded
        out = run_ranks(reduce_both_ways, 4, numel, timeout_s=60)
        want = torch.arange(numel, dtype=torch.float64) * (1 + 2 + 3 + 4)
        for r in out:
            assert r["groups"] == (2, 2)
            assert torch.equal(r["t"], want), numel  # small integers: exact in float64
            assert torch.equal(r["led"], want), numel  # the one-flow variant too
            S = 8 * (-(-numel // 2) * 2)  # padded bytes
            # the ring of 2 nodes on this rank's block S/2: 2(n-1)/n x S/2 = S/2 sent
            assert r["inter"]["all_reduce.ring"]["bytes_sent"] == S / 2
            # inside the node: reduce-scatter and all-gather, (g-1)/g x S each
            assert r["intra"]["reduce_scatter"]["bytes_sent"] == S / 2
            assert r["intra"]["all_gather"]["bytes_sent"] == S / 2
        # one flow: only the nodes' local ranks 0 cross, each with the whole tensor (S)
        crossed = [r["led inter"].get("all_reduce.ring", {}).get("bytes_sent", 0) for r in out]
        assert crossed == [8 * numel, 0, 8 * numel, 0], crossed


def two_tier_measure(rank, world, device, log):
    import os

    from distlab.studies.two_tier import measure
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # as torchrun sets it: 2 nodes of 2
    return measure(0.25, 1)


def test_the_two_tier_study_times_every_algorithm_and_reads_the_link():
    """benchmarks/two_tier.py's rank side, on loopback: each algorithm timed, the interface's
    counter read (here lo: it carries every rank's bytes, so at least the flat ring's)."""
    res = run_ranks(two_tier_measure, 4, timeout_s=60)[0]
    S = 0.25 * 2**20
    for name in ("flat ring", "hierarchical", "hierarchical, one flow", "backend",
                 "within a node"):
        assert res[name]["seconds"] > 0, res
    assert res["flat ring"]["link_sent"] >= 4 * 2 * 3 / 4 * S, res  # 4 ranks' ring bytes
