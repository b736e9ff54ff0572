"""Exercises: Megatron's column- and row-parallel linear layers (Shoeybi et al. 2019).

    def column_parallel(x, weight, bias):
        # weight: this rank's rows of the full (out, in) weight (out/N of them), bias its
        # out/N entries. x: the whole input (B, in). Return this rank's block of the output
        # columns (B, out/N). No communication.

    def row_parallel(x, weight, bias, all_reduce):
        # x: this rank's block of the input features (B, in/N), the output of a column-
        # parallel layer (and an elementwise activation); weight: this rank's columns of the
        # full (out, in) weight, (out, in/N); bias: the whole (out,) bias. Return the whole
        # output (B, out) on every rank. all_reduce(t) sums t over the ranks in place.

An MLP is column-parallel then row-parallel: the hidden layer never needs gathering, and
one all-reduce of the output per forward joins the ranks' partial sums.

The check: 2 ranks, an MLP 16 -> 64 -> 16 with GELU between, a batch of 8; each function
against one process's (tolerance 1e-5: float32, the row split sums its partial products in
another order), and for row_parallel the one all-reduce of the output's bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distlab.exercises.harness import load, run_exercise

WORLD, D, H, ROWS = 2, 16, 64, 8


def column_parallel(x, weight, bias):
    return F.linear(x, weight, bias)


def row_parallel(x, weight, bias, all_reduce):
    partial = F.linear(x, weight)  # this rank's share of every output: no bias yet
    all_reduce(partial)
    return partial + bias  # once, after the sum (added on every rank it would count N times)


def _mlp():
    g = torch.Generator().manual_seed(3)
    return (torch.randn(H, D, generator=g) / 4, torch.randn(H, generator=g) / 4,
            torch.randn(D, H, generator=g) / 8, torch.randn(D, generator=g) / 4,
            torch.randn(ROWS, D, generator=g))


def _on_rank(rank, world, name, source, which):
    import torch.distributed as dist
    fn = load(name, source)
    w1, b1, w2, b2, x = _mlp()
    cols = slice(rank * H // world, (rank + 1) * H // world)
    hidden = F.gelu(F.linear(x, w1, b1))
    calls = []

    def all_reduce(t):
        calls.append(t.numel() * t.element_size())
        dist.all_reduce(t)

    if which == "column":
        got, want = fn(x, w1[cols], b1[cols]), F.linear(x, w1, b1)[:, cols]
    else:
        got = fn(hidden[:, cols], w2[:, cols], b2, all_reduce)
        want = F.linear(hidden, w2, b2)
    problems = []
    if not torch.is_tensor(got) or got.shape != want.shape:
        shape = tuple(got.shape) if torch.is_tensor(got) else type(got).__name__
        problems.append(f"returned {shape}; expected shape {tuple(want.shape)}")
        return {"problems": problems, "facts": []}
    diff = (got - want).abs().max().item()
    if diff > 1e-5:
        hint = (" (the bias added before the all-reduce counts it N times?)"
                if which == "row" and (got - want - (world - 1) * b2).abs().max() < 1e-5
                else "")
        problems.append(f"the output is off by up to {diff:.3g}{hint}")
    facts = [f"output equals one process's (max |diff| {diff:.1e})"]
    if which == "row":
        out_bytes = want.numel() * 4
        if calls != [out_bytes]:
            problems.append(f"all-reduces of {calls} B: one, of the output ({out_bytes:,} B)")
        facts.append(f"one all-reduce of the {out_bytes:,} B output: each rank sent "
                     f"{2 * (world - 1) * out_bytes // world:,} B on a ring")
    elif calls:
        problems.append("a column-parallel layer needs no communication")
    return {"problems": problems, "facts": facts}


def on_rank_column(rank, world, device, log, name, source):
    return _on_rank(rank, world, name, source, "column")


def on_rank_row(rank, world, device, log, name, source):
    return _on_rank(rank, world, name, source, "row")


def check_column(fn, timeout_s: float = 20.0):
    return run_exercise("column-parallel linear", on_rank_column, fn, WORLD, timeout_s=timeout_s)


def check_row(fn, timeout_s: float = 20.0):
    return run_exercise("row-parallel linear", on_rank_row, fn, WORLD, timeout_s=timeout_s)
