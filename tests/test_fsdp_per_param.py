"""fully_shard(layout="per_param"): FSDP2's per-parameter dim-0 sharding in distlab.

On 4 ranks, a model whose parameters do not cut evenly (10-row layers, a 3-row scale that
rank 3 holds none of, a 1-row gain only rank 0 holds), a model with tied weights and one with
an fp64 parameter next to fp32 ones, each trained 5 steps with SGD (momentum, weight decay)
and with AdamW, the lr halved before the 4th:

* equal to one process on the same global batch (also with the units kept gathered from
  forward to backward and two units prefetched), and to torch's FSDP2
  (torch.distributed.fsdp.fully_shard per block, then the root) on the same rows, and under a
  bf16 MixedPrecisionPolicy equal to FSDP2 under the same policy;
* `p.grad` right after backward is a DTensor with placement Shard(0) holding this rank's rows
  of the mean gradient (distlab.grad_shard and distlab.full_grad read it);
* a parameter frozen with requires_grad_(False) inside a unit gets no gradient and is not
  stepped, while the rest trains as one process with the same parameter frozen;
* model.state_dict() is each rank's shards as DTensors, and taking it moves no bytes (the
  Comm's booked collectives and the kernel's write counter, before and after; the flat
  layout's full state dict, taken the same way, moves some: the measure sees traffic);
* dp x tp: distlab.parallelize_module over a tp group of 2, then per_param over a dp group of
  2, equal to one process;
* the zero3 strategy with fsdp_layout="per_param", through the training loop with gradient
  accumulation and clipping, equal to fsdp_layout="flat" (which test_zero holds equal to
  `single`), each layout's booked bytes equal to distlab.theory.fsdp_layouts' formula; and
  with LoRA adapters (every base weight frozen, sharded and gathered; a unit is freed only
  once backward has reached its inputs, as a frozen weight has no gradient to say it is
  done: freed at its adapters' last gradient, backward failed on its storage).

Launches: one of 4 ranks runs every case in turn; the one-process references run here.

Tolerances. ATOL = 1e-6 on parameters of order 1 after 5 steps, as test_fsdp_api.py: sharding
changes no arithmetic of the update, and only the gradient's summation order differs from one
process (the mean of four 2-row means vs the mean of 8 rows: a few fp32 ulps per step, which
SGD does not amplify; AdamW's update is scale-free). Measured on torch 2.13 CPU (printed; the
inputs are seeded): at most 1.2e-7. Against FSDP2 the same per-rank arithmetic runs in the same
order (the same rows, the same gloo reduce-scatter of the same padded chunks): measured 0, bf16
included; 1e-6 is the fp32 figure kept for both. A wrong gradient (not averaged, rows of
another rank, a padding row added in) is off by ~1e-2 or more.
TP_ATOL = 1e-5 for dp x tp, as tests/test_mesh.py: tensor parallelism splits each matmul's
inner sum in two and adds the halves by all-reduce (another order again); measured 7.5e-8.
LOOP_ATOL = 1e-6 for per_param against flat through the loop (and for a state dict's rows
against the flat layout's): the same rows and the same per-rank gradients, but the ring
reduce-scatter adds the 4 ranks' values in an order set by which rank's block an entry falls
in, and the layouts cut the blocks differently: a few fp32 ulps per step; measured 3.7e-9.
"""

import math

import pytest
import torch
from api_models import Mixed, Tied, batch, loss_of, max_diff, rows, train_steps
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import distlab
from distlab import (ColwiseParallel, MixedPrecisionPolicy, RunConfig, RowwiseParallel,
                     fully_shard, parallelize_module, run_ranks, wire)
from distlab.comm import Comm
from distlab.parallel.zero.fsdp import find_units
from distlab.parallel.zero.per_param import local_rows, rows_per_rank
from distlab.theory import fsdp_layouts

WORLD = 4
ATOL = 1e-6
TP_ATOL = 1e-5
LOOP_ATOL = 1e-6
STEPS = 5
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
              "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01})}
