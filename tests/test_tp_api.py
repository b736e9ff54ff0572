"""distlab.parallelize_module (Megatron tensor parallelism, optional sequence parallelism) on
models the tests define, outside distlab's training loop: an MLP (a replicated layer, then a
column- and a row-parallel one) and a small pre-norm transformer (replicated input layer, two
blocks of LayerNorm + attention + MLP, final LayerNorm and head), without and with sequence
parallelism. Each on 2 ranks, SGD and AdamW, a few steps: the loss and the gathered
parameters against one process on the same global batch (every TP rank feeds the whole
batch), and against torch's DTensor parallelize_module with the same plan in torch's styles;
the partial gradients of sequence-parallel LayerNorms are complete when backward returns; the
guard rails' messages.

Launches: one of 2 ranks runs every case (ours, torch's, the guard rails); torchrun runs
docs/your_model.md's snippet. The single-process reference runs in this process.

Tolerance: ATOL = 1e-5 on parameters after STEPS steps and on each step's loss, float32.
Against one process only the summation order differs (a layer's output as the sum of two
partial products, all-reduced): a few float32 ulps per step; AdamW divides by sqrt(v), which
can scale such a difference up where a gradient is near 0 in its first steps. Measured on
torch 2.13 CPU with gloo, 4 steps, over every case and rank (printed by the tests): vs one
process at most 1.6e-7 on parameters (tiny, AdamW), 1.8e-7 on losses, 2.2e-8 on the
sequence-parallel LayerNorms' gradients when backward returns; vs torch's DTensor TP at most
1.2e-7 on parameters and 1.8e-7 on losses: 55x under ATOL or more, and the inputs are seeded,
so the figures repeat. A LayerNorm gradient from half the sequence, what a missing
all-reduce of SP's partial gradients leaves, is off by far more (printed by
test_sequence_parallel_is_not_a_no_op).
"""


import pytest
import torch
import torch.nn.functional as F
from api_models import max_diff
from torch import nn

import distlab
from distlab import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    full_state_dict,
    parallelize_module,
    run_ranks,
)

ATOL = 1e-5
STEPS = 4
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
              "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01, "foreach": False})}


# -- the models ----------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.fc1, self.fc2 = nn.Linear(6, 6), nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(torch.tanh(self.pre(x)))))


