"""Infrequent averaging (diloco, distlab.parallel.data_parallel.diloco) and PyTorch's PowerSGD
under ddp-torch: the two ways the workbook spends fewer bytes on a slow link.

Checked against:
* `single`: averaging every step (H = 1) with outer lr 1, no momentum and inner SGD is DDP, so
  its parameters equal single's. SGD at lr 0.1 does not amplify float32 rounding (the
  argument of tests/test_equivalence.py): atol 1e-5, against 3.6e-7 measured (the outer step
  rounds θ_global − Δ̄ once more than DDP's update), while a wrong average moves parameters by
  ~1e-2.
* PyTorch's own local SGD: torch.distributed.algorithms' PeriodicModelAverager after each
  SGD step, period H. Ours takes θ_global − mean(θ_global − θ_r), torch's mean(θ_r): equal in
  exact arithmetic, so they differ by float32 rounding only: atol 1e-5 again (measured
  7.5e-9, printed). With AdamW inside, its 1/sqrt(v) magnifies that rounding where a gradient is
  near zero: 4.6e-6 after 9 steps, too close to any tolerance that would still catch a bug.
* PowerSGD's bytes: its formula (compression.powersgd_bytes_per_rank), against the kernel's
  count of what each rank wrote (distlab.wire): gloo adds a header of fixed size per message.
"""

import pytest
import torch

from distlab import RunConfig, run_ranks
from distlab.comm import ring_allreduce_bytes
from distlab.events import step_events_per_run
from distlab.models import GPT, GPTConfig
from distlab.parallel.data_parallel.compression import powersgd_bytes_per_rank
from distlab.rank.train import train_with_state

ATOL = 1e-5
H = 3
BASE = RunConfig(steps=9, optimizer="sgd", lr=0.1, global_batch=8, seq_len=16, n_layer=2,
                 n_embd=32, n_head=2, mlp_ratio=4, timeout_s=60)
EVERY_STEP = BASE.replace(strategy="diloco", world_size=2, sync_every=1, outer_lr=1.0,
                          outer_momentum=0.0)
LOCAL_SGD = EVERY_STEP.replace(sync_every=H)
DILOCO = LOCAL_SGD.replace(outer_lr=0.7, outer_momentum=0.9)
POWERSGD = BASE.replace(strategy="ddp-torch", world_size=2, compress="powersgd", powersgd_rank=1)


