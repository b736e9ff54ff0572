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
read these fields over a finished run are in distlab.diagnose.
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
        self._before: dict[str, torch.Tensor] = {}
        self._fields: dict = {}

    @torch.no_grad()
    def before_update(self, model, x: torch.Tensor) -> None:
        if not self.on:
            return
        mats = weight_matrices(model)
        grads = {n: float(p.grad.norm()) if p.grad is not None else 0.0 for n, p in mats}
        every = [p.grad.detach().float().norm() for p in model.parameters()
                 if p.grad is not None]
        total = float(torch.stack(every).norm()) if every else 0.0
        self._before = {n: p.detach().clone() for n, p in mats}
        self._fields = {"grad_norm": grads, "grad_norm_total": total, "batch": fingerprint(x)}

    @torch.no_grad()
    def after_update(self, model) -> dict:
        if not self.on:
            return {}
        ratio, spread = {}, {}
        for n, p in weight_matrices(model):
            norm = float(self._before[n].norm())
            step = float((p.detach() - self._before[n]).norm())
            # an all-zero layer that does not move has ratio 0; one that moves, inf
            ratio[n] = step / norm if norm > 0 else (0.0 if step == 0 else float("inf"))
            spread[n] = unit_spread(p)
        self._before = {}
        return {"diag": {**self._fields, "update_ratio": ratio, "unit_spread": spread}}
