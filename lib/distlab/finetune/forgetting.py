"""Training on a second task: transfer, catastrophic forgetting, and two ways to forget less.

Transfer learning starts task 1 from weights trained on task 0 (RunConfig.init_from, a plain
state dict that `save_final` wrote). Whatever the tasks share is already learnt; but nothing in
task 1's loss asks the network to keep task 0's behaviour, so the weights task 0 needed drift
wherever task 1's gradient pushes them, and task-0 loss climbs back up: catastrophic forgetting
(McCloskey & Cohen 1989; French 1999). Here task k >= 1 is task 0's Markov chain with half its
rows redrawn (distlab.data.dataset.MarkovData), so the tasks share half their structure and conflict on
the other half.

What this module adds to the one training loop (distlab.rank.train), all opt-in by RunConfig:

* **Evaluation on both tasks** (eval_every=k): held-out loss on task 0 and on the run's task,
  before the first step, every k steps and after the last: the forgetting curve. Held-out rows
  come from a stream no training step reaches (MarkovData.eval_batch).
* **Replay** (replay=f): a buffer of REPLAY_BUFFER_ROWS task-0 rows, the rows the pre-training
  run saw at its first steps, is kept; every step, an evenly spread fraction f of the global
  batch's rows is replaced by rows drawn from it (Ratcliff 1990's rehearsal; Rolnick et al.
  2019, "Experience Replay for Continual Learning"). The gradient then keeps pulling towards
  task 0 too. The buffer and the draws depend only on (seed, step), so every rank and every
  world size sees the same global batch.
* **Elastic Weight Consolidation** (ewc_lambda=λ; Kirkpatrick et al. 2017, "Overcoming
  catastrophic forgetting in neural networks"): a quadratic pull of each trainable weight
  towards its value θ* at the start of fine-tuning (the task-0 solution), weighted by how much
  task 0's likelihood depends on it, the diagonal of the Fisher information F_i:

      L(θ) = L_task1(θ) + Σ_i (λ/2) · F_i · (θ_i − θ*_i)²        ∂/∂θ_i: λ · F_i · (θ_i − θ*_i)

  F is estimated once, at the start, as the mean over FISHER_ROWS task-0 sequences of the
  squared gradient of each sequence's mean-token negative log-likelihood (the empirical Fisher,
  one sequence per sample). The penalty's gradient is the same on every rank (every rank holds
  the same θ), so it is added to the reduced gradient, after the data-parallel all-reduce: no
  extra bytes on the wire, and the same update as one process.
* **init_from / save_final**: load a state dict before adapters and wrapping, with an error that
  names missing, unexpected and mis-shaped keys; write the trained model's (gathered, adapters
  merged) state dict at the end.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from distlab.data.dataset import MarkovData

# Held-out evaluation: EVAL_BATCHES batches of EVAL_ROWS rows per task.
EVAL_BATCHES, EVAL_ROWS = 4, 16
# Replay buffer: the first REPLAY_BUFFER_ROWS rows of task 0's training stream (its first steps).
REPLAY_BUFFER_ROWS = 256
# EWC: the Fisher diagonal is averaged over this many task-0 sequences (one backward each).
FISHER_ROWS = 64


# -- the files a fine-tuning run starts from and leaves ----------------------------------------
def load_init_from(model: torch.nn.Module, path: str) -> None:
    """Load a plain state dict (torch.load, weights_only=True) into `model`; every key and shape
    must match, and the error says which do not."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"init_from={path!r}: no such file (a state dict saved with "
                                "torch.save, e.g. by a run with save_final)")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"init_from={path!r} holds a {type(state).__name__}, not a state dict")
    own = model.state_dict()
    problems = []
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k} (file {tuple(state[k].shape)}, model {tuple(own[k].shape)})"
              for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    for what, keys in (("missing", missing), ("unexpected", unexpected),
                       ("shape mismatch", shapes)):
        if keys:
            problems.append(f"{what}: {', '.join(keys)}")
    if problems:
        raise ValueError(f"init_from={path!r} does not fit this model; " + "; ".join(problems))
    model.load_state_dict(state)


def save_final(path: str, strategy, model, comm) -> None:
    """Every rank gathers the full state dict (a collective for sharded strategies); rank 0
    writes it, adapters merged (distlab.finetune.lora.merged_state_dict), so init_from can load it into
    a model without adapters. A barrier makes the file visible to every rank before any goes
    on (a next config of the same launch may start from it)."""
    from distlab.finetune.lora import merged_state_dict

    state = strategy.full_state_dict(model)
    if comm.rank == 0:
        state = merged_state_dict(getattr(model, "module", model), state)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save({k: v.detach().cpu() for k, v in state.items()}, tmp)
        os.replace(tmp, path)
    comm.barrier()


