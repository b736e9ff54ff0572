"""Progress on the console: what one rank prints under torchrun and `python -m distlab`.

A notebook reads the run's event log (distlab.lab); a terminal gets a line every `every` steps
and a summary at the end, as torchtitan's trainer prints one:

    step    10/20  loss 3.1512  tokens/s 5,877  step 0.087 s  memory 32.3 MiB  wire 3.1 MiB
    ...
    done: 20 steps in 3.3 s, loss 4.1489 -> 1.6355, 5,839 tokens/s (steps 2+), ...

(`python -m distlab --strategy ddp --world-size 2 --steps 20 --log-every 10` on a 2-core CPU.)
Every figure is the step event's own: tokens/s is the step's tokens (the global batch's) over
its measured time, memory the bytes rank 0 holds by category (distlab.memory: parameters,
gradients, optimizer state, saved activations, communication buffers; on CUDA the allocator's
peak), wire the bytes rank 0 wrote to the network in the step (distlab.wire).
"""

from __future__ import annotations

import sys
import time

from distlab.config import RunConfig
from distlab.events import StepRecorder
from distlab.parallel import strategy_class
from distlab.rank.train import train


def size(n: float) -> str:
    """Bytes, in the unit that shows them: 484 B, 12.3 KiB, 32.3 MiB, 1.20 GiB."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n:.0f} B"
# memory categories that are a view of the others, not more bytes (distlab.rank.step_meter)
_NOT_ADDED = ("peak", "allocated", "cuda_max_allocated", "cuda_allocated")


def memory_bytes(event: dict) -> int:
    """Rank's bytes in the step: the allocator's peak on CUDA, else the sum of the categories."""
    memory = event.get("memory", {})
    if "cuda_max_allocated" in memory:
        return memory["cuda_max_allocated"]
    return sum(v for k, v in memory.items() if k not in _NOT_ADDED and isinstance(v, int))


class Progress(StepRecorder):
    """An EventLog stand-in for the printing rank: writes through, keeps the step events
    (StepRecorder) and prints every `every` steps of `steps`."""

    def __init__(self, log, every: int, steps: int, rank: int = 0, dp: int = 1, out=None):
        super().__init__(log)
        self.every, self.total, self.rank, self.dp = every, steps, rank, dp
        self.out = out or sys.stdout
        self.t0 = time.perf_counter()

    def write(self, kind: str, **fields) -> dict:
        event = super().write(kind, **fields)
        if kind == "start":
            self._print(f"distlab: {fields.get('n_params', 0):,} parameters on "
                        f"{fields.get('world_size')} ranks ({fields.get('backend')}, "
                        f"{fields.get('device')}), {self.total} steps; rank {self.rank} prints"
                        + (f" (its loss is over its 1/{self.dp} of the global batch)"
                           if self.dp > 1 else ""))
        elif kind == "step":
            step = fields["step"]
            if (step + 1) % self.every == 0 or step == 0 or step + 1 == self.total:
                self._print(self.line(fields))
        return event

    def line(self, e: dict) -> str:
        wire = e.get("wire") or {}
        sent = f"  wire {size(wire['sent'])}" if wire.get("sent") is not None else ""
        return (f"step {e['step'] + 1:>5}/{self.total}  loss {e['loss']:.4f}  "
                f"tokens/s {e['tokens'] / e['step_s']:,.0f}  step {e['step_s']:.3f} s  "
                f"memory {size(memory_bytes(e))}{sent}")

    def summary(self) -> str:
        ev = self.steps
        if not ev:
            return "done: no steps"
        timed = ev[1:] or ev  # the first step warms up (allocations, first collectives)
        tokens_s = sum(e["tokens"] for e in timed) / sum(e["step_s"] for e in timed)
        sent = [e["wire"]["sent"] for e in ev if (e.get("wire") or {}).get("sent") is not None]
        wire = f", {size(sum(sent))} on the wire from rank {self.rank}" if sent else ""
        return (f"done: {len(ev)} steps in {time.perf_counter() - self.t0:.1f} s, loss "
                f"{ev[0]['loss']:.4f} -> {ev[-1]['loss']:.4f}, {tokens_s:,.0f} tokens/s "
                f"(steps {2 if len(ev) > 1 else 1}+), memory peak "
                f"{size(max(memory_bytes(e) for e in ev))}{wire}")

    def _print(self, text: str):
        print(text, file=self.out, flush=True)


def printing_rank(cfg: RunConfig) -> int:
    """The first rank that logs a loss: rank 0, or the first worker after a parameter server,
    or the last pipeline stage (which computes the loss)."""
    cls = strategy_class(cfg.strategy)
    if "pp" in cls.degrees and cfg.pp > 1:
        return cfg.world_size - 1
    return cls.servers


def train_rank_with_progress(rank: int, world: int, device, log, cfg_dict: dict,
                             every: int) -> dict:
    """train_rank, with one rank (printing_rank) printing progress every `every` steps and a
    summary at the end."""
    cfg = RunConfig.from_dict(cfg_dict)
    if rank != printing_rank(cfg) or every <= 0:
        return train(cfg, rank, world, device, log)
    progress = Progress(log, every, cfg.steps, rank=rank, dp=cfg.dp_degree)
    out = train(cfg, rank, world, device, progress)
    progress._print(progress.summary())
    return out
