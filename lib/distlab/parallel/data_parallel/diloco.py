"""Local SGD and DiLoCo: each rank trains alone for H steps, then the ranks average once.

Across a slow link, DDP pays for the whole gradient every step. Infrequent averaging pays for
the whole model once every H steps instead (H = RunConfig.sync_every):

    inner:  H optimizer steps on this rank's rows alone (RunConfig's optimizer: SGD or AdamW),
            no communication at all
    outer:  Δ = θ_global − θ_rank           the "pseudo-gradient": how far this rank moved
            Δ̄ = (1/N) Σ_r Δ_r               one all-reduce of the whole model
            θ_global ← OuterSGD(θ_global, Δ̄) plain SGD with Nesterov momentum
            θ_rank   ← θ_global             every rank starts the next H steps from the same point

With outer_lr = 1 and outer_momentum = 0 the outer step is θ_global − Δ̄ = the mean of the ranks'
parameters: periodic model averaging, local SGD (Stich 2019, "Local SGD Converges Fast and
Communicates Little"; Lin et al. 2020, "Don't Use Large Mini-Batches, Use Local SGD"), what
torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager does. With H = 1 and
inner SGD, averaging the ranks' parameters after one step each is averaging their gradients: the
run is DDP's. DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of
Language Models") uses inner AdamW and an outer Nesterov step with lr 0.7, momentum 0.9, H = 500.

Bytes per rank: 2(N−1)/N × the model's bytes every H steps (a ring all-reduce of one flat buffer),
against DDP's 2(N−1)/N × the gradients every step: H times fewer. The price is that the ranks
drift apart between averages; the loss a rank logs is its own replica's on its own rows.

Buffers (BatchNorm's running statistics) are not averaged: each rank keeps its own. A step that
loss scaling would skip on one rank and not on another would put the ranks out of step, so loss
scaling is not offered (fp16 is refused; bf16 and fp32 need none).
"""

from __future__ import annotations

import torch

from distlab.parallel.base import Strategy


class DiLoCo(Strategy):
    name = "diloco"
    knobs = frozenset({"sync_every", "outer_lr", "outer_momentum"})
    supports = frozenset({"grad_clip"})  # each rank clips its own gradient
    replicated = True  # every rank holds the whole model, its gradients and optimizer state

    @classmethod
    def check_config(cls, cfg):
        if not isinstance(cfg.sync_every, int) or cfg.sync_every < 1:
            raise ValueError(f"sync_every={cfg.sync_every!r} must be an integer >= 1 (inner "
                             "steps between two averages)")
        if not cfg.outer_lr > 0 or not 0 <= cfg.outer_momentum < 1:
            raise ValueError(f"outer_lr={cfg.outer_lr} must be > 0 and outer_momentum="
                             f"{cfg.outer_momentum} in [0, 1)")
        if cfg.grad_accum != 1:
            raise ValueError(f"grad_accum={cfg.grad_accum}: diloco's ranks never exchange "
                             "gradients, so accumulation changes nothing a larger local batch "
                             "would not; use grad_accum=1")

    def wrap(self, model):
        with torch.no_grad():  # every replica starts from rank 0's state
            self.comm.broadcast_tensors(
                [t.data for t in list(model.parameters()) + list(model.buffers())], src=0)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.anchor = [p.detach().clone() for p in self.params]  # θ_global
        m = self.cfg.outer_momentum
        self.outer = torch.optim.SGD(self.anchor, lr=self.cfg.outer_lr, momentum=m,
                                     nesterov=m > 0)
        self._step, self._info = 0, {}
        return model

    def batch(self, data, step):
        self._step = step
        return super().batch(data, step)

    def optimizer_step(self, optimizer):
        optimizer.step()
        last = self._step + 1 == self.cfg.steps  # the run ends on an average: one model
        synced = (self._step + 1) % self.cfg.sync_every == 0 or last
        self._info = {"synced": synced}
        if synced:
            self._info["pseudo_grad_norm"] = self.outer_step()

    @torch.no_grad()
    def outer_step(self) -> float:
        """Average the pseudo-gradients, take the outer step, restart every rank from it.
        Returns |Δ̄|, the averaged pseudo-gradient's norm."""
        delta = torch.cat([(a - p).flatten() for a, p in zip(self.anchor, self.params)])
        self.comm.all_reduce(delta, op="avg")  # one flat buffer: one call, the ring's bytes
        offset = 0
        for a in self.anchor:
            a.grad = delta[offset:offset + a.numel()].view_as(a)
            offset += a.numel()
        self.outer.step()
        for a, p in zip(self.anchor, self.params):
            p.copy_(a)
        return float(delta.norm())

    def state_bytes(self, model, optimizer) -> dict:
        """The inner model states, plus the outer optimizer's under "optim": θ_global and, with
        outer momentum, its buffer (each the model's size)."""
        held = super().state_bytes(model, optimizer)
        outer = list(self.anchor) + [v for st in self.outer.state.values() for v in st.values()
                                     if torch.is_tensor(v)]
        held["optim"] = held.get("optim", 0) + sum(t.numel() * t.element_size() for t in outer)
        return held

    def step_info(self) -> dict:
        return {"diloco": self._info}
