"""distlab.fully_shard (ZeRO-3 for any module) with distlab.ZeroOptimizer stepping its shards,
outside distlab's training loop: a bare nn.Linear (all of it the root unit), tied weights,
parameters on the root module, fp32 next to fp64 parameters, and a model of three blocks cut
into units three ways (the default rule, by type, by name; and by type kept gathered from
forward to backward, reshard_after_forward=False). On 2 ranks, AdamW and SGD
(momentum, weight decay), a few steps with the lr halved midway, against one process stepping
the plain optimizer on the same global batch and against torch's FSDP2
(torch.distributed.fsdp.fully_shard) on the same per-rank rows; under a bf16
MixedPrecisionPolicy (reduce in fp32, and in bf16) against FSDP2 under the same policy. Also:
each rank's per-parameter gradient pieces (distlab.grad_shard) and whole gradients
(distlab.full_grad) against one process's gradient; a plain torch optimizer built over
model.parameters() after fully_shard (bound to the shards: bit-identical to ZeroOptimizer),
with and without zero_grad() between steps; the bytes a bf16 all-gather moves, and the guard
rails.

Launches: one of 2 ranks runs every case in turn; torchrun runs docs/your_model.md's snippet. The
single-process reference runs in this process.

Tolerance, fp32: ATOL = 1e-6 on parameters after 5 steps of values of order 1 (as
test_zero_api.py). Sharding changes no arithmetic of the update (SGD and AdamW are elementwise,
so stepping a flat shard computes what stepping whole tensors does), and gathering changes no
value. Against one process only the gradient's summation order differs (the mean of two 4-row
means vs the mean of 8 rows): a few float32 ulps per step, which neither SGD at lr 0.1 nor
AdamW at lr 1e-2 (a scale-free update) amplifies. Measured on torch 2.13 CPU with gloo (printed
by the tests; the inputs are seeded, so the figures do not vary): at most 1.2e-7, 8x under
ATOL. Against FSDP2 the same per-rank arithmetic runs: measured 0 on every model, fp64 next to
fp32 included. A wrong gradient (not averaged, a unit reduced into another's shard, a
prefetched unit used before its gather finished) is off by ~1e-2 or more.

Tolerance, bf16 against FSDP2 under the same policy: BF16_ATOL = 1e-6, the fp32 figure. Both
cast the fp32 shards to bf16 before gathering, compute forward and backward in bf16 with the
same ops on the same rows, reduce-scatter in reduce_dtype and step fp32 masters, so they run
the same arithmetic: measured 0 with reduce_dtype fp32 and with bf16 (printed). For scale, the
bf16 runs differ from the fp32 single process by 4.3e-4 (root params) to 2.0e-2 (blocks),
printed too: 400x the tolerance or more, so a rounding step done differently (casting after
the gather, reducing in another dtype) would show.
"""


import pytest
import torch
from api_models import Mixed, RootParams, Tied, batch, loss_of, max_diff, rows, train_steps
from torch import nn

import distlab
from distlab import MixedPrecisionPolicy, ZeroOptimizer, fully_shard, run_ranks

ATOL = BF16_ATOL = 1e-6
STEPS = 5
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
              "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01})}
BF16 = {"bf16, reduce fp32": (torch.bfloat16, torch.float32),
        "bf16, reduce bf16": (torch.bfloat16, None)}  # None: reduce_dtype = param_dtype


# -- a model of blocks, cut into units by the user ------------------------------------------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, h):
        return h + torch.tanh(self.norm(self.lin(h)))