class Attention(nn.Module):
    """nanoGPT's shape: the sequence length from its input, heads from the projection's
    width (view(B, T, -1, head_dim)), so a rank holding half the columns holds half the heads.
    k has no bias: softmax ignores it, so its gradient is 0 up to rounding, which AdamW
    divides by its own square root into steps of ±lr (measured: 6.8e-3 apart after 4 steps)."""

    def __init__(self, d, n_head):
        super().__init__()
        self.q, self.v, self.o = (nn.Linear(d, d) for _ in range(3))
        self.k = nn.Linear(d, d, bias=False)
        self.head_dim = d // n_head

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, d=8, n_head=2):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d, n_head), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Tiny(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def data(name, step):
    g = torch.Generator().manual_seed(step)
    if name == "mlp":
        return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    return torch.randn(4, 4, 5, generator=g), torch.randn(4, 4, 3, generator=g)  # (B, T, .)


def make(name):
    torch.manual_seed(0)
    return MLP() if name == "mlp" else Tiny()


# -- the plans: ours, and the same in torch's styles ------------------------------------------
def plan(name, sp=False):
    if name == "mlp":
        return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    out = "sequence" if sp else "replicate"
    p = {"blocks.*.attn.[qkv]": ColwiseParallel(), "blocks.*.mlp.0": ColwiseParallel(),
         "blocks.*.attn.o": RowwiseParallel(output_layout=out),
         "blocks.*.mlp.2": RowwiseParallel(output_layout=out)}
    if sp:  # the residual stream sharded along the sequence between the blocks' TP regions
        p |= {"blocks.0": PrepareModuleInput("replicate", "sequence"),
              "blocks.*.ln[12]": SequenceParallel(), "ln_f": SequenceParallel(),
              "blocks.*.attn": PrepareModuleInput("sequence", "replicate"),
              "blocks.*.mlp": PrepareModuleInput("sequence", "replicate"),
              "head": PrepareModuleInput("sequence", "replicate", use_local_output=True)}
    return p


def torch_plan(name, sp=False):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as tp
    if name == "mlp":
        return {"fc1": tp.ColwiseParallel(), "fc2": tp.RowwiseParallel()}
    row = tp.RowwiseParallel(output_layouts=Shard(1)) if sp else tp.RowwiseParallel()
    p = {"blocks.*.attn.[qkv]": tp.ColwiseParallel(), "blocks.*.mlp.0": tp.ColwiseParallel(),
         "blocks.*.attn.o": row, "blocks.*.mlp.2": row}
    if sp:
        gather = tp.PrepareModuleInput(input_layouts=(Shard(1),),
                                       desired_input_layouts=(Replicate(),))
        p |= {"blocks.0": tp.PrepareModuleInput(input_layouts=(Replicate(),),
                                                desired_input_layouts=(Shard(1),),
                                                use_local_output=True),
              "blocks.*.ln[12]": tp.SequenceParallel(), "ln_f": tp.SequenceParallel(),
              "blocks.*.attn": gather, "blocks.*.mlp": gather,
              "head": tp.PrepareModuleInput(input_layouts=(Shard(1),),
                                            desired_input_layouts=(Replicate(),),
                                            use_local_output=True)}
    return p


CASES = [("mlp", False), ("tiny", False), ("tiny", True)]
LABEL = {("mlp", False): "mlp", ("tiny", False): "tiny", ("tiny", True): "tiny sp"}


# -- training --------------------------------------------------------------------------------
def train(name, model, opt, first_grads=None):
    """STEPS steps on the whole global batch; the replicated parameters' gradients right
    after the first backward (nothing called in between)."""
    losses = []
    for step in range(STEPS):
        x, y = data(name, step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if step == 0 and first_grads is not None:
            first_grads.update({k: p.grad.clone() for k, p in model.named_parameters()
                                if "ln" in k})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def single(name, opt_name):
    cls, kw = OPTIMIZERS[opt_name]
    model = make(name)
    grads = {}
    losses = train(name, model, cls(model.parameters(), **kw), grads)
    return {"losses": losses, "state": model.state_dict(), "grads": grads}


def ours(name, sp, opt_name):
    cls, kw = OPTIMIZERS[opt_name]
    model = parallelize_module(make(name), plan(name, sp))
    grads = {}
    losses = train(name, model, cls(model.parameters(), **kw), grads)
    return {"losses": losses, "state": full_state_dict(model), "grads": grads}


def torchs(name, sp, opt_name):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize
    cls, kw = OPTIMIZERS[opt_name]
    mesh = init_device_mesh("cpu", (2,))
    model = torch_parallelize(make(name), mesh, torch_plan(name, sp))
    ps = list(model.parameters())  # DTensors and plain tensors in separate groups
    groups = [{"params": [p for p in ps if isinstance(p, DTensor)]},
              {"params": [p for p in ps if not isinstance(p, DTensor)]}]
    losses = train(name, model, cls([g for g in groups if g["params"]], **kw))
    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v)
             for k, v in model.state_dict().items()}
    return {"losses": losses, "state": state}


