"""HSDP: shard inside a node, replicate across nodes (distlab.fully_shard + replicate_gradients,
and FSDP2 on a 2-D mesh as RunConfig(strategy="fsdp-torch", shard_ranks=g)). Four ranks as 2
nodes x 2 on this machine's loopback; benchmarks/hsdp_link.py measures the real link.

Checked against a single process training the same global batches with SGD (rank 0 trains it
in the same launch): every way computes the same update, so parameters agree up to float32
summation order. SGD at lr 0.1 does not amplify rounding (tests/test_equivalence.py's
argument): atol 1e-5, while a shard averaged over the wrong ranks moves parameters by ~1e-2.
"""

import os

import pytest
import torch

from distlab import RunConfig, run_ranks
from distlab.comm import ring_allreduce_bytes
from distlab.models import GPT, GPTConfig
from distlab.parallel.zero.zero_torch import fsdp2_shard_bytes
from distlab.rank.train import train_with_state
from distlab.theory.comm_bytes import hsdp_link_bytes

ATOL = 1e-5
STEPS = 4
CFG = RunConfig(optimizer="sgd", lr=0.1, global_batch=8, seq_len=16, n_layer=2, n_embd=32,
                n_head=2, mlp_ratio=4)


def every_way_and_one_process(rank, world, device, log):
    from distlab.data.dataset import make_data
    from distlab.studies.hsdp import WAYS, build, measure
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # as torchrun sets it: 2 nodes of 2
    data = make_data(CFG)
    out = {}
    for name in WAYS:
        way = build(name, CFG, 2)
        for step in range(STEPS):
            way.step(*data.rank_batch(step, CFG.global_batch, rank, world))
        out[name] = {"state": way.full_state(), "shard_bytes": way.shard_bytes,
                     "across": None if way.across is None else way.across.snapshot()}
    # benchmarks/hsdp_link.py's rank side, on loopback (lo carries every rank's bytes)
    out["measured"] = {name: measure(name, CFG, 3, 1) for name in WAYS if "HSDP" in name}
    # the training loop's HSDP: RunConfig(strategy="fsdp-torch", shard_ranks=2)
    loop = CFG.replace(strategy="fsdp-torch", world_size=4, shard_ranks=2, steps=STEPS)
    out["fsdp-torch, shard_ranks=2"] = train_with_state(rank, world, device, log,
                                                        [loop.to_dict()])[0]
    if rank == 0:  # the reference: one process, the whole global batch
        torch.manual_seed(CFG.seed)
        model = GPT(GPTConfig.from_run(CFG))
        opt = torch.optim.SGD(model.parameters(), lr=CFG.lr)
        for step in range(STEPS):
            model(*data.rank_batch(step, CFG.global_batch, 0, 1)).backward()
            opt.step()
            opt.zero_grad()
        out["single"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(every_way_and_one_process, 4, timeout_s=120)


def test_every_way_matches_one_process(ranks):
    single = ranks[0]["single"]
    for r, out in enumerate(ranks):
        for name, res in out.items():
            if name in ("single", "measured"):
                continue  # the training loop's fsdp-torch with shard_ranks is among the others
            worst = max((res["state"][k] - v).abs().max().item() for k, v in single.items())
            print(f"rank {r} {name}: worst parameter diff vs one process {worst:.1e}")
            assert worst <= ATOL, (r, name)


def test_only_the_shards_all_reduce_crosses_nodes_and_it_is_the_formula(ranks):
    shapes = [tuple(p.shape) for p in GPT(GPTConfig.from_run(CFG)).parameters()]
    for out in ranks:
        ours = out["ours, HSDP"]
        # one all-reduce per unit across the 2 nodes, each of the unit's padded shard
        across = ours["across"]
        assert set(across) == {"all_reduce"}, across
        assert across["all_reduce"]["bytes_sent"] == pytest.approx(
            STEPS * ring_allreduce_bytes(ours["shard_bytes"], 2))
        # FSDP2 pads each parameter on dim 0 to a multiple of the 2 shard ranks
        assert out["FSDP2, HSDP"]["shard_bytes"] == fsdp2_shard_bytes(shapes, 2)
    # a node's 2 ranks send their shards once each: the whole gradient (every dim 0 of this
    # model is even, so nothing is padded)
    grads = 4 * sum(torch.Size(s).numel() for s in shapes)
    assert hsdp_link_bytes(ranks[0]["FSDP2, HSDP"]["shard_bytes"], 2, 2) == grads
    assert hsdp_link_bytes(ranks[0]["ours, HSDP"]["shard_bytes"], 2, 2) == grads


def test_the_link_study_times_each_way_and_reads_the_counter(ranks):
    """distlab.studies.hsdp's measure: on lo every rank's bytes pass the one counter, so each
    HSDP way's payload per step is at least its own shards' all-reduce (the formula)."""
    measured = ranks[0]["measured"]
    for name, r in measured.items():
        assert r["seconds"] > 0 and len(r["losses"]) == 3, name
        assert r["payload"] <= r["frames"], name  # headers come off
        assert r["payload"] >= r["formula"], (name, r)
    # the same SGD steps whichever way: the losses agree
    first = measured["ours, HSDP"]["losses"]
    for r in measured.values():
        assert r["losses"] == pytest.approx(first, abs=1e-5)


def test_bad_shard_ranks_are_refused_before_anything_starts():
    hsdp = CFG.replace(strategy="fsdp-torch", world_size=4, shard_ranks=2)
    with pytest.raises(ValueError, match="shard_ranks"):
        hsdp.replace(shard_ranks=3)
    with pytest.raises(ValueError, match="shard_ranks"):  # a knob only fsdp-torch reads
        CFG.replace(strategy="zero3", world_size=4, shard_ranks=2)