class Blocks(nn.Module):
    """An input layer, three blocks, a head, and a scale on the root module."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h) * self.scale


MODELS = {"bare linear": lambda: nn.Linear(6, 3), "tied": Tied, "root params": RootParams,
          "mixed dtypes": Mixed, "blocks": Blocks}
# fully_shard's units: None (find_units: each ModuleList item, the other children grouped),
# module types, qualified names (a list of names: one unit); "kept": reshard_after_forward=False
UNITS = {"default": None, "by type": (Block,),
         "by name": ["blocks.0", ["blocks.1", "blocks.2"], "head"], "by type, kept": (Block,)}
CASES = [(n, "default") for n in MODELS] + [("blocks", u) for u in list(UNITS)[1:]]


def shard(model, units, policy=None):
    return fully_shard(model, units=UNITS[units], mp_policy=policy,
                       reshard_after_forward=not units.endswith("kept"))


def make(name, seed=0):
    torch.manual_seed(seed)
    return MODELS[name]()


def train(name, model, opt, rank, world, steps=STEPS, zero_every=1):
    """api_models.train_steps, then the full state (see there)."""
    train_steps(name, model, opt, rank, world, steps, zero_every)
    return full_state(model)


def full_state(model):
    """model.state_dict() as plain full tensors (FSDP2's DTensors gathered)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


_single_cache: dict = {}


def single(name, opt_name, zero_every=1):
    """One process on the whole global batch, the plain optimizer: the reference."""
    key = name, opt_name, zero_every
    if key not in _single_cache:
        cls, kw = OPTIMIZERS[opt_name]
        model = make(name)
        _single_cache[key] = train(name, model, cls(model.parameters(), **kw), 0, 1,
                                   zero_every=zero_every)
    return _single_cache[key]


# -- rank functions (spawned processes import them from here) --------------------------------
def policy_of(precision):
    return MixedPrecisionPolicy(*BF16[precision]) if precision else None


def ours(name, units, opt_name, precision, rank, world):
    cls, kw = OPTIMIZERS[opt_name]
    model = shard(make(name), units, policy_of(precision))
    opt = ZeroOptimizer(model.parameters(), cls, **kw)
    return train(name, model, opt, rank, world)


def plain(name, opt_name, rank, world, zero_every=1):
    """FSDP2's habit: a torch optimizer built over model.parameters() after fully_shard."""
    cls, kw = OPTIMIZERS[opt_name]
    model = shard(make(name), "default")
    return train(name, model, cls(model.parameters(), **kw), rank, world, zero_every=zero_every)


def torchs(name, opt_name, precision, rank, world, mesh):
    """FSDP2: fully_shard on each single-module unit of find_units' cut, then on the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from distlab.parallel.zero.fsdp import find_units
    cls, kw = OPTIMIZERS[opt_name]
    model = make(name)
    policy = TorchPolicy(*BF16[precision]) if precision else TorchPolicy()
    for _, modules in find_units(model):
        if len(modules) == 1:
            torch_fully_shard(modules[0], mesh=mesh, mp_policy=policy)
    torch_fully_shard(model, mesh=mesh, mp_policy=policy)
    return train(name, model, cls(model.parameters(), **kw), rank, world)


def grad_pieces(name, units, rank, world):
    """After one backward: each parameter's piece of this rank's gradient shard, and the
    shards' sizes."""
    model = shard(make(name), units)
    x, y = (rows(t, rank, world) for t in batch(name, 0))
    loss_of(name, model(x), y).backward()
    state = model._distlab_fsdp
    return {"pieces": {n: distlab.grad_shard(p).clone() for n, p in model.named_parameters()},
            "full": {n: distlab.full_grad(p) for n, p in model.named_parameters()},
            "shard": sum(u.shard.numel() for u in state.units),
            "padded": sum(u.padded for u in state.units),
            "grads": [n for n, p in model.named_parameters() if p.grad is not None],
            "units": len(state.units), "gathers": len(state.gathers)}


def gather_bytes(precision, rank, world):
    """Bytes this rank's all-gathers sent for one forward and backward of "blocks"."""
    from distlab.comm import Comm
    comm = Comm()
    model = fully_shard(make("blocks"), units=(Block,), mp_policy=policy_of(precision), comm=comm)
    comm.take_step_stats()  # not construction's broadcasts
    x, y = (rows(t, rank, world) for t in batch("blocks", 0))
    loss_of("blocks", model(x).float(), y).backward()
    return comm.take_step_stats()[0]["all_gather"]["bytes_sent"]


PREFETCH = (0, 1, 2, 3)  # units gathered ahead of need (the blocks model has 3 units)


def prefetch_depth(depth, rank, world):
    """"blocks" trained with fully_shard(prefetch=depth), AdamW: its state, how many of its
    unit all-gathers were issued before the unit was needed, and the peak bytes of gathered
    parameters against one block's."""
    cls, kw = OPTIMIZERS["adamw"]
    model = fully_shard(make("blocks"), units=(Block,), prefetch=depth)
    state = train("blocks", model, ZeroOptimizer(model.parameters(), cls, **kw), rank, world)
    fsdp = model._distlab_fsdp
    ahead = [g for g in fsdp.gathers if g["unit"].startswith("blocks")]
    return {"state": state, "gathers": len(ahead),
            "prefetched": sum(g["prefetched"] for g in ahead), "peak": fsdp.peak["params"],
            "block": max(u.nbytes for c in fsdp.chain for u in c),
            "root": sum(u.nbytes for u in fsdp.root)}


def _error(fn) -> str:
    try:
        fn()
    except (RuntimeError, TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _forward(model):
    return model(torch.randn(4, 6)).sum()


def guard_rails(rank, world):
    """The errors a misuse gets, as text."""
    out = {}
    model = nn.Linear(6, 3)
    early = torch.optim.SGD(model.parameters(), lr=0.1)  # built before sharding
    fully_shard(model)
    _forward(model).backward()
    out["optimizer built before"] = _error(early.step)
    out["not elementwise"] = _error(lambda: torch.optim.LBFGS(model.parameters()))
    out["stage 2 over sharded"] = _error(
        lambda: ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=2, lr=0.1))
    torch.optim.SGD(model.parameters(), lr=0.1)  # after sharding: it steps the shards
    out["second optimizer"] = _error(
        lambda: ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.1))
    out["wrapped twice"] = _error(lambda: fully_shard(model))
    out["cast after"] = _error(model.double)
    out["load after"] = _error(lambda: model.load_state_dict(nn.Linear(6, 3).state_dict()))
    model.bias.requires_grad_(False)
    out["frozen after"] = _error(lambda: _forward(model))
    blocks = make("blocks")
    fully_shard(blocks.blocks[0])  # FSDP2's habit: each block, then the root
    out["per block, then root"] = _error(lambda: fully_shard(blocks))
    lin = nn.Linear(6, 3)
    ZeroOptimizer(lin.parameters(), torch.optim.SGD, lr=0.1)
    out["after ZeroOptimizer"] = _error(lambda: fully_shard(lin))
    out["tied across units"] = _error(lambda: fully_shard(make("tied"), units=["emb", "head"]))
    out["units overlap"] = _error(lambda: fully_shard(make("blocks"),
                                                      units=["blocks", "blocks.0"]))
    out["no such unit"] = _error(lambda: fully_shard(make("blocks"), units=["block.0"]))
    out["negative prefetch"] = _error(lambda: fully_shard(make("blocks"), prefetch=-1))
    lin = fully_shard(nn.Linear(6, 3))
    out["group splits a unit"] = _error(lambda: ZeroOptimizer(
        [{"params": [lin.weight]}, {"params": [lin.bias], "lr": 0.2}], torch.optim.SGD, lr=0.1))
    out["grad_shard of a plain parameter"] = _error(
        lambda: distlab.grad_shard(nn.Linear(2, 2).weight))
    hand = fully_shard(nn.Linear(6, 3))  # backward reduced, then a whole .grad set by hand:
    _forward(hand).backward()            # before, grad_shard added it a second time
    hand.weight.grad = torch.ones(3, 6)
    out["grad set by hand after the reduce"] = _error(lambda: distlab.grad_shard(hand.weight))
    return out