BF16 = (torch.bfloat16, torch.float32)  # param_dtype, reduce_dtype
FROZEN = "blocks.1.fc.weight"  # frozen inside its unit (LoRA's habit: a base weight)
TP_PLAN = {"blocks.*.fc": ColwiseParallel(), "blocks.*.proj": RowwiseParallel()}


class Block(nn.Module):
    """A residual MLP: fc (8 -> 10) and proj (10 -> 8). 10 rows: 3, 3, 3, 1 over 4 ranks."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc, self.proj = nn.LayerNorm(8), nn.Linear(8, 10), nn.Linear(10, 8)

    def forward(self, h):
        return h + self.proj(torch.tanh(self.fc(self.norm(h))))


class Blocks(nn.Module):
    """An input layer, three blocks, a head, and on the root a 3-row scale (rank 3 of 4 holds
    none of it) and a (1, 3) gain (only rank 0 holds it)."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.gain = nn.Parameter(torch.full((1, 3), 0.9))

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h) * self.scale * self.gain


MODELS = {"blocks": Blocks, "tied": Tied, "mixed dtypes": Mixed}


def make(name, frozen=()):
    torch.manual_seed(0)
    model = MODELS[name]()
    for n in frozen:
        model.get_parameter(n).requires_grad_(False)
    return model


def train(name, model, opt, rank, world):
    """STEPS steps on this rank's rows (api_models.train_steps)."""
    train_steps(name, model, opt, rank, world, STEPS)


def optimizer(model, opt_name):
    cls, kw = OPTIMIZERS[opt_name]
    return cls([p for p in model.parameters() if p.requires_grad], **kw)


_single_cache: dict = {}


def single(name, opt_name, frozen=()):
    """One process on the whole global batch, the plain optimizer: the reference."""
    key = name, opt_name, frozen
    if key not in _single_cache:
        model = make(name, frozen)
        train(name, model, optimizer(model, opt_name), 0, 1)
        _single_cache[key] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return _single_cache[key]


# -- rank functions (spawned processes import them from here) --------------------------------
def ours(name, opt_name, rank, world, frozen=(), policy=None, **kw):
    model = fully_shard(make(name, frozen), layout="per_param", mp_policy=policy, **kw)
    train(name, model, optimizer(model, opt_name), rank, world)
    out = model._distlab_fsdp.full_state_dict()
    x, y = (rows(t, rank, world) for t in batch(name, STEPS))  # one more backward, no step:
    loss_of(name, model(x).float(), y).backward()             # which parameters got a .grad
    out["with grad"] = [n for n, p in model.named_parameters() if p.grad is not None]
    return out


def torchs(name, opt_name, rank, world, mesh, frozen=(), policy=None):
    """FSDP2: fully_shard on each single-module unit of find_units' cut, then on the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    model = make(name, frozen)
    policy = TorchPolicy(*policy) if policy else TorchPolicy()
    for _, modules in find_units(model):
        if len(modules) == 1:
            torch_fully_shard(modules[0], mesh=mesh, mp_policy=policy)
    torch_fully_shard(model, mesh=mesh, mp_policy=policy)
    train(name, model, optimizer(model, opt_name), rank, world)
    return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}


def grads_after_backward(rank, world):
    """One backward of "blocks": what p.grad is, its rows, and grad_shard / full_grad."""
    model = fully_shard(make("blocks"), layout="per_param")
    x, y = (rows(t, rank, world) for t in batch("blocks", 0))
    loss_of("blocks", model(x), y).backward()
    grads = dict(model.named_parameters())
    return {"is dtensor": {n: isinstance(p.grad, DTensor) for n, p in grads.items()},
            "placements": {n: [repr(pl) for pl in p.grad.placements] for n, p in grads.items()},
            "shape": {n: list(p.grad.shape) for n, p in grads.items()},
            "rows": {n: p.grad.to_local().clone() for n, p in grads.items()},
            "grad_shard": {n: distlab.grad_shard(p).clone() for n, p in grads.items()},
            "full_grad": {n: distlab.full_grad(p) for n, p in grads.items()}}


def state_dict_traffic(rank, world):
    """Bytes booked and written while each layout's model.state_dict() is taken after a step."""
    out = {}
    for layout in ("per_param", "flat"):
        comm = Comm()
        model = fully_shard(make("blocks"), layout=layout, comm=comm)
        opt = optimizer(model, "sgd")
        x, y = (rows(t, rank, world) for t in batch("blocks", 0))
        loss_of("blocks", model(x), y).backward()
        opt.step()
        opt.zero_grad()
        comm.take_step_stats()
        before = wire.sent()
        sd = model.state_dict()
        written = wire.sent() - before
        booked = comm.take_step_stats()[0]
        out[layout] = {"written": written, "calls": sum(s["calls"] for s in booked.values()),
                       "booked": sum(s["bytes_sent"] for s in booked.values()),
                       "dtensors": all(isinstance(v, DTensor) for v in sd.values()),
                       "placements": sorted({repr(tuple(v.placements)) for v in sd.values()
                                             if isinstance(v, DTensor)}),
                       "local": {k: (v.to_local() if isinstance(v, DTensor) else v).clone()
                                 for k, v in sd.items()}}
    return out


