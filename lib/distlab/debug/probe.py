"""What a rank measures each step for the debugging checks (RunConfig.diagnostics=True).

    probe.before_update(model, x)   after the gradient reduction: each weight matrix's gradient
                                    norm (the global batch's gradient), a copy of the weights,
                                    and a fingerprint of this rank's input rows
    fields = probe.after_update(model)
                                    after the optimizer step: each matrix's update/weight
                                    ratio ||dW|| / ||W|| and its unit spread; returns
                                    {"diag": {...}} for the step event ({} when off)

"Weight matrices" are the parameters with two or more dimensions (Linear weights, embedding
tables): the layers whose rows are units. Names drop the ".weight" suffix. The checks that
read these fields over a finished run are in distlab.debug.diagnose.
"""

from __future__ import annotations

import hashlib

import torch


def weight_matrices(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n.removesuffix(".weight"), p) for n, p in model.named_parameters()
            if p.dim() >= 2 and p.requires_grad]


def unit_spread(w: torch.Tensor) -> float:
    """How different a layer's units are: ||W - mean row|| / ||W|| over the rows (one row per
    output unit). 0 when every unit is the same, all-zero layers included; ~1 for a random
    init (the rows' mean is ~0); NaN for a layer with a NaN."""
    w = w.detach().float().reshape(w.shape[0], -1)
    total = float(w.norm())
    if total == 0:
        return 0.0
    return float((w - w.mean(0)).norm()) / total  # NaN for a NaN layer: not "identical"


def fingerprint(x: torch.Tensor) -> str:
    """16 hex digits naming these rows: equal on two ranks only if they read the same rows."""
    data = x.detach().cpu().contiguous().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


class Probe:
    def __init__(self, cfg):
        self.on = cfg.diagnostics
        self._before: list[torch.Tensor] = []
        self._fields: dict = {}

    @torch.no_grad()
    def before_update(self, model, x: torch.Tensor) -> None:
        if not self.on:
            return
        names, mats = zip(*weight_matrices(model))
        zeros = [torch.zeros(()) for _ in mats]
        grads = _norms([p.grad if p.grad is not None else z for p, z in zip(mats, zeros)])
        every = [p.grad for p in model.parameters() if p.grad is not None]
        total = float(torch.stack(_norms(every, as_float=False)).norm()) if every else 0.0
        self._before = [p.detach().clone() for p in mats]
        self._fields = {"grad_norm": dict(zip(names, grads)), "grad_norm_total": total,
                        "batch": fingerprint(x)}

    @torch.no_grad()
    def after_update(self, model) -> dict:
        if not self.on:
            return {}
        names, mats = zip(*weight_matrices(model))
        before = _norms(self._before)
        moved = _norms(torch._foreach_sub([p.detach() for p in mats], self._before))
        # an all-zero layer that does not move has ratio 0; one that moves, inf
        ratio = [m / b if b > 0 else (0.0 if m == 0 else float("inf"))
                 for m, b in zip(moved, before)]
        self._before = []
        return {"diag": {**self._fields, "update_ratio": dict(zip(names, ratio)),
                         "unit_spread": {n: unit_spread(p) for n, p in zip(names, mats)}}}


def _norms(tensors, as_float: bool = True):
    """L2 norm of each tensor, in one call (torch's foreach kernels, as clip_grad_norm_ uses:
    this runs every step, and one Python call per tensor cost ~2 ms a step here)."""
    norms = torch._foreach_norm([t.detach().float() for t in tensors])
    return torch.stack(norms).tolist() if as_float else norms