def two_ranks(rank, world, device, log):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, units in CASES:
        for opt_name in OPTIMIZERS:
            out[name, units, opt_name] = ours(name, units, opt_name, None, rank, world)
    for name in MODELS:
        for opt_name in OPTIMIZERS:
            out[name, "torch", opt_name] = torchs(name, opt_name, None, rank, world, mesh)
            out[name, "plain", opt_name] = plain(name, opt_name, rank, world)
    out["blocks", "plain", "sgd", "accumulating"] = plain("blocks", "sgd", rank, world, 2)
    for precision in BF16:
        for name in ("blocks", "tied", "root params"):
            out[name, precision] = ours(name, "default", "adamw", precision, rank, world)
            out[name, precision, "torch"] = torchs(name, "adamw", precision, rank, world, mesh)
    for depth in PREFETCH:
        out["prefetch", depth] = prefetch_depth(depth, rank, world)
    for name, units in CASES:
        out["grad pieces", name, units] = grad_pieces(name, units, rank, world)
    for precision in (None, "bf16, reduce fp32"):
        out["gather bytes", precision] = gather_bytes(precision, rank, world)
    out["guard rails"] = guard_rails(rank, world)
    return out


# -- the tests ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def launched():
    return run_ranks(two_ranks, 2, timeout_s=240)


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("name,units", CASES)
def test_equal_to_one_process(launched, name, units, opt_name):
    ref = single(name, opt_name)
    for r, res in enumerate(launched):
        got = res[name, units, opt_name]
        assert all(v.dtype == ref[k].dtype for k, v in got.items())  # full, in their dtype
        worst = max_diff(got, ref)
        print(f"{name} ({units} units), {opt_name}, rank {r}: vs one process after {STEPS} "
              f"steps {worst:.1e}")
        assert worst <= ATOL
    for k, t in launched[1][name, units, opt_name].items():  # the same state on every rank
        assert torch.equal(t, launched[0][name, units, opt_name][k]), k


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("name", MODELS)
def test_equal_to_torch_fsdp2(launched, name, opt_name):
    for r, res in enumerate(launched):
        worst = max_diff(res[name, "default", opt_name], res[name, "torch", opt_name])
        print(f"{name}, {opt_name}, rank {r}: vs FSDP2 {worst:.1e}")
        assert worst <= ATOL


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("name", MODELS)
def test_a_torch_optimizer_built_after_sharding_steps_the_shards(launched, name, opt_name):
    """torch.optim.SGD / AdamW over model.parameters() after fully_shard (FSDP2's habit) is
    bound to the units' shards: the same arithmetic as ZeroOptimizer (bit-identical), and one
    process within ATOL."""
    for r, res in enumerate(launched):
        got = res[name, "plain", opt_name]
        worst = max_diff(got, single(name, opt_name))
        print(f"{name}, {opt_name} built after fully_shard, rank {r}: vs one process "
              f"{worst:.1e}")
        assert worst <= ATOL
        for k, t in res[name, "default", opt_name].items():
            assert torch.equal(got[k], t), k