# -- replay ------------------------------------------------------------------------------------
def replay_rows(batch: int, fraction: float) -> np.ndarray:
    """Indices of the rows a replay fraction replaces, spread evenly over the batch (so every
    data-parallel rank's block gets its share): row i when ⌊(i+1)m/B⌋ > ⌊im/B⌋, m = round(fB)."""
    m = round(fraction * batch)
    i = np.arange(batch)
    return i[(i + 1) * m // batch > i * m // batch]


class ReplayData:
    """The new task's batches with `fraction` of their rows from a buffer of the old task's
    training rows (module docstring). Same interface as MarkovData for the strategies."""

    def __init__(self, new: MarkovData, old: MarkovData, fraction: float, batch: int,
                 buffer_rows: int = REPLAY_BUFFER_ROWS):
        self.new, self.fraction, self.seed = new, fraction, new.seed
        steps = -(-buffer_rows // batch)
        rows = [old.global_batch(s, batch) for s in range(steps)]  # what pre-training saw
        self.buffer_x = torch.cat([r[0] for r in rows])[:buffer_rows]
        self.buffer_y = torch.cat([r[1] for r in rows])[:buffer_rows]
        self.loss_floor, self.loss_at_start = new.loss_floor, new.loss_at_start

    def global_batch(self, step: int, batch: int):
        x, y = (t.clone() for t in self.new.global_batch(step, batch))
        rows = replay_rows(batch, self.fraction)
        pick = np.random.default_rng([self.seed, 20, step]).integers(0, len(self.buffer_x),
                                                                     size=len(rows))
        x[rows], y[rows] = self.buffer_x[pick], self.buffer_y[pick]
        return x, y

    rank_batch = MarkovData.rank_batch  # the same disjoint blocks of the global batch


def task_data(cfg, task: int) -> MarkovData:
    return MarkovData(cfg.vocab_size, cfg.seq_len, cfg.successors, cfg.seed, task)


# -- EWC ---------------------------------------------------------------------------------------
def diagonal_fisher(model, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Empirical Fisher diagonal of the trainable parameters: mean over the rows of x of the
    squared gradient of that row's mean-token negative log-likelihood."""
    params = [p for p in model.parameters() if p.requires_grad]
    fisher = [torch.zeros_like(p) for p in params]
    for i in range(len(x)):
        grads = torch.autograd.grad(model(x[i:i + 1], y[i:i + 1]), params, allow_unused=True)
        for f, g in zip(fisher, grads):
            if g is not None:
                f.add_(g.detach() ** 2)
    return [f / len(x) for f in fisher]


class EWC:
    """The penalty (λ/2) Σ F_i (θ_i − θ*_i)² around the weights at the start (module docstring)."""

    def __init__(self, model, lam: float, x: torch.Tensor, y: torch.Tensor):
        self.lam = lam
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.fisher = diagonal_fisher(model, x, y)
        self.anchor = [p.detach().clone() for p in self.params]

    def add_gradient(self):
        """p.grad += λ F (θ − θ*), after the gradients were reduced (identical on every rank)."""
        with torch.no_grad():
            for p, f, a in zip(self.params, self.fisher, self.anchor):
                g = self.lam * f * (p - a)
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)

    def penalty(self) -> float:
        with torch.no_grad():
            return float(sum((f * (p - a) ** 2).sum() for p, f, a in
                             zip(self.params, self.fisher, self.anchor)) * self.lam / 2)


# -- what the training loop calls --------------------------------------------------------------
class FineTuning:
    """The loop's hooks (distlab.rank.train): `data` wraps the run's data with replay, `evaluate`
    logs "eval" events, `after_reduce` adds EWC's gradient, `finish` writes save_final. Built
    before the strategy wraps the model (EWC's Fisher and anchor need the plain model)."""

    def __init__(self, cfg, model, device):
        self.cfg, self.device = cfg, device
        self.ewc = None
        if cfg.ewc_lambda:
            x, y = self._buffer(task_data(cfg, 0), FISHER_ROWS)
            self.ewc = EWC(model, cfg.ewc_lambda, x.to(device), y.to(device))
        self.eval_sets = {}
        if cfg.eval_every:
            for t in sorted({0, cfg.task}):
                d = task_data(cfg, t)
                self.eval_sets[t] = [d.eval_batch(i, EVAL_ROWS) for i in range(EVAL_BATCHES)]

    def _buffer(self, data: MarkovData, rows: int):
        steps = -(-rows // self.cfg.global_batch)
        got = [data.global_batch(s, self.cfg.global_batch) for s in range(steps)]
        return torch.cat([g[0] for g in got])[:rows], torch.cat([g[1] for g in got])[:rows]

    def data(self, data):
        if not self.cfg.replay:
            return data
        return ReplayData(data, task_data(self.cfg, 0), self.cfg.replay, self.cfg.global_batch)

    def after_reduce(self):
        if self.ewc is not None:
            self.ewc.add_gradient()

    @torch.no_grad()
    def eval_losses(self, model) -> dict:
        """Mean held-out loss per task, {"task0": ..., "task1": ...}."""
        out = {}
        for t, batches in self.eval_sets.items():
            losses = [float(model(x.to(self.device), y.to(self.device))) for x, y in batches]
            out[f"task{t}"] = sum(losses) / len(losses)
        return out

    def evaluate(self, model, steps_done: int, log, comm):
        """An "eval" event after `steps_done` optimizer steps (0: before training), every
        eval_every steps and after the last. Every rank evaluates the same rows (zero3 gathers
        its units for it); the collectives this costs are logged here, not in the next step."""
        every = self.cfg.eval_every
        if not every or (steps_done % every and steps_done != self.cfg.steps):
            return
        comm.take_step_stats()
        loss = self.eval_losses(model)
        extra = {"ewc_penalty": self.ewc.penalty()} if self.ewc is not None else {}
        log.write("eval", step=steps_done, loss=loss, comm=comm.take_step_stats()[0], **extra)

    def finish(self, strategy, model, comm):
        if self.cfg.save_final:
            save_final(self.cfg.save_final, strategy, model, comm)