def dp_by_tp(rank, world):
    """4 ranks as dp 2 x tp 2 (tp the fast dimension): TP over {0,1} and {2,3}, then per_param
    over {0,2} and {1,3}. Returns this rank's TP-local parameters, whole over dp."""
    import torch.distributed as dist
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp, tp = divmod(rank, 2)
    model = parallelize_module(make("blocks"), TP_PLAN, group=tp_groups[dp])
    fully_shard(model, layout="per_param", group=dp_groups[tp])
    train("blocks", model, optimizer(model, "sgd"), dp, 2)  # tp ranks share their dp rows
    kinds = {n: repr(tuple(p.placements)) for n, p in model.named_parameters()}
    return {"tp_local": model._distlab_fsdp.full_state_dict(), "dp": dp, "tp": tp,
            "placements": kinds}


LOOP = RunConfig(strategy="zero3", world_size=WORLD, steps=STEPS, optimizer="sgd", lr=0.1,
                 global_batch=8, seq_len=16, n_layer=2, n_embd=30, n_head=2, vocab_size=63,
                 grad_accum=2, grad_clip=0.3, timeout_s=60)


LORA = LOOP.replace(lora_rank=4)  # base weights frozen: per_param shards and gathers them


def the_loop(rank, world, device, log):
    from distlab.rank.train import train_with_state
    cfgs = {(name, layout): cfg.replace(fsdp_layout=layout) for name, cfg in
            (("plain", LOOP), ("lora", LORA)) for layout in fsdp_layouts.LAYOUTS}
    runs = train_with_state(rank, world, device, log, [c.to_dict() for c in cfgs.values()])
    return dict(zip(cfgs, runs))


def four_ranks(rank, world, device, log):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name in MODELS:
        for opt_name in OPTIMIZERS:
            out[name, "ours", opt_name] = ours(name, opt_name, rank, world)
            out[name, "torch", opt_name] = torchs(name, opt_name, rank, world, mesh)
    out["kept"] = ours("blocks", "sgd", rank, world, reshard_after_forward=False, prefetch=2)
    out["frozen", "ours"] = ours("blocks", "sgd", rank, world, frozen=(FROZEN,))
    out["frozen", "torch"] = torchs("blocks", "sgd", rank, world, mesh, frozen=(FROZEN,))
    policy = MixedPrecisionPolicy(*BF16)
    out["bf16", "ours"] = ours("blocks", "adamw", rank, world, policy=policy)
    out["bf16", "torch"] = torchs("blocks", "adamw", rank, world, mesh, policy=BF16)
    out["grads"] = grads_after_backward(rank, world)
    out["state dict"] = state_dict_traffic(rank, world)
    out["dp x tp"] = dp_by_tp(rank, world)
    out["loop"] = the_loop(rank, world, device, log)
    return out


# -- the tests ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def launched():
    return run_ranks(four_ranks, WORLD, timeout_s=300)


