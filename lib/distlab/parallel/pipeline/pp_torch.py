"""`pp-torch`: the same stage split as distlab's `pp`, run by torch.distributed.pipelining
(PipelineStage per held stage, ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B, and for
the split backward ScheduleInterleavedZeroBubble (zb1p, torch's ZB1P), ScheduleZBVZeroBubble
(zbv, stages placed in a V) and ScheduleDualPipeV (dualpipev, in recent torch releases)), the
reference the from-scratch pipeline is checked against. torch has no `naive` schedule: it runs
as GPipe (same gradients, different timeline).
"""

from __future__ import annotations

import torch

from distlab.parallel.base import Strategy
from distlab.parallel.pipeline.pp import (
    GPTStage,
    gpt_loss,
    pipeline_shape,
    rank_stages,
    split_model,
)


# distlab's schedule -> torch's class (torch has no naive schedule: it runs as GPipe)
TORCH_SCHEDULES = {"naive": "ScheduleGPipe", "gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "interleaved": "ScheduleInterleaved1F1B",
                   "zb1p": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                   "dualpipev": "ScheduleDualPipeV"}
SINGLE_STAGE = ("naive", "gpipe", "1f1b")  # torch's schedules over one stage, not a list


def torch_schedule_class(schedule: str):
    """torch's class for `schedule`, None where this torch has none (ScheduleDualPipeV is in
    recent releases only; torch 2.6 lacks it)."""
    import torch.distributed.pipelining.schedules as schedules
    return getattr(schedules, TORCH_SCHEDULES[schedule], None)


class TorchPP(Strategy):
    name = "pp-torch"
    any_model = False  # distlab's GPT only (Strategy.any_model)
    books_all_traffic = False  # torch sends bytes of its own
    degrees = frozenset({"pp"})
    knobs = frozenset({"microbatches", "schedule", "virtual_stages"})

    def __init__(self, cfg, comm):
        super().__init__(cfg, comm)
        self.p, self.m, self.v, self.S = pipeline_shape(cfg)
        self.stage_ids = rank_stages(self.rank, self.p, self.v, cfg.schedule)
        self.sched = None

    def wrap(self, model):
        return split_model(model, self.rank, self.p, self.v, self.cfg.schedule)

    def batch(self, data, step):
        return data.rank_batch(step, self.cfg.global_batch, 0, 1)

    def _build(self, model, device):
        from torch.distributed.pipelining import PipelineStage
        kind = torch_schedule_class(self.cfg.schedule)
        if kind is None:
            raise RuntimeError(f"torch {torch.__version__} has no "
                               f"{TORCH_SCHEDULES[self.cfg.schedule]} (a later release has): "
                               f"run schedule={self.cfg.schedule!r} with strategy 'pp', which "
                               "is written here")
        stages = [PipelineStage(GPTStage(model, s, self.S), s, self.S, device)
                  for s in self.stage_ids]
        one = self.cfg.schedule in SINGLE_STAGE
        return kind(stages[0] if one else stages, n_microbatches=self.m, loss_fn=gpt_loss)

    def forward_backward(self, model, x, y, scale_loss):
        if self.sched is None:
            self.sched = self._build(model, x.device)
        first, last = 0 in self.stage_ids, self.S - 1 in self.stage_ids
        losses = [] if last else None
        args = (x,) if first else ()
        kwargs = {"target": y, "losses": losses} if last else {}
        self.sched.step(*args, **kwargs)  # grads scaled by 1/m (scale_grads=True)
        return float(torch.stack(losses).detach().mean()) if last else None
