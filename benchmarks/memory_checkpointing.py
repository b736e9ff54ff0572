"""Activation checkpointing: bytes saved (measured and by formula) and recompute time paid;
and what the peak tracker costs.

    .venv/bin/python benchmarks/memory_checkpointing.py [--steps 30] [--threads 1]
        [--n-embd 128] [--n-layer 4] [--seq-len 64] [--batch 16]

One process, no launch: the default RunConfig's GPT (4 layers, n_embd 128, 16 rows of 64
tokens, AdamW; the flags change it) trains one model per mode, the modes taking turns step by
step (none, selective, full, none, ...) so drift in the machine's load falls on all alike; the
first steps are dropped. Per mode it prints:

  activations  ActivationMeter's bytes kept for backward, beside
               distlab.theory.estimate.gpt_activation_bytes (they must be equal)
  peak         PeakMemoryTracker's peak bytes allocated in a step (aten allocations; params,
               grads, optimizer state and the transient tensors of backward included)
  step ms      median step time, and its ratio to no checkpointing: the recompute cost

then the peak tracker's own cost: the median step time without checkpointing with the tracker
off, with a bare TorchDispatchMode (the price of any Python dispatch mode), and with the
tracker on, again taking turns.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distlab import RunConfig
from distlab.data.dataset import make_data
from distlab.theory.estimate import gpt_activation_bytes
from distlab.units import MiB
from distlab.memory import ActivationMeter, PeakMemoryTracker
from distlab.rank.build import build_model, build_optimizer

MODES = ("none", "selective", "full")


class _Bare(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Trainer:
    def __init__(self, cfg):
        torch.manual_seed(cfg.seed)
        self.cfg, self.model = cfg, build_model(cfg)
        self.opt = build_optimizer(cfg, self.model.parameters())
        self.data = make_data(cfg)
        self.meter = ActivationMeter(self.model)
        self.tracker = PeakMemoryTracker()
        self.tracker.adopt(self.model.parameters())
        self.times, self.peaks = [], []

    def step(self, i, mode_ctx=None, track=True):
        x, y = self.data.rank_batch(i, self.cfg.global_batch, 0, 1)
        t0 = time.perf_counter()
        if track:
            self.tracker.step_begin(x, y)
        if mode_ctx is not None:
            mode_ctx.__enter__()
        with self.meter.measure():
            loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        if mode_ctx is not None:
            mode_ctx.__exit__(None, None, None)
        if track:
            self.peaks.append(self.tracker.step_end())
        self.times.append(time.perf_counter() - t0)
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (ranks use 1)")
    ap.add_argument("--n-embd", type=int, default=RunConfig.n_embd)
    ap.add_argument("--n-layer", type=int, default=RunConfig.n_layer)
    ap.add_argument("--seq-len", type=int, default=RunConfig.seq_len)
    ap.add_argument("--batch", type=int, default=RunConfig.global_batch)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = RunConfig(n_embd=args.n_embd, n_layer=args.n_layer, seq_len=args.seq_len,
                     global_batch=args.batch)

    # 1. checkpointing modes, taking turns step by step (tracker off for the timing)
    trainers = {m: _Trainer(base.replace(checkpointing=m)) for m in MODES}
    for i in range(args.steps):
        losses = {m: t.step(i, track=i < args.warmup) for m, t in trainers.items()}
        assert len(set(losses.values())) == 1, f"step {i}: losses differ {losses}"
    ref = statistics.median(trainers["none"].times[args.warmup:])
    print(f"GPT {base.n_layer}x{base.n_embd}, {base.global_batch}x{base.seq_len} tokens, "
          f"AdamW, {args.threads} thread(s), {args.steps} steps; losses equal in all modes")
    print(f"{'mode':10} {'activations MiB':>16} {'estimate MiB':>13} {'peak MiB':>9} "
          f"{'step ms':>8} {'vs none':>8}")
    for m, t in trainers.items():
        ms = statistics.median(t.times[args.warmup:])
        est = gpt_activation_bytes(t.cfg)
        print(f"{m:10} {t.meter.bytes / MiB:16.2f} {est / MiB:13.2f} "
              f"{max(t.peaks[1:]) / MiB:9.2f} {ms * 1e3:8.1f} {ms / ref:8.2f}x")
        assert t.meter.bytes == est, (m, t.meter.bytes, est)

    # 2. the tracker's own cost
    t = _Trainer(base)
    runs = {"off": [], "bare dispatch mode": [], "tracker": []}
    for i in range(3 * args.steps):
        kind = list(runs)[i % 3]
        t.step(i, mode_ctx=_Bare() if kind == "bare dispatch mode" else None,
               track=kind == "tracker")
        runs[kind].append(t.times[-1])
    off = statistics.median(runs["off"][args.warmup:])
    print("peak tracker cost (no checkpointing):")
    for kind, ts in runs.items():
        ms = statistics.median(ts[args.warmup:])
        print(f"  {kind:20} {ms * 1e3:7.1f} ms  {100 * (ms / off - 1):+5.0f}%")


if __name__ == "__main__":
    main()