def _params(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != "with grad"}


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("name", MODELS)
def test_equal_to_one_process_and_to_torch_fsdp2(launched, name, opt_name):
    ref = single(name, opt_name)
    for r, res in enumerate(launched):
        got = _params(res[name, "ours", opt_name])
        assert all(v.dtype == ref[k].dtype for k, v in got.items())  # fp64 stays fp64
        worst, vs_torch = max_diff(got, ref), max_diff(got, res[name, "torch", opt_name])
        print(f"{name}, {opt_name}, rank {r}: vs one process {worst:.1e}, vs FSDP2 "
              f"{vs_torch:.1e}")
        assert worst <= ATOL and vs_torch <= ATOL


def test_kept_gathered_and_prefetching_two_changes_no_value(launched):
    for r, res in enumerate(launched):
        worst = max_diff(_params(res["kept"]), single("blocks", "sgd"))
        print(f"reshard_after_forward=False, prefetch=2, rank {r}: vs one process {worst:.1e}")
        assert worst <= ATOL


def test_bf16_policy_equal_to_torch_fsdp2(launched):
    for r, res in enumerate(launched):
        got = _params(res["bf16", "ours"])
        assert all(v.dtype == torch.float32 for v in got.values())  # the fp32 shards, gathered
        worst, off = max_diff(got, res["bf16", "torch"]), max_diff(got, single("blocks", "adamw"))
        print(f"bf16, rank {r}: vs FSDP2 {worst:.1e} (vs fp32 one process {off:.1e})")
        assert worst <= ATOL
        assert off > 100 * ATOL  # bf16 did run: it is not the fp32 result


def test_p_grad_is_this_ranks_rows_as_a_dtensor(launched):
    """Right after backward, before any optimizer call: p.grad is a DTensor, Shard(0), the
    parameter's global shape, its local rows this rank's rows of one process's gradient."""
    model = make("blocks")
    x, y = batch("blocks", 0)
    loss_of("blocks", model(x), y).backward()
    worst = 0.0
    for r, res in enumerate(launched):
        got = res["grads"]
        for n, p in model.named_parameters():
            assert got["is dtensor"][n] and got["placements"][n] == [repr(Shard(0))], n
            assert got["shape"][n] == list(p.shape), n
            c = rows_per_rank(p.shape[0], WORLD)
            mine = p.grad[r * c: r * c + local_rows(p.shape[0], WORLD, r)]
            assert got["rows"][n].shape == mine.shape, n
            worst = max(worst, (got["rows"][n] - mine).abs().max().item() if mine.numel() else 0)
            assert torch.equal(got["grad_shard"][n], got["rows"][n].reshape(-1)), n
            worst = max(worst, (got["full_grad"][n] - p.grad).abs().max().item())
    print(f"gradient rows and full_grad vs one process: {worst:.1e}")
    assert worst <= ATOL
    # the uneven cuts really happen: rank 3 holds no row of the 3-row scale, only rank 0 the gain
    assert launched[3]["grads"]["rows"]["scale"].shape == (0,)
    assert [res["grads"]["rows"]["gain"].shape[0] for res in launched] == [1, 0, 0, 0]


def test_a_frozen_parameter_gets_no_gradient_and_is_not_stepped(launched):
    ref = single("blocks", "sgd", frozen=(FROZEN,))
    initial = make("blocks").state_dict()[FROZEN]
    moved = max_diff({FROZEN: single("blocks", "sgd")[FROZEN]}, {FROZEN: initial})
    assert moved > 100 * ATOL  # trained, it would move
    for r, res in enumerate(launched):
        got = _params(res["frozen", "ours"])
        trainable = [n for n, _ in make("blocks").named_parameters() if n != FROZEN]
        assert res["frozen", "ours"]["with grad"] == trainable  # all but the frozen one
        assert torch.equal(got[FROZEN], initial)
        worst, vs_torch = max_diff(got, ref), max_diff(got, res["frozen", "torch"])
        print(f"{FROZEN} frozen, rank {r}: vs one process {worst:.1e}, vs FSDP2 {vs_torch:.1e}")
        assert worst <= ATOL and vs_torch <= ATOL