def _error(fn) -> str:
    try:
        fn()
    except (RuntimeError, ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def guard_rails():
    out = {"no match": _error(lambda: parallelize_module(MLP(), {"fc9": ColwiseParallel()})),
           "colwise on a norm": _error(lambda: parallelize_module(
               Tiny(), {"ln_f": ColwiseParallel()})),
           "sequence on a linear": _error(lambda: parallelize_module(
               MLP(), {"fc1": SequenceParallel()})),
           "not divisible": _error(lambda: parallelize_module(
               MLP(), {"fc2": ColwiseParallel()})),  # out_features 3 on 2 ranks
           "two styles": _error(lambda: parallelize_module(
               Tiny(), {"blocks.*.attn.q": ColwiseParallel(),
                        "blocks.0.attn.*": ColwiseParallel()})),
           "torch style": _error(lambda: parallelize_module(MLP(), {"fc1": 3})),
           "unknown HF style": _error(lambda: parallelize_module(
               MLP(), {"fc1": "colwise_rep"})),
           "one part": _error(lambda: ColwiseParallel(parts=1)),
           "parts do not add up": _error(lambda: parallelize_module(
               MLP(), {"fc1": ColwiseParallel(parts=(8, 6))})),
           "a part not divisible": _error(lambda: parallelize_module(
               MLP(), {"fc1": ColwiseParallel(parts=(9, 7))}))}
    model = parallelize_module(MLP(), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    out["twice"] = _error(lambda: parallelize_module(model, {"pre": ColwiseParallel()}))
    rowwise_alone = parallelize_module(MLP(), {"fc2": RowwiseParallel()})
    out["rowwise without colwise"] = _error(lambda: rowwise_alone(torch.randn(2, 6)))
    sp = parallelize_module(Tiny(), plan("tiny", sp=True))
    out["sequence not divisible"] = _error(lambda: sp(torch.randn(2, 3, 5)))
    early = MLP()
    opt = torch.optim.SGD(early.parameters(), lr=0.1)  # before parallelize_module: stale
    parallelize_module(early, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    out["optimizer built before"] = _error(opt.step)
    out["optimizer built after"] = _error(torch.optim.SGD(early.parameters(), lr=0.1).step)
    return out


def two_ranks(rank, world, device, log):
    out = {}
    for name, sp in CASES:
        for opt_name in OPTIMIZERS:
            out[LABEL[name, sp], opt_name] = {"ours": ours(name, sp, opt_name),
                                              "torch": torchs(name, sp, opt_name)}
    out["guard rails"] = guard_rails()
    return out


# -- the tests ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def launched():
    return run_ranks(two_ranks, 2, timeout_s=120)


IDS = [(LABEL[c], o) for c in CASES for o in OPTIMIZERS]


@pytest.mark.parametrize("label,opt_name", IDS)
def test_equal_to_one_process(launched, label, opt_name):
    name, sp = next(c for c in CASES if LABEL[c] == label)
    ref = single(name, opt_name)
    for r, res in enumerate(launched):
        got = res[label, opt_name]["ours"]
        state = max_diff(got["state"], ref["state"])
        loss = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
        grads = max_diff(got["grads"], ref["grads"]) if ref["grads"] else 0.0
        print(f"{label}, {opt_name}, rank {r}: vs one process: parameters after {STEPS} steps "
              f"{state:.1e}, losses {loss:.1e}, LayerNorm gradients at backward's return "
              f"{grads:.1e}")
        assert state <= ATOL and loss <= ATOL and grads <= ATOL


@pytest.mark.parametrize("label,opt_name", IDS)
def test_equal_to_torch_dtensor_parallelize_module(launched, label, opt_name):
    for r, res in enumerate(launched):
        got, theirs = res[label, opt_name]["ours"], res[label, opt_name]["torch"]
        state = max_diff(got["state"], theirs["state"])
        loss = max(abs(a - b) for a, b in zip(got["losses"], theirs["losses"]))
        print(f"{label}, {opt_name}, rank {r}: vs torch parallelize_module: parameters "
              f"{state:.1e}, losses {loss:.1e}")
        assert state <= ATOL and loss <= ATOL


def test_sequence_parallel_is_not_a_no_op(launched):
    # without the all-reduce of the LayerNorms' partial gradients the run drifts: the check
    # above has teeth (each rank's LayerNorm gradient alone is far from the whole one)
    ref = single("tiny", "sgd")["grads"]
    model = make("tiny")
    x, y = data("tiny", 0)
    F.mse_loss(model(x[:, :2]), y[:, :2]).backward()  # what rank 0's LayerNorms see, roughly
    off = max((model.get_parameter(k).grad - g).abs().max().item() for k, g in ref.items())
    print(f"a LayerNorm gradient from half the sequence is off by {off:.1e}")
    assert off > 100 * ATOL


def test_guard_rails_say_what_to_do(launched):
    m = launched[0]["guard rails"]
    assert m["no match"].startswith("ValueError: plan entry 'fc9' matches no module")
    assert "pre, fc1, fc2" in m["no match"]
    assert m["colwise on a norm"].startswith("TypeError: ColwiseParallel applies to nn.Linear")
    assert "SequenceParallel" in m["colwise on a norm"]
    assert m["sequence on a linear"].startswith("TypeError: SequenceParallel applies to")
    assert "out_features=3 is not divisible by the group's 2 ranks" in m["not divisible"]
    assert "matches plan entries" in m["two styles"]
    assert "not a distlab style" in m["torch style"]
    assert "of Hugging Face's style names distlab takes 'colwise'" in m["unknown HF style"]
    assert m["one part"].startswith("ValueError: parts=1: the number of equal parts")
    assert "add up to 14, not its out_features=16" in m["parts do not add up"]
    assert "each width must be divisible by 2" in m["a part not divisible"]
    assert "already tensor-parallel" in m["twice"] and "call it once" in m["twice"]
    assert "put ColwiseParallel on the linear layer that feeds it" in \
        m["rowwise without colwise"]
    assert "length 3 is not divisible by 2" in m["sequence not divisible"]
    # before the check this trained nothing, silently (losses = the untrained model's)
    assert "named 'fc1.weight'" in m["optimizer built before"]
    assert "Build the optimizer after parallelize_module" in m["optimizer built before"]
    assert m["optimizer built after"] == "no error"


def test_exported():
    assert distlab.parallelize_module is parallelize_module
