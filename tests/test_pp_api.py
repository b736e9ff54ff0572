"""distlab.PipelineSchedule on stage modules the tests build, outside distlab's training loop:
an MLP of four layers (activations of another width than the input) and a small pre-norm
transformer (3-D activations (B, T, d), LayerNorms) cut into stages. On 2 ranks, every
schedule (naive, gpipe, 1f1b, interleaved with 2 stages per rank, and with the backward split
in two zb1p, and zbv and dualpipev with 2 stages per rank placed in a V), SGD and AdamW, a few
steps: the last stage's loss and every stage's parameters against one process on the same
global batch, and against torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and, where torch
has it, ScheduleDualPipeV over PipelineStage; torch has no naive schedule, so naive is compared
with its GPipe: same gradients, another order) on the same stages; the guard rails' messages.

Launches: one of 2 ranks runs every case (ours, torch's, the guard rails); torchrun runs
docs/your_model.md's snippet. The single-process reference runs in this process.

Tolerance: ATOL = 1e-5 on parameters after STEPS steps and on each step's loss, float32. A
pipeline computes the single process's ops on micro-batches: only the summation order of the
gradient differs (the mean of m micro-batch means vs the mean over the batch), a few ulps per
step. Against torch's pipelining the same micro-batch losses are summed; torch divides the
summed gradients by m after backward (scale_grads) where we divide each loss by m before it:
again only rounding, and none here: m = 4 is a power of 2, so both divisions are exact.
Measured on torch 2.13 CPU with gloo, 3 steps, every case (printed by the tests): vs one
process at most 1.2e-7 on parameters (tiny) and 1.3e-7 on losses; vs torch's pipelining 0 on
parameters and at most 6.7e-8 on losses (ours sums the m losses / m in Python floats, torch
takes the mean of its list): 75x under ATOL or more; the inputs are seeded, so the figures
repeat.
"""


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from api_models import max_diff
from test_tp_api import Block
from torch import nn

from distlab import PipelineSchedule, run_ranks
from distlab.parallel.pipeline.pp import rank_stages
from distlab.parallel.pipeline.pp_torch import SINGLE_STAGE, torch_schedule_class

ATOL = 1e-5
STEPS, M = 3, 4
SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb1p", "zbv", "dualpipev")
TWO_PER_RANK = ("interleaved", "zbv", "dualpipev")
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
              "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01})}


# -- the models, cut into stages ---------------------------------------------------------------
def mlp_layers():
    return [nn.Sequential(nn.Linear(6, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
            nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 3)]


def tiny_layers():
    return [nn.Linear(5, 8), Block(), Block(), nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 3))]


MODELS = {"mlp": mlp_layers, "tiny": tiny_layers}


def whole(name):
    torch.manual_seed(0)
    return nn.Sequential(*MODELS[name]())


