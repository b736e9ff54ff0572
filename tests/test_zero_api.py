"""distlab.ZeroOptimizer (ZeRO-1/2 as a torch optimizer) on models the tests define, outside
distlab's training loop: a bare nn.Linear, tied weights, parameters on the root module, fp32
next to fp64 parameters, and two parameter groups with their own lr and weight decay. For each,
stages 1 and 2, SGD (momentum, weight decay) and AdamW: a few steps on 2 ranks, with the lr
changed midway through the groups (as a schedule does), against one process stepping the plain
optimizer over the same groups on the same global batch, and against torch's
ZeroRedundancyOptimizer (over torch's DDP) on the same per-rank rows. Also: gradient
accumulation (with and without no_sync), the consolidated optimizer state against the plain
optimizer's, resuming from either state dict, a process group other than the world, and the
guard rails (an outside optimizer over sharded parameters, for this optimizer and for the
zero1/2/3 strategies' models).

Launches: one of 2 ranks runs every case, one of 4 ranks runs two process groups of 2 side by
side, and torchrun runs docs/your_model.md's snippet. The single-process reference runs in this
process.

Tolerance: ATOL = 1e-6 on parameters and optimizer state, float32 (the fp64 parameter is fed
by fp32 products), 5 steps on values of order 1. Sharding changes no arithmetic of the update:
SGD and AdamW are elementwise, so stepping a flat shard computes the numbers stepping whole
tensors does. Against one process only the gradient's summation order differs (the gradient of
the mean over 8 rows vs the mean of two 4-row means): a few float32 ulps (1.2e-7 relative) per
step; SGD at lr 0.1 does not amplify it, nor does AdamW at lr 1e-2, whose update
m/(√v + ε) is scale-free in the gradient (no gradient entry here is near 0, where the ratio
would be sensitive). Measured on torch 2.13 CPU with gloo (printed by the tests): at most
1.2e-7 (two groups, SGD), 7.5e-9 to 3e-8 with AdamW: 8x under ATOL or more; the inputs are
seeded, so the figures do not vary from run to run. Against ZeroRedundancyOptimizer over DDP,
(a + b) / 2 here and a / 2 + b / 2 there are both exact in binary floating point: measured 0
(it refuses fp32 next to fp64). A wrong gradient (not averaged, a rank's missing, a shard
reduced into the wrong place) or a group's settings lost is off by ~1e-2 or more.
"""

import copy
import functools

import pytest
import torch
from api_models import Mixed, RootParams, Tied, batch, loss_of, max_diff, rows
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from distlab import RunConfig, ZeroOptimizer, run_ranks

ATOL = 1e-6
STEPS = 5
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
              "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01})}
STAGES = (1, 2)


# -- the models, their parameter groups and their data -----------------------------------------
class Normed(nn.Module):
    """Two groups, as in a transformer: weights decayed; norms and biases not, at 3x the lr."""

    def __init__(self):
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.inp(x))))


MODELS = {"bare linear": lambda: nn.Linear(6, 3), "tied": Tied, "root params": RootParams,
          "mixed dtypes": Mixed, "two groups": Normed}


def make(name, seed=0):
    torch.manual_seed(seed)
    return MODELS[name]()


def groups(name, model, lr):
    """What the optimizer is given: a bare parameter list, or for "two groups" two groups."""
    if name != "two groups":
        return list(model.parameters())
    decay = [model.inp.weight, model.out.weight]
    rest = [model.inp.bias, model.norm.weight, model.norm.bias, model.out.bias]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 3 * lr}]


def train(name, model, module, opt, rank, world, steps=STEPS, seed=0):
    """`steps` steps on this rank's rows, the lr halved in every group before the 4th."""
    for step in range(steps):
        x, y = (rows(t, rank, world) for t in batch(name, step, seed))
        loss_of(name, model(x), y).backward()
        if step == 3:
            for g in opt.param_groups:
                g["lr"] *= 0.5
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@functools.cache  # the tests only read it
def single(name, opt_name, steps=STEPS, seed=0, init_seed=0):
    """One process on the whole global batch, the plain optimizer: the reference."""
    cls, kw = OPTIMIZERS[opt_name]
    model = make(name, init_seed)
    opt = cls(groups(name, model, kw["lr"]), **kw)
    state = train(name, model, model, opt, 0, 1, steps, seed)
    return {"state": state, "optim": opt.state_dict()}