def torch_local_sgd(cfg, rank, world):
    """The same run as LOCAL_SGD, written with torch's PeriodicModelAverager."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    from distlab.data.dataset import make_data
    from distlab.rank.build import build_model, build_optimizer
    torch.manual_seed(cfg.seed)
    model, data = build_model(cfg), make_data(cfg)
    optimizer = build_optimizer(cfg, model.parameters())
    # torch averages on its calls H-1, 2H-1, ... after warmup_steps=H-1: after our steps H, 2H
    averager = PeriodicModelAverager(period=cfg.sync_every, warmup_steps=cfg.sync_every - 1)
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr_at(step)
        x, y = data.rank_batch(step, cfg.global_batch, rank, world)
        model(x, y).backward()
        optimizer.step()
        averager.average_parameters(model.parameters())  # those with a .grad: zero_grad after
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def one_process(cfg) -> dict:
    """`single`'s run of cfg written out: the whole global batch, one model, SGD."""
    from distlab.data.dataset import make_data
    from distlab.rank.build import build_model, build_optimizer
    torch.manual_seed(cfg.seed)
    model, data = build_model(cfg), make_data(cfg)
    optimizer = build_optimizer(cfg, model.parameters())
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr_at(step)
        model(*data.rank_batch(step, cfg.global_batch, 0, 1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def ours_and_torchs(rank, world, device, log, cfg_dicts):
    ours = train_with_state(rank, world, device, log, cfg_dicts)
    single = one_process(BASE) if rank == 0 else None  # in the same launch: one fewer
    return ours, torch_local_sgd(LOCAL_SGD, rank, world), single


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cfgs = [EVERY_STEP, LOCAL_SGD, DILOCO, POWERSGD, POWERSGD.replace(compress="none")]
    run_dir = str(tmp_path_factory.mktemp("diloco"))
    out = run_ranks(ours_and_torchs, 2, [c.to_dict() for c in cfgs], timeout_s=90,
                    run_dir=run_dir)
    return out[0][2], [o[0] for o in out], [o[1] for o in out], run_dir


def _worst(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_averaging_every_sgd_step_is_data_parallel(runs):
    single, ours, _, _ = runs
    for rank in ours:
        worst = _worst(rank[0]["state"], single["state"])
        print(f"diloco H=1, outer lr 1: worst parameter diff vs single {worst:.1e}")
        assert worst <= ATOL


def test_local_sgd_equals_torchs_periodic_model_averager(runs):
    _, ours, torchs, _ = runs
    for rank, ref in zip(ours, torchs):
        worst = _worst(rank[1]["state"], ref)
        print(f"local SGD H={H}: worst parameter diff vs torch's averager {worst:.1e}")
        assert worst <= ATOL
    # after the last average, every rank holds the same model, bit for bit
    for k, t in ours[0][1]["state"].items():
        assert torch.equal(t, ours[1][1]["state"][k]), k
    # between averages the replicas drift: their losses differ from step 1 on
    assert ours[0][1]["losses"][1] != ours[1][1]["losses"][1]


def test_only_averaging_steps_communicate_the_whole_model(runs):
    _, ours, _, _ = runs
    model_bytes = 4 * sum(t.numel() for t in ours[0][1]["state"].values())
    for i in (1, 2):  # local SGD and DiLoCo move the same bytes
        for rank in ours:
            for step, stats in enumerate(rank[i]["comm"]):
                if (step + 1) % H:
                    assert stats == {}, (i, step, stats)  # no collective at all
                else:
                    assert stats["all_reduce"]["calls"] == 1
                    assert stats["all_reduce"]["bytes_sent"] == pytest.approx(
                        ring_allreduce_bytes(model_bytes, 2))
    # DiLoCo's outer Nesterov step is not plain averaging: another model
    assert _worst(ours[0][1]["state"], ours[0][2]["state"]) > 1e-3


def test_the_outer_optimizer_is_counted_in_memory_as_estimated(runs):
    """Each step event's optim bytes include θ_global (4Ψ) and, once the first average made it,
    the outer momentum buffer (4Ψ more): what distlab.theory.estimate says."""
    from distlab.theory.estimate import run_model_state_bytes
    run_dir = runs[3]
    for i, cfg in ((1, LOCAL_SGD), (2, DILOCO)):
        for rank in range(2):
            last = step_events_per_run(run_dir, rank)[i][-1]["memory"]
            want = run_model_state_bytes(cfg, rank)
            assert {k: last[k] for k in want} == want, (cfg.outer_momentum, last, want)


def test_powersgd_starts_dense_then_sends_its_factors(runs):
    _, ours, _, _ = runs
    for rank in ours:
        compressed, dense = rank[3], rank[4]
        # the first two steps are plain all-reduces (start_powerSGD_iter=2): the same losses
        assert compressed["losses"][:3] == pytest.approx(dense["losses"][:3], abs=1e-6)
        # then the factors: another gradient, so other losses
        assert compressed["losses"][3:] != pytest.approx(dense["losses"][3:], abs=1e-6)


def test_powersgd_bytes_on_the_wire_equal_the_formula(runs):
    run_dir = runs[3]
    shapes = [tuple(p.shape) for p in GPT(GPTConfig.from_run(BASE)).parameters()]
    formula = powersgd_bytes_per_rank(shapes, POWERSGD.powersgd_rank, 2)
    for rank in range(2):
        sent = [e["wire"]["sent"] for e in step_events_per_run(run_dir, rank)[3]]
        print(f"rank {rank}: wire bytes per step {sent}; formula after step 1: {formula:.0f}")
        for s in sent[2:]:
            # on top of the formula, gloo's headers: a fixed size per message, not per byte
            # (measured 1,728 B per step, 576 per all-reduce, here and on a model 27x larger)
            assert formula <= s <= formula + 3 * 1024


def test_bad_settings_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="sync_every"):
        DILOCO.replace(sync_every=0)
    with pytest.raises(ValueError, match="outer_momentum"):
        DILOCO.replace(outer_momentum=1.0)
    with pytest.raises(ValueError, match="loss_scal|loss scaling"):
        DILOCO.replace(precision="fp16")
    with pytest.raises(ValueError, match="powersgd"):
        BASE.replace(strategy="ddp", world_size=2, compress="powersgd")
    with pytest.raises(ValueError, match="topk"):
        POWERSGD.replace(compress="topk")
    with pytest.raises(ValueError, match="sync_every"):  # a knob only diloco reads
        BASE.replace(strategy="ddp", world_size=2, sync_every=4)