def held(rank, n_stages, schedule=""):
    """The global stages this rank holds of n_stages on 2 ranks: stage s on rank s % 2 (loop
    placement), or for zbv and dualpipev a V, rank r holding r and 3 - r."""
    return rank_stages(rank, 2, n_stages // 2, schedule)


def stages_of(name, rank, n_stages, schedule=""):
    """This rank's stages (`held`) of the model cut into n_stages equal parts; every rank
    builds the whole model from the same seed first."""
    layers = list(whole(name).children())
    per = len(layers) // n_stages
    parts = [nn.Sequential(*layers[s * per:(s + 1) * per]) for s in range(n_stages)]
    return [parts[s] for s in held(rank, n_stages, schedule)]


def data(name, step):
    g = torch.Generator().manual_seed(step)
    if name == "mlp":
        return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    return torch.randn(8, 4, 5, generator=g), torch.randn(8, 4, 3, generator=g)


def names(stage_list, rank, n_stages, schedule):
    """Parameter names as the whole model has them: '<layer index>.<name in the layer>'."""
    per = 4 // n_stages
    out = {}
    for s, st in zip(held(rank, n_stages, schedule), stage_list):
        for k, v in st.state_dict().items():
            i, rest = k.split(".", 1)
            out[f"{s * per + int(i)}.{rest}"] = v.detach().clone()
    return out


def single(name, opt_name):
    cls, kw = OPTIMIZERS[opt_name]
    model = whole(name)
    opt = cls(model.parameters(), **kw)
    losses = []
    for step in range(STEPS):
        x, y = data(name, step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


# -- rank functions ----------------------------------------------------------------------------
def ours(name, schedule, opt_name, rank):
    cls, kw = OPTIMIZERS[opt_name]
    n_stages = 4 if schedule in TWO_PER_RANK else 2
    mine = stages_of(name, rank, n_stages, schedule)
    sched = PipelineSchedule(mine if schedule in TWO_PER_RANK else mine[0], schedule, M,
                             F.mse_loss, n_stages=n_stages)
    opt = cls([p for st in mine for p in st.parameters()], **kw)
    losses = []
    for step in range(STEPS):
        losses.append(sched.step(*data(name, step)))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "state": names(mine, rank, n_stages, schedule)}


def torchs(name, schedule, opt_name, rank):
    from torch.distributed.pipelining import PipelineStage
    kind = torch_schedule_class(schedule)
    if kind is None:
        return None
    cls, kw = OPTIMIZERS[opt_name]
    n_stages = 4 if schedule in TWO_PER_RANK else 2
    mine = stages_of(name, rank, n_stages, schedule)
    stages = [PipelineStage(st, s, n_stages, torch.device("cpu"))
              for s, st in zip(held(rank, n_stages, schedule), mine)]
    sched = kind(stages[0] if schedule in SINGLE_STAGE else stages, n_microbatches=M,
                 loss_fn=F.mse_loss)
    opt = cls([p for st in mine for p in st.parameters()], **kw)
    last = n_stages - 1 in held(rank, n_stages, schedule)
    losses = []
    for step in range(STEPS):
        x, y = data(name, step)
        out = [] if last else None
        if rank == 0:
            sched.step(x, target=y, losses=out) if last else sched.step(x)
        else:
            sched.step(target=y, losses=out)
        losses.append(float(torch.stack(out).mean()) if last else None)
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "state": names(mine, rank, n_stages, schedule)}