# -- rank functions (spawned processes import them from here) --------------------------------
def ours(name, opt_name, stage, rank, world):
    cls, kw = OPTIMIZERS[opt_name]
    model = make(name)
    opt = ZeroOptimizer(groups(name, model, kw["lr"]), cls, stage=stage, **kw)
    state = train(name, model, model, opt, rank, world)
    # this rank holds 1/N of the state: AdamW's two moments are shard-sized
    shard = sum(u.shard.numel() for u in opt.units)
    held = sum(v.numel() for s in opt.state.values() for k, v in s.items() if k != "step")
    return {"state": state, "optim": opt.consolidated_state_dict(), "held": held,
            "shard": shard, "padded": sum(u.padded for u in opt.units),
            "settings": [{k: v for k, v in g.items() if k != "params"}
                         for g in opt.optim.param_groups]}


def torchs(name, opt_name, rank, world):
    cls, kw = OPTIMIZERS[opt_name]
    module = make(name)
    model = nn.parallel.DistributedDataParallel(module)
    try:
        opt = ZeroRedundancyOptimizer(groups(name, module, kw["lr"]), optimizer_class=cls, **kw)
    except ValueError as e:  # it takes one dtype only ("mixed dtypes")
        return {"refused": str(e)}
    return {"state": train(name, model, module, opt, rank, world)}


def accumulate(name, rank, world, no_sync):
    """Stage 2, one SGD step over two micro-batches of 2 rows per rank."""
    cls, kw = OPTIMIZERS["sgd"]
    model = make(name)
    opt = ZeroOptimizer(groups(name, model, kw["lr"]), cls, stage=2, **kw)
    x, y = (rows(t, rank, world) for t in batch(name, 0))
    with opt.no_sync() if no_sync else torch.enable_grad():
        (loss_of(name, model(x[:2]), y[:2]) / 2).backward()
    (loss_of(name, model(x[2:]), y[2:]) / 2).backward()
    opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def resume(rank, world, stage):
    """AdamW, 3 steps; then the optimizer state goes, as this rank's shard and consolidated, to
    new optimizers over copies of the model; all three take 2 more steps."""
    cls, kw = OPTIMIZERS["adamw"]
    models = [make("two groups") for _ in range(3)]
    opts = [ZeroOptimizer(groups("two groups", m, kw["lr"]), cls, stage=stage, **kw)
            for m in models]
    train("two groups", models[0], models[0], opts[0], rank, world, steps=3)
    with torch.no_grad():
        for m in models[1:]:
            for p, q in zip(m.parameters(), models[0].parameters()):
                p.copy_(q)
    # a copy, as torch.save and torch.load make one (torch's optimizers, ours among them, load
    # the tensors they are given without copying them)
    opts[1].load_state_dict(copy.deepcopy(opts[0].state_dict()))
    opts[2].load_state_dict(opts[0].consolidated_state_dict())
    return [train("two groups", m, m, o, rank, world, steps=2) for m, o in zip(models, opts)]


def _error(fn) -> str:
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def guard_rails(rank, world):
    """The errors a misuse gets, as text."""
    out = {}
    for stage in STAGES:  # a plain optimizer over parameters a ZeroOptimizer shards
        model = nn.Linear(6, 3)
        ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=stage, lr=0.1)
        plain = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(4, 6)).sum().backward()
        out[f"outside optimizer, stage {stage}"] = _error(plain.step)
    model = nn.Linear(6, 3)
    opt = ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    out["sharded twice"] = _error(lambda: ZeroOptimizer(model.parameters(), torch.optim.SGD))
    model(torch.randn(4, 6)).sum().backward()
    opt.step()  # and no zero_grad: stage 1's flat gradients hold the reduce-scatter's output
    out["backward after step"] = _error(lambda: model(torch.randn(4, 6)).sum().backward())
    out["stage 3"] = _error(lambda: ZeroOptimizer(nn.Linear(2, 2).parameters(),
                                                  torch.optim.SGD, stage=3))
    for s in ("zero1", "zero2", "zero3"):  # the loop's strategies: the same rail
        out[f"{s} strategy"] = _error(lambda: strategy_then_outside_optimizer(s))
    return out