def test_the_state_dict_is_the_shards_and_moves_no_bytes(launched):
    for r, res in enumerate(launched):
        pp, flat = res["state dict"]["per_param"], res["state dict"]["flat"]
        print(f"rank {r}: state_dict() per_param booked {pp['calls']} calls, {pp['booked']} B, "
              f"wrote {pp['written']} B; flat booked {flat['calls']} calls, {flat['booked']} B, "
              f"wrote {flat['written']} B")
        assert pp["dtensors"] and pp["placements"] == [repr((Shard(0),))]
        assert pp["calls"] == pp["booked"] == 0
        if wire.available():
            assert pp["written"] == 0
            assert flat["written"] > 0  # the counter sees a state dict that communicates
        assert flat["calls"] > 0 and not flat["dtensors"]
        # each rank's shards are its rows of the whole parameters (the flat layout's, gathered:
        # the same step, its gradient summed in another order, so within ATOL, not bitwise)
        for k, whole in flat["local"].items():
            c = rows_per_rank(whole.shape[0], WORLD)
            mine = whole[r * c: r * c + local_rows(whole.shape[0], WORLD, r)]
            assert pp["local"][k].shape == mine.shape, k
            assert torch.allclose(pp["local"][k], mine, rtol=0, atol=ATOL), k


def _assemble(results) -> dict:
    """Single-process names and shapes from the dp x tp ranks' TP-local parameters: column
    blocks (fc) stacked by rows, row blocks (proj.weight) side by side; the rest replicated,
    and asserted equal on every rank."""
    by_tp = {res["tp"]: res["tp_local"] for res in results if res["dp"] == 0}
    whole = {}
    for k, v0 in by_tp[0].items():
        if ".fc." in k:
            whole[k] = torch.cat([by_tp[0][k], by_tp[1][k]], 0)
        elif k.endswith("proj.weight"):
            whole[k] = torch.cat([by_tp[0][k], by_tp[1][k]], 1)
        else:
            whole[k] = v0
            for res in results:
                assert torch.equal(res["tp_local"][k], v0), k
    return whole


def test_dp_by_tp_equals_one_process(launched):
    results = [res["dp x tp"] for res in launched]
    for res in results:  # the TP-local parameters, sharded over dp
        assert set(res["placements"].values()) == {repr((Shard(0),))}
    for dp in (0, 1):  # the two dp replicas of each tp rank agree
        for k, v in results[dp * 2]["tp_local"].items():
            assert torch.equal(v, results[(1 - dp) * 2]["tp_local"][k]), k
    worst = max_diff(_assemble(results), single("blocks", "sgd"))
    print(f"dp 2 x tp 2, SGD: vs one process {worst:.1e}")
    assert worst <= TP_ATOL


def _gpt_units(cfg: RunConfig) -> list[list[tuple]]:
    from distlab.models import GPT, GPTConfig
    model = GPT(GPTConfig.from_run(cfg))
    return [[tuple(p.shape) for m in modules for p in dict.fromkeys(m.parameters())]
            for _, modules in find_units(model)]


def test_the_loop_per_param_equals_flat_and_books_its_padding(launched):
    units = _gpt_units(LOOP)
    for r, res in enumerate(launched):
        for name in ("plain", "lora"):
            flat, pp = res["loop"][name, "flat"], res["loop"][name, "per_param"]
            worst = max_diff(pp["state"], flat["state"])
            print(f"zero3 loop ({name}), rank {r}: per_param vs flat {worst:.1e}")
            assert worst <= LOOP_ATOL
        for layout in fsdp_layouts.LAYOUTS:
            run = res["loop"]["plain", layout]
            want = fsdp_layouts.step_bytes(units, WORLD, layout, gathers=2 * LOOP.grad_accum)
            for step in run["comm"]:
                assert math.isclose(step["all_gather"]["bytes_sent"], want["all_gather"]), layout
                assert math.isclose(step["reduce_scatter"]["bytes_sent"],
                                    want["reduce_scatter"]), layout
    per_param, flat = (fsdp_layouts.padding(units, WORLD, k) for k in ("per_param", "flat"))
    print(f"padding entries at {WORLD} ranks: per_param {per_param}, flat {flat}")
    assert per_param > flat  # this model's rows do not cut evenly: the bytes differ