def _error(fn) -> str:
    try:
        fn()
    except (RuntimeError, ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def guard_rails(rank):
    stage = lambda: stages_of("mlp", rank, 2)[0]  # noqa: E731
    out = {"too many stages": _error(lambda: PipelineSchedule(stage(), "1f1b", 4, F.mse_loss,
                                                              n_stages=3)),
           "two stages, not interleaved": _error(lambda: PipelineSchedule(
               stages_of("mlp", rank, 4), "gpipe", 4, F.mse_loss)),
           "ranks disagree": _error(lambda: PipelineSchedule(stage(), "gpipe", 2 + 2 * rank,
                                                             F.mse_loss)),
           "no loss_fn": _error(lambda: PipelineSchedule(stage(), "gpipe", 4)),
           "unknown schedule": _error(lambda: PipelineSchedule(stage(), "zigzag", 4,
                                                               F.mse_loss))}
    st = stage()
    sched = PipelineSchedule(st, "gpipe", 4, F.mse_loss)
    out["twice"] = _error(lambda: PipelineSchedule(st, "gpipe", 4, F.mse_loss))
    x, y = data("mlp", 0)
    out["called directly"] = _error(lambda: st(torch.randn(2, 6 if rank == 0 else 8)))
    with torch.no_grad():
        out["called directly, no_grad"] = _error(lambda: st(torch.randn(2, 6 if rank == 0 else 8)))
    out["rows not divisible"] = _error(lambda: sched.step(x[:6], y[:6]))
    sched.step(x, y)  # a good step: the shapes are learnt
    # only rank 0 (stage 0) checks its input; it raises before sending, so rank 1 does not wait
    out["shape changed"] = _error(lambda: sched.step(x[:4], y[:4])) if rank == 0 else ""
    out["missing x"] = _error(lambda: sched.step(None, y)) if rank == 0 else ""
    dist.barrier()
    return out


def two_ranks(rank, world, device, log):
    out = {}
    for name in MODELS:
        for schedule in SCHEDULES:
            for opt_name in OPTIMIZERS:
                out[name, schedule, opt_name] = {
                    "ours": ours(name, schedule, opt_name, rank),
                    "torch": torchs(name, "gpipe" if schedule == "naive" else schedule,
                                    opt_name, rank)}
    out["guard rails"] = guard_rails(rank)
    return out


# -- the tests ---------------------------------------------------------------------------------
CASES = [(n, s, o) for n in MODELS for s in SCHEDULES for o in OPTIMIZERS]


@pytest.fixture(scope="module")
def launched():
    return run_ranks(two_ranks, 2, timeout_s=120, wall_timeout_s=300)


def _merged(launched, name, schedule, opt_name, who):
    state, losses = {}, None
    for res in launched:
        got = res[name, schedule, opt_name][who]
        if got is None:
            pytest.skip(f"torch {torch.__version__} has no {schedule} schedule")
        assert not state.keys() & got["state"].keys()  # each parameter on one stage only
        state |= got["state"]
        if got["losses"][0] is not None:
            losses = got["losses"]
    return state, losses


@pytest.mark.parametrize("name,schedule,opt_name", CASES)
def test_equal_to_one_process(launched, name, schedule, opt_name):
    ref = single(name, opt_name)
    state, losses = _merged(launched, name, schedule, opt_name, "ours")
    worst = max_diff(state, ref["state"])
    loss = max(abs(a - b) for a, b in zip(losses, ref["losses"]))
    print(f"{name}, {schedule}, {opt_name}: vs one process: parameters after {STEPS} steps "
          f"{worst:.1e}, losses {loss:.1e}")
    assert worst <= ATOL and loss <= ATOL


@pytest.mark.parametrize("name,schedule,opt_name", CASES)
def test_equal_to_torch_pipelining(launched, name, schedule, opt_name):
    ours_state, ours_losses = _merged(launched, name, schedule, opt_name, "ours")
    theirs, their_losses = _merged(launched, name, schedule, opt_name, "torch")
    worst = max_diff(ours_state, theirs)
    loss = max(abs(a - b) for a, b in zip(ours_losses, their_losses))
    print(f"{name}, {schedule}, {opt_name}: vs torch.distributed.pipelining: parameters "
          f"{worst:.1e}, losses {loss:.1e}")
    assert worst <= ATOL and loss <= ATOL


def test_guard_rails_say_what_to_do(launched):
    for r, res in enumerate(launched):
        m = res["guard rails"]
        assert m["too many stages"].startswith("ValueError: PipelineSchedule (rank 0): "
                                               "n_stages=3 stages do not fit 2 ranks"), m
        assert "use schedule='interleaved'" in m["two stages, not interleaved"]
        assert "every rank must build its schedule with the same settings" in \
            m["ranks disagree"]
        assert "(rank 1): the rank holding the last stage needs loss_fn" in m["no loss_fn"]
        assert "schedule='zigzag' is not one of naive, gpipe, 1f1b, interleaved" in \
            m["unknown schedule"]
        assert "already in a PipelineSchedule" in m["twice"]
        assert m["called directly"].startswith(f"RuntimeError: this module is stage {r} of 2")
        assert "schedule.step(x, y)" in m["called directly"]
        assert m["called directly, no_grad"] == "no error"
        assert "6 rows, not divisible into n_microbatches=4" in m["rows not divisible"]
    m = launched[0]["guard rails"]
    assert "not the first step's" in m["shape changed"] and "keep the micro-batch shape" in \
        m["shape changed"]
    assert "this rank holds stage 0: pass x" in m["missing x"]