def strategy_then_outside_optimizer(strategy):
    from distlab.comm import Comm
    from distlab.parallel import make_strategy
    from distlab.rank.build import build_model, build_optimizer
    cfg = RunConfig(strategy=strategy, world_size=2, n_layer=1, n_embd=16, n_head=2,
                    seq_len=8, global_batch=4)
    s = make_strategy(cfg, Comm())
    model = s.wrap(build_model(cfg))
    s.build_optimizer(model, lambda params: build_optimizer(cfg, params))
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # what torch habits would do


def two_ranks(rank, world, device, log):
    out = {}
    for name in MODELS:
        for opt_name in OPTIMIZERS:
            out[name, opt_name, "torch"] = torchs(name, opt_name, rank, world)
            for stage in STAGES:
                out[name, opt_name, stage] = ours(name, opt_name, stage, rank, world)
    for no_sync in (False, True):
        out["accumulate", no_sync] = accumulate("root params", rank, world, no_sync)
    for stage in STAGES:
        out["resume", stage] = resume(rank, world, stage)
    out["guard rails"] = guard_rails(rank, world)
    return out


# -- the tests ---------------------------------------------------------------------------------
CASES = [(n, o, s) for n in MODELS for o in OPTIMIZERS for s in STAGES]


@pytest.fixture(scope="module")
def launched():
    return run_ranks(two_ranks, 2, timeout_s=120)


@pytest.mark.parametrize("name,opt_name,stage", CASES)
def test_equal_to_one_process(launched, name, opt_name, stage):
    ref = single(name, opt_name)
    for r, res in enumerate(launched):
        worst = max_diff(res[name, opt_name, stage]["state"], ref["state"])
        print(f"{name}, {opt_name}, stage {stage}, rank {r}: vs one process after {STEPS} "
              f"steps {worst:.1e}")
        assert worst <= ATOL
    for res in launched[1:]:  # after the all-gather every rank holds the same parameters
        for k, t in res[name, opt_name, stage]["state"].items():
            assert torch.equal(t, launched[0][name, opt_name, stage]["state"][k]), k


@pytest.mark.parametrize("name,opt_name,stage", CASES)
def test_equal_to_torch_zero_redundancy_optimizer(launched, name, opt_name, stage):
    if name == "mixed dtypes":  # torch's refuses them; ours equals one process (above)
        assert "same dense type" in launched[0][name, opt_name, "torch"]["refused"]
        return
    for r, res in enumerate(launched):
        got, theirs = res[name, opt_name, stage], res[name, opt_name, "torch"]
        worst = max_diff(got["state"], theirs["state"])
        print(f"{name}, {opt_name}, stage {stage}, rank {r}: vs ZeroRedundancyOptimizer "
              f"{worst:.1e}")
        assert worst <= ATOL


@pytest.mark.parametrize("name,opt_name,stage", CASES)
def test_state_is_sharded_and_consolidates_to_the_plain_optimizers(launched, name, opt_name,
                                                                   stage):
    ref = single(name, opt_name)["optim"]
    for res in launched:
        got = res[name, opt_name, stage]
        assert got["shard"] * 2 == got["padded"]  # N = 2
        assert got["held"] == (2 if opt_name == "adamw" else 1) * got["shard"]  # moments/buffer
        assert got["optim"]["state"].keys() == ref["state"].keys()
        for i, s in ref["state"].items():
            for k, v in s.items():
                assert torch.allclose(got["optim"]["state"][i][k].double(), v.double(),
                                      atol=ATOL, rtol=0), (i, k)
        strip = [{k: v for k, v in g.items() if k != "params"} for g in ref["param_groups"]]
        assert [{k: g[k] for k in s} for g, s in zip(got["optim"]["param_groups"], strip)] \
            == strip