def test_a_torch_optimizer_accumulates_without_zero_grad(launched):
    """zero_grad() after every second step: the steps between add two backwards' gradients,
    as torch's optimizers do. Zeroing every step instead would differ by ~1e-2."""
    ref, every = single("blocks", "sgd", zero_every=2), single("blocks", "sgd")
    assert max_diff(ref, every) > 100 * ATOL  # the two loops do train differently
    for res in launched:
        assert max_diff(res["blocks", "plain", "sgd", "accumulating"], ref) <= ATOL


@pytest.mark.parametrize("precision", BF16)
@pytest.mark.parametrize("name", ["blocks", "tied", "root params"])
def test_bf16_policy_equal_to_torch_fsdp2(launched, name, precision):
    for r, res in enumerate(launched):
        got = res[name, precision]
        assert all(v.dtype == torch.float32 for v in got.values())  # the fp32 masters, gathered
        worst = max_diff(got, res[name, precision, "torch"])
        off = max_diff(got, single(name, "adamw"))
        print(f"{name}, {precision}, rank {r}: vs FSDP2 {worst:.1e} (vs fp32 one process "
              f"{off:.1e})")
        assert worst <= BF16_ATOL
        assert off > 100 * BF16_ATOL  # bf16 did run: it is not the fp32 result


def test_bf16_gathers_move_half_the_bytes(launched):
    for res in launched:
        fp32, bf16 = res["gather bytes", None], res["gather bytes", "bf16, reduce fp32"]
        print(f"all-gather bytes per rank, one forward and backward: fp32 {fp32:.0f}, "
              f"bf16 {bf16:.0f}")
        assert fp32 > 0 and bf16 * 2 == fp32


