"""Backward split in two, for the zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline
Parallelism", section 2): B computes the gradient of the stage's input, which the previous
stage is waiting for; W computes the weights' gradients, which nothing in the pipeline waits
for, so a schedule can run W later, in what would be a bubble.

    store = WeightGradStore()
    linears = split_weight_gradients(stage, store)   # the stage's nn.Linear layers
    with store.collecting((mb, chunk)):
        torch.autograd.backward(out, grad)           # B: input gradients only
    ...
    store.run((mb, chunk))                           # W: weight.grad += grad_outᵀ · input

Only nn.Linear weights move to W: their gradient is a matmul as large as the input's, the half
of backward worth moving. Biases (a sum over rows), LayerNorm's and the embeddings' parameters
keep their gradients in B, as in the paper's implementation, which splits the linear layers.
Until W runs, the layer's input and its output's gradient are held: a deferred W costs memory,
which `pending_bytes` counts.
"""

from __future__ import annotations

import types
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from distlab.units import storage_bytes


class WeightGradStore:
    """The W halves not yet run, by key (a micro-batch and chunk): for each, the (weight,
    input, output gradient) triples its B left."""

    def __init__(self):
        self.pending: dict[object, list[tuple]] = {}
        self.key = None  # the key B is collecting under; None: W runs at once (no split)

    @contextmanager
    def collecting(self, key):
        """Run a backward (B) whose linear layers leave their W under `key`."""
        if key in self.pending:
            raise RuntimeError(f"W of {key} is still pending: run it before a second B")
        self.key, self.pending[key] = key, []
        try:
            yield
        finally:
            self.key = None

    def put(self, weight, x, grad_out):
        if self.key is None:  # a backward outside collecting(): the whole gradient now
            _accumulate(weight, _weight_grad(x, grad_out))
        else:
            self.pending[self.key].append((weight, x, grad_out))

    def run(self, key):
        """W of `key`: every deferred weight gradient, added into weight.grad."""
        for weight, x, grad_out in self.pending.pop(key):
            _accumulate(weight, _weight_grad(x, grad_out))

    def pending_bytes(self) -> int:
        """Bytes held for W's not yet run (inputs and output gradients; storages counted
        once: an input shared by q, k and v is one tensor)."""
        return storage_bytes(t for triples in self.pending.values() for _, x, g in triples
                             for t in (x, g))


def _weight_grad(x, grad_out):
    """dL/dW of y = x·Wᵀ + b: grad_outᵀ · x over every row (all leading dims)."""
    return grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


def _accumulate(weight, g):
    weight.grad = g.to(weight.dtype) if weight.grad is None else weight.grad.add_(g)


class _LinearBW(torch.autograd.Function):
    """y = x·Wᵀ + b whose backward returns the input's (and the bias's) gradient and leaves the
    weight's to the store."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x)
        # the Parameter itself, not a saved copy: under saved_tensors_hooks (the pipeline
        # counts stashed bytes with them) an unpacked tensor is not the Parameter, and a
        # .grad set on it would be lost
        ctx.weight, ctx.store, ctx.has_bias = weight, store, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        (x,), weight = ctx.saved_tensors, ctx.weight
        grad_x = grad_out @ weight
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias else None
        ctx.store.put(weight, x, grad_out)
        return grad_x, None, grad_b, None


def _split_forward(self, x):
    if not torch.is_grad_enabled() or not self.weight.requires_grad:
        return F.linear(x, self.weight, self.bias)
    return _LinearBW.apply(x, self.weight, self.bias, self._distlab_w_store)


def split_weight_gradients(module: nn.Module, store: WeightGradStore) -> list[nn.Linear]:
    """Make every nn.Linear in `module` (exactly that class: a subclass may compute otherwise)
    leave its weight gradient in `store`. Returns the layers changed."""
    out = []
    for m in module.modules():
        if type(m) is nn.Linear and not hasattr(m, "_distlab_w_store"):
            m._distlab_w_store = store
            m.forward = types.MethodType(_split_forward, m)
            out.append(m)
    return out
