"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti
et al. 2022), written from scratch on distlab.comm so every byte is counted by kind.

Every rank holds 1/t of each attention and MLP matrix and sees the WHOLE batch (dp_degree is 1:
`batch` returns the global batch on every rank). A block needs two collectives forward and two
backward, made by the paper's conjugate operators:

    f : identity forward, all-reduce backward      (enters a tensor-parallel region)
    g : all-reduce forward, identity backward      (leaves it)

With sequence parallelism (sp=True) the LayerNorms run on 1/t of the sequence, and f/g become

    g_sp (gather):         all-gather along T forward, reduce-scatter backward   (enters)
    g_sp_bar (scatter):    reduce-scatter along T forward, all-gather backward   (leaves)

An all-reduce is a reduce-scatter followed by an all-gather, so SP moves the same bytes and
stores 1/t of the LayerNorm activations.

Replicated modules (embeddings, LayerNorms, head) see identical inputs on every rank without SP,
so their gradients are identical on every rank and need no communication. With SP a LayerNorm
(and the bias of a row-parallel layer, added after the reduce-scatter) sees only this rank's
part of the sequence: its gradient is a partial sum, all-reduced in `reduce_gradients`.

The plan is data (`plan_table`, `tp_plan`): the model knows nothing about parallelism; `wrap`
replaces modules from outside by name.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from distlab.parallel.base import Strategy

KINDS = {"all_reduce": "tp.all_reduce", "all_gather": "sp.all_gather",
         "reduce_scatter": "sp.reduce_scatter", "grads": "sp.grad_all_reduce",
         "norm": "tp.grad_norm"}


# -- collectives along the sequence dimension (dim 1 of (B, T, d)) -----------------------------
def _all_reduce(comm, x):
    x = x.contiguous().clone()
    return comm.all_reduce_async(x, kind=KINDS["all_reduce"]).wait()


def _gather_seq(comm, x):
    """(B, T/t, d) on each rank -> (B, T, d), rank r's block at rows r·T/t."""
    x = x.contiguous()
    out = torch.empty(comm.world * x.numel(), dtype=x.dtype)
    comm.all_gather_async(out, x.view(-1), kind=KINDS["all_gather"]).wait()
    B, Tl, d = x.shape
    return out.view(comm.world, B, Tl, d).transpose(0, 1).reshape(B, comm.world * Tl, d)