def test_prefetch_depth_changes_when_gathers_start_not_the_result(launched):
    # prefetch=d starts the all-gathers of the d units after the running one: with 3 blocks,
    # d=0 gathers each block when needed (none of its gathers issued ahead: the block waits
    # for every one), d >= 1 all but forward's first block (5 of each step's 6); and each
    # unit more keeps one more block gathered, so the forward's peak grows to the root and
    # min(d + 1, 3) blocks. The arithmetic is the same: bit-identical to prefetch=1.
    for res in launched:
        ref = res["blocks", "by type", "adamw"]
        runs = {d: res["prefetch", d] for d in PREFETCH}
        for d, run in runs.items():
            assert all(torch.equal(t, ref[k]) for k, t in run["state"].items()), d
            assert run["gathers"] == 6 * STEPS
            assert run["prefetched"] == (0 if d == 0 else 5 * STEPS), d
            blocks_live = (run["peak"] - run["root"]) / run["block"]
            print(f"prefetch={d}: {run['prefetched']} of {run['gathers']} block gathers issued "
                  f"ahead, gathered peak {run['peak']} B (root + {blocks_live:.1f} blocks)")
            assert run["peak"] >= run["root"] + min(d + 1, 3) * run["block"], d
        assert runs[0]["peak"] < runs[1]["peak"] < runs[2]["peak"] == runs[3]["peak"]


@pytest.mark.parametrize("name,units", CASES)
def test_gradient_pieces_concatenate_to_one_process_gradient(launched, name, units):
    model = make(name)
    x, y = batch(name, 0)
    loss_of(name, model(x), y).backward()
    for res in launched:
        got = res["grad pieces", name, units]
        assert got["shard"] * 2 == got["padded"]  # each rank holds half of each unit
        assert got["grads"] == []  # .grad is None: the gradient lives in the shards
        if units.startswith("by type"):  # 3 blocks + the root; resharded blocks gather twice
            assert got["gathers"] == got["units"] + (0 if units.endswith("kept") else 3)
    worst = worst_full = 0.0
    for n, p in model.named_parameters():
        whole = torch.cat([res["grad pieces", name, units]["pieces"][n] for res in launched])
        assert whole.shape == (p.numel(),), n
        worst = max(worst, (whole.double() - p.grad.reshape(-1).double()).abs().max().item())
        for res in launched:  # distlab.full_grad: the whole gradient on every rank
            full = res["grad pieces", name, units]["full"][n]
            assert full.shape == p.shape, n
            worst_full = max(worst_full, (full.double() - p.grad.double()).abs().max().item())
    print(f"{name} ({units} units): gradient pieces vs one process {worst:.1e}, full_grad "
          f"{worst_full:.1e}")
    assert worst <= ATOL and worst_full <= ATOL


def test_guard_rails_say_what_to_do(launched):
    msgs = launched[0]["guard rails"]
    expect = {
        "optimizer built before": ("RuntimeError: SGD.step() over a parameter",
                                   "Build the optimizer after fully_shard"),
        "not elementwise": ("TypeError: LBFGS over a model", "only an elementwise optimizer"),
        "stage 2 over sharded": ("ValueError: stage=2", "leave stage out"),
        "second optimizer": ("ValueError", "already have an optimizer (SGD): step that one"),
        "wrapped twice": ("ValueError", "already sharded by distlab.fully_shard: call it once"),
        "cast after": ("RuntimeError", "Move or cast the module first, then call fully_shard"),
        "load after": ("RuntimeError", "Load the state dict before calling fully_shard"),
        "frozen after": ("RuntimeError", "changed after distlab.fully_shard"),
        "per block, then root": ("ValueError", "call fully_shard once, on the root module"),
        "after ZeroOptimizer": ("ValueError", "call fully_shard first"),
        "tied across units": ("ValueError: parameter emb.weight is used by units 'emb', 'head'",
                              "put the modules sharing it in one unit"),
        "units overlap": ("ValueError", "choose units that do not contain each other"),
        "no such unit": ("ValueError: units:", "qualified names"),
        "negative prefetch": ("ValueError: prefetch=-1", "0: none"),
        "group splits a unit": ("ValueError", "a group holds whole units"),
        "grad_shard of a plain parameter": ("ValueError", "its gradient is .grad"),
        "grad set by hand after the reduce": ("RuntimeError: unit", "a second time"),
    }
    assert msgs.keys() == expect.keys()
    for case, (start, says) in expect.items():
        assert msgs[case].startswith(start) and says in msgs[case], (case, msgs[case])
