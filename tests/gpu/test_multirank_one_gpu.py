"""Several ranks on one CUDA GPU, and the launcher's device and backend choice on a GPU.

The GPU machine this is written for has one GPU. NCCL refuses two ranks of a communicator on
one GPU ("Duplicate GPU detected"), so the launcher refuses backend='nccl' (and 'auto') with
more ranks than GPUs and lets ranks share a GPU under backend='gloo' (distlab.caller.launch.
place_rank). The probe below checks both at run time: it starts two ranks on GPU 0 with NCCL,
then with gloo, tries each collective on CUDA tensors and prints what worked; the strategies
then run through the backend that did, each against one process on the same GPU.

Skipped without CUDA. Tolerance: fp32 SGD (lr 0.1, 10 steps), two ranks against one process on
the same GPU: each rank's half-batch gradient summed by the collective differs from the
one-process gradient only in summation order (~1e-7 relative per step; 7.5e-8 measured on the
CPU after 20 steps, tests/test_equivalence.py). Parameters within 1e-4: a >100x margin, while
a lost or doubled gradient moves them by ~1e-2.
"""

import pytest
import torch

from distlab import RunConfig, launch, run_ranks
from distlab.studies import gpu as G
from distlab.rank.train import train_with_state

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (torch.cuda.is_available() is False): CUDA paths not run")]

ATOL = 1e-4
BASE = RunConfig(steps=10, optimizer="sgd", lr=0.1, global_batch=8, seq_len=32, n_layer=2,
                 n_embd=64, n_head=2, timeout_s=120)
# strategy: (its config at 2 ranks, the collectives it uses on the model's tensors)
STRATEGIES = {
    "ddp": (dict(world_size=2), ("broadcast", "all_reduce")),
    "ddp-torch": (dict(world_size=2), ("broadcast", "all_reduce")),
    # one inner step between averages, outer lr 1, no momentum: plain data parallel SGD
    "diloco": (dict(world_size=2, sync_every=1, outer_lr=1.0, outer_momentum=0.0),
               ("broadcast", "all_reduce")),
    "zero1": (dict(world_size=2), ("broadcast", "reduce_scatter", "all_gather")),
    "zero2": (dict(world_size=2), ("broadcast", "reduce_scatter", "all_gather")),
    "zero3": (dict(world_size=2), ("broadcast", "reduce_scatter", "all_gather")),
    "fsdp-torch": (dict(world_size=2), ("broadcast", "reduce_scatter", "all_gather")),
    "tp": (dict(world_size=2, tp=2), ("broadcast", "all_reduce")),
    "pp": (dict(world_size=2, pp=2, microbatches=2), ("broadcast", "send/recv")),
}


@pytest.fixture(scope="module")
def placement():
    p = G.shared_gpu_backend(world=2)
    for backend, ops in p.probes.items():
        print(f"\ntwo ranks on GPU 0 with {backend}:")
        for op, res in ops.items():
            print(f"  {op:15} {res}")
    print(f"backend for several ranks on one GPU: {p.backend}")
    return p


@pytest.fixture(scope="module")
def single():
    return run_ranks(train_with_state, 1, [BASE.to_dict()], device="cuda", timeout_s=120)[0][0]


def test_nccl_refuses_two_ranks_on_one_gpu_and_gloo_carries_them(placement):
    if torch.cuda.device_count() > 1:
        pytest.skip("more than one GPU: the probe still shares GPU 0, but the launcher gives "
                    "each rank its own")
    nccl = placement.probes["nccl"]
    if nccl["all_reduce"] == "ok":
        pytest.fail("NCCL ran two ranks on one GPU: distlab.caller.launch.place_rank's refusal "
                    "(backend='nccl' with more ranks than GPUs) is out of date")
    assert placement.backend == "gloo", placement.probes


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_two_ranks_on_one_gpu_equal_single(strategy, placement, single):
    knobs, needs = STRATEGIES[strategy]
    backend = "nccl" if torch.cuda.device_count() >= 2 else placement.backend
    if backend is None:
        pytest.fail(f"no backend ran two ranks on one GPU: {placement.probes}")
    if backend == "gloo":
        missing = {op: placement.probes["gloo"][op] for op in needs if not placement.works(op)}
        if missing:
            pytest.skip(f"{strategy} needs {', '.join(missing)}, which gloo does not do on CUDA "
                        f"tensors here (probe: {missing}); one GPU cannot run it multi-rank")
    cfg = BASE.replace(strategy=strategy, device="cuda", backend=backend, **knobs)
    results = run_ranks(train_with_state, 2, [cfg.to_dict()], device="cuda", backend=backend,
                        timeout_s=120)
    for rank, per_cfg in enumerate(results):
        state = per_cfg[0]["state"]
        worst = max((state[k] - single["state"][k]).abs().max().item() for k in state)
        print(f"\n{strategy} rank {rank} over {backend} on one GPU: params within {worst:.1e}")
        assert worst <= ATOL, (strategy, rank, worst)


def test_launcher_picks_the_device_and_backend():
    [one] = run_ranks(G.where_am_i, 1, device="auto")
    assert one == {"device": "cuda:0", "backend": "nccl"}
    [cpu] = run_ranks(G.where_am_i, 1, device="cpu")
    assert cpu == {"device": "cpu", "backend": "gloo"}
    if torch.cuda.device_count() == 1:
        shared = run_ranks(G.where_am_i, 2, device="cuda", backend="gloo")
        assert shared == [{"device": "cuda:0", "backend": "gloo"}] * 2
        # auto with 2 ranks on 1 GPU: the CPU, as before (CUDA only with a GPU per rank)
        assert run_ranks(G.where_am_i, 2, device="auto") == [cpu, cpu]


def test_launcher_refuses_what_cannot_work():
    with pytest.raises(ValueError, match="backend='nccl' needs device='cuda'"):
        RunConfig(backend="nccl", device="cpu")
    with pytest.raises(ValueError, match="device='cpu'"):
        run_ranks(G.where_am_i, 1, device="cpu", backend="nccl")
    n = torch.cuda.device_count()
    for backend in ("nccl", "auto"):
        with pytest.raises(ValueError, match="NCCL needs one GPU per rank"):
            run_ranks(G.where_am_i, n + 1, device="cuda", backend=backend)
    with pytest.raises(ValueError, match="NCCL needs one GPU per rank"):
        launch(BASE.replace(strategy="ddp", world_size=n + 1, device="cuda", backend="nccl"))