def test_per_group_settings_hold(launched):
    # the inner optimizer has each group's own settings, and they change the run
    lr = OPTIMIZERS["adamw"][1]["lr"]
    for stage in STAGES:
        settings = launched[0]["two groups", "adamw", stage]["settings"]
        assert [(s["weight_decay"], s["lr"]) for s in settings] == [(0.01, lr / 2),
                                                                    (0.0, 3 * lr / 2)]
    model = make("two groups")
    one_group = train("two groups", model, model,
                      torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01), 0, 1)
    assert max_diff(one_group, single("two groups", "adamw")["state"]) > 100 * ATOL


@pytest.mark.parametrize("no_sync", [False, True], ids=["two syncing backwards", "no_sync"])
def test_stage2_accumulates_gradients(launched, no_sync):
    ref = single("root params", "sgd", steps=1)["state"]
    for res in launched:
        assert max_diff(res["accumulate", no_sync], ref) <= ATOL


@pytest.mark.parametrize("stage", STAGES)
def test_state_dicts_resume_the_run_exactly(launched, stage):
    # the shard and the consolidated form hold the same state: the runs go on bitwise alike
    for res in launched:
        went_on, from_shard, from_consolidated = res["resume", stage]
        for k, t in went_on.items():
            assert torch.equal(from_shard[k], t) and torch.equal(from_consolidated[k], t), k


def test_guard_rails_say_what_to_do(launched):
    msgs = launched[0]["guard rails"]
    for stage in STAGES:
        msg = msgs[f"outside optimizer, stage {stage}"]
        assert msg.startswith("RuntimeError: SGD.step() over a parameter"), msg
        assert f"sharded by a ZeRO-{stage} optimizer" in msg and "Step that ZeroOptimizer" in msg
    for s in ("zero1", "zero2"):
        msg = msgs[f"{s} strategy"]
        assert msg.startswith("RuntimeError: SGD.step() over a parameter"), (s, msg)
        assert f"ZeRO-{s[-1]}" in msg, (s, msg)
    # zero3's parameters belong to a fully_shard model: a torch optimizer built over them
    # binds to its shards, so the second optimizer is refused at construction
    assert msgs["zero3 strategy"].startswith(
        "ValueError: these parameters already have an optimizer (ZeroOptimizer)"), msgs
    assert msgs["sharded twice"].startswith("ValueError") and "already sharded" in \
        msgs["sharded twice"]
    assert "zero_grad()" in msgs["backward after step"]
    assert msgs["stage 3"].startswith("ValueError: stage=3 shards the parameters too") and \
        "distlab.fully_shard(model) first" in msgs["stage 3"]


def other_group(rank, world, device, log):
    """Ranks {0, 1} and {2, 3}: two process groups side by side, each with its own data and its
    own first init (every rank starts from its own seed; construction broadcasts the group's
    first rank's values)."""
    import torch.distributed as dist
    pgs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    g = rank // 2
    cls, kw = OPTIMIZERS["adamw"]
    model = make("two groups", seed=rank)
    opt = ZeroOptimizer(groups("two groups", model, kw["lr"]), cls, stage=2, group=pgs[g], **kw)
    return train("two groups", model, model, opt, rank % 2, 2, seed=g)


def test_any_process_group():
    res = run_ranks(other_group, 4, timeout_s=60)
    for g in (0, 1):
        ref = single("two groups", "adamw", seed=g, init_seed=2 * g)["state"]
        for r in (2 * g, 2 * g + 1):
            worst = max_diff(res[r], ref)
            print(f"group {g} rank {r}: vs one process from rank {2 * g}'s init: {worst:.1e}")
            assert worst <= ATOL
    assert max_diff(res[0], res[2]) > 1e-2  # the groups did train apart