def _reduce_scatter_seq(comm, x):
    """(B, T, d) partial sums on each rank -> this rank's (B, T/t, d) block of their sum."""
    B, T, d = x.shape
    t = comm.world
    blocks = x.reshape(B, t, T // t, d).transpose(0, 1).contiguous().view(-1)
    out = torch.empty(B * (T // t) * d, dtype=x.dtype)
    comm.reduce_scatter_async(out, blocks, kind=KINDS["reduce_scatter"]).wait()
    return out.view(B, T // t, d)


def _slice_seq(comm, x):
    Tl = x.shape[1] // comm.world
    return x[:, comm.rank * Tl:(comm.rank + 1) * Tl].contiguous()


# -- the paper's operators as autograd functions ----------------------------------------------
class F_Copy(torch.autograd.Function):
    """f: identity forward, all-reduce backward (each rank's input gradient is partial)."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, dy):
        return _all_reduce(ctx.comm, dy), None


class G_Reduce(torch.autograd.Function):
    """g: all-reduce forward (sum the partial outputs), identity backward."""
    @staticmethod
    def forward(ctx, x, comm):
        return _all_reduce(comm, x)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class GatherSeq(torch.autograd.Function):
    """g_sp: all-gather along the sequence forward, reduce-scatter backward."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _gather_seq(comm, x)

    @staticmethod
    def backward(ctx, dy):
        return _reduce_scatter_seq(ctx.comm, dy), None


class ReduceScatterSeq(torch.autograd.Function):
    """g_sp_bar: reduce-scatter along the sequence forward, all-gather backward."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _reduce_scatter_seq(comm, x)

    @staticmethod
    def backward(ctx, dy):
        return _gather_seq(ctx.comm, dy), None


class SplitSeq(torch.autograd.Function):
    """Enter the SP region from a replicated tensor (the embeddings' output): keep this rank's
    block forward; backward all-gathers, so every rank's embedding gradient is the full one."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _slice_seq(comm, x)

    @staticmethod
    def backward(ctx, dy):
        return _gather_seq(ctx.comm, dy), None


class GatherSeqToReplicated(torch.autograd.Function):
    """Leave the SP region for a replicated consumer (the head): all-gather forward; the
    gradient arriving is identical on every rank, so backward keeps this rank's block."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _gather_seq(comm, x)

    @staticmethod
    def backward(ctx, dy):
        return _slice_seq(ctx.comm, dy), None


# -- the layers --------------------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns (output features) across t ranks:

        X (B,T,in)  @  [ A_0 | A_1 | ... | A_t-1 ]  =  [ Y_0 | Y_1 | ... | Y_t-1 ]
                         in x out/t each                 rank r keeps Y_r (B,T,out/t)

    Each rank needs the whole X (the region's entry operator, f or g_sp, provides it) and owns
    b_r. Stored like nn.Linear: weight is (out/t, in), rows r·out/t ... (r+1)·out/t.
    For q, k, v the column blocks are whole heads: out/t = (n_head/t)·head_dim."""

    def __init__(self, linear: nn.Linear, rank: int, world: int):
        super().__init__()
        n = linear.out_features // world
        rows = slice(rank * n, (rank + 1) * n)
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = (nn.Parameter(linear.bias.detach()[rows].clone())
                     if linear.bias is not None else None)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows (input features) across t ranks:

                                 [ A_0   ]   in/t x out
        [ X_0 | X_1 | ... ]  @   [ A_1   ]              =  X_0 A_0 + X_1 A_1 + ...  (partial sums)
          rank r has X_r         [ ...   ]
                                 [ A_t-1 ]

    Rank r computes X_r A_r (B,T,out), a partial sum; `exit` (g: all-reduce, or g_sp_bar:
    reduce-scatter along T) sums them; then the replicated bias is added once.
    Stored like nn.Linear: weight is (out, in/t), columns r·in/t ... (r+1)·in/t."""

    def __init__(self, linear: nn.Linear, rank: int, world: int, exit):
        super().__init__()
        n = linear.in_features // world
        self.weight = nn.Parameter(linear.weight.detach()[:, rank * n:(rank + 1) * n].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None
        self.exit = exit

    def forward(self, x):
        y = self.exit(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


# -- the plan: module name -> style ------------------------------------------------------------
def plan_table(n_layer: int, sp: bool = False) -> dict:
    """Which module gets which treatment, by name (torchtitan-style). Styles:
    colwise / rowwise: replaced by Column/RowParallelLinear; region: its input passes the
    entry operator (f, or g_sp with sp) once, shared by q, k, v (or fc); sequence: replicated
    weights on a sequence-sharded input (sp only; gradient all-reduced); scatter_seq /
    gather_seq: where the residual stream enters / leaves the SP region. Modules not named
    (tok_emb, pos_emb, and without sp ln1, ln2, ln_f, head) stay replicated."""
    plan = {}
    for i in range(n_layer):
        b = f"blocks.{i}"
        if sp:
            plan[f"{b}.ln1"] = "sequence"
        plan[f"{b}.attn"] = "region"
        plan |= {f"{b}.attn.{n}": "colwise" for n in "qkv"}
        plan[f"{b}.attn.o"] = "rowwise"
        if sp:
            plan[f"{b}.ln2"] = "sequence"
        plan[f"{b}.mlp"] = "region"
        plan[f"{b}.mlp.fc"] = "colwise"
        plan[f"{b}.mlp.proj"] = "rowwise"
    if sp:
        plan = {"blocks.0": "scatter_seq", **plan, "ln_f": "sequence", "head": "gather_seq"}
    return plan


def tp_plan(model, tp: int, sp: bool = False) -> list:
    """The plan as rows a notebook can show: (module, style, full shape, this rank's shape)."""
    rows = []
    for name, style in plan_table(len(model.blocks), sp).items():
        m = model.get_submodule(name)
        full = tuple(m.weight.shape) if hasattr(m, "weight") and m.weight is not None else None
        local = full
        if style == "colwise":
            local = (full[0] // tp, full[1])
        elif style == "rowwise":
            local = (full[0], full[1] // tp)
        rows.append((name, style, full, local))
    return rows


class TensorParallel(Strategy):
    """`tp`: Megatron tensor parallelism over all ranks (tp = world), optional sp."""
    name = "tp"
    any_model = False  # distlab's GPT only (Strategy.any_model)
    degrees = frozenset({"tp"})
    supports = Strategy.supports | {"sp"}

    def __init__(self, cfg, comm):
        super().__init__(cfg, comm)
        self.sp = cfg.sp
        self.seq_parallel_params: list = []  # sp: gradients that are partial sums

    def wrap(self, model):
        comm, r, t, sp = self.comm, self.rank, self.world, self.sp
        plan = plan_table(len(model.blocks), sp)
        # every rank built the same full model from cfg.seed; each keeps its slice of it
        for name, style in plan.items():
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            m = getattr(parent, child)
            if style == "colwise":
                setattr(parent, child, ColumnParallelLinear(m, r, t))
            elif style == "rowwise":
                exit = ((lambda y: ReduceScatterSeq.apply(y, comm)) if sp
                        else (lambda y: G_Reduce.apply(y, comm)))
                new = RowParallelLinear(m, r, t, exit)
                setattr(parent, child, new)
                if sp and new.bias is not None:
                    self.seq_parallel_params.append(new.bias)
            elif style == "region":
                op = GatherSeq if sp else F_Copy
                m.register_forward_pre_hook(lambda mod, args, op=op: (op.apply(args[0], comm),))
            elif style == "sequence":
                self.seq_parallel_params.extend(m.parameters())
            elif style == "scatter_seq":
                m.register_forward_pre_hook(lambda mod, args: (SplitSeq.apply(args[0], comm),))
            elif style == "gather_seq":
                m.register_forward_pre_hook(
                    lambda mod, args: (GatherSeqToReplicated.apply(args[0], comm),))
        self.plan = plan
        self.sharded = {n: s for n, s in plan.items() if s in ("colwise", "rowwise")}
        return model

    def after_model_split(self, model) -> None:
        """Forget the split modules a pipeline stage no longer holds (3d)."""
        def present(name):
            try:
                model.get_submodule(name)
                return True
            except AttributeError:
                return False
        self.sharded = {n: s for n, s in self.sharded.items() if present(n)}

    def batch(self, data, step: int):
        # dp_degree is 1: every tensor-parallel rank computes on the whole global batch
        return data.global_batch(step, self.cfg.global_batch)

    def reduce_gradients(self, model):
        """sp only: LayerNorm weights and row-parallel biases saw 1/t of the sequence each;
        their gradients are summed across the group in one coalesced all-reduce."""
        grads = [p.grad for p in self.seq_parallel_params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.comm.all_reduce_async(flat, kind=KINDS["grads"]).wait()
        i = 0
        for g in grads:
            g.copy_(flat[i:i + g.numel()].view_as(g))
            i += g.numel()

    def clip_gradients(self, model, max_norm: float) -> float:
        """Global norm: squares of the sharded gradients summed across ranks, the replicated
        ones (identical on every rank after reduce_gradients) counted once."""
        sharded_ids = set()
        for name, style in self.sharded.items():
            m = model.get_submodule(name)
            sharded_ids.add(id(m.weight))
            if style == "colwise" and m.bias is not None:
                sharded_ids.add(id(m.bias))
        sq_sh = torch.zeros(1)
        sq_rep = torch.zeros(1)
        for p in model.parameters():
            if p.grad is not None:
                (sq_sh if id(p) in sharded_ids else sq_rep).add_(p.grad.pow(2).sum())
        self.comm.all_reduce_async(sq_sh, kind=KINDS["norm"]).wait()
        norm = float((sq_sh + sq_rep).sqrt())
        scale = max_norm / (norm + 1e-6)
        if scale < 1:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm

    def full_state_dict(self, model) -> dict:
        """The unsharded weights under the names `single` uses (a collective: every rank)."""
        sd = dict(model.state_dict())
        for name, style in self.sharded.items():
            m = model.get_submodule(name)
            for pname, p in m.named_parameters():
                if style == "rowwise" and pname == "bias":
                    continue  # replicated
                x = p.detach().contiguous()
                out = torch.empty(self.world * x.numel(), dtype=x.dtype)
                self.comm.all_gather(out, x.view(-1))
                parts = out.view(self.world, *x.shape)
                full = (torch.cat(list(parts), dim=0) if style == "colwise"
                        else torch.cat(list(parts), dim=-1))
                sd[f"{name}.{pname}"] = full
        return sd
