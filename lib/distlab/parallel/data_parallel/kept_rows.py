"""Rows a model drops inside its forward, a different number on each rank: said once.

DistributedDataParallel already warns when the ranks feed it different numbers of rows
(distlab.step_ledger's note_rows/uneven_rows). A model can also drop rows inside its forward (a
filter on padding, `x[keep]`, a mask of items too long): every rank fed 8 rows, rank 0's forward
kept 2 and rank 1's 3. Each rank's loss is then a mean over its own kept rows and the all-reduce
averages those means with equal weight, so a kept row on the rank that kept fewer weighs more,
and the gradient is not the mean over all kept rows. Torch's DDP trains on, silent.

The rows kept are dim 0 of the output's first tensor that has one (a model returning only a
scalar loss cannot be counted, and is not). As the step's backward starts each rank writes
"<step> <kept> <fed>" in the store (one write, as the ledger's); once the step's collectives
completed it reads its peers' entries for the same step, and if the kept counts differ while the
fed counts agree (when they differ, the uneven-data warning says so already) it warns, once.
"""

from __future__ import annotations

import torch.distributed as dist

from distlab.modules import tensors_in
from distlab.step_ledger import PREFIX, StepCounter, _entries, _store  # the ledger's store

KEY = f"{PREFIX}kept/"


def output_rows(output) -> int | None:
    """dim 0 of the output's first tensor with one, or None."""
    return next((t.shape[0] for t in tensors_in(output) if t.dim() > 0), None)


class KeptRows:
    """One DistributedDataParallel's count of the rows its forwards kept this step."""

    def __init__(self):
        self.kept: int | None = 0  # summed over the step's forwards (no_sync); None: uncounted
        self.said = False

    def count(self, output) -> None:
        rows = output_rows(output)
        self.kept = None if rows is None or self.kept is None else self.kept + rows

    def note(self, steps: StepCounter, fed: int) -> None:
        """As the step begins: this rank's kept and fed rows, for its peers to read."""
        store = None if self.kept is None or self.said or steps.off else _store()
        if store is not None:
            try:
                store.set(f"{KEY}{dist.get_rank()}", f"{steps.step} {self.kept} {fed}")
            except RuntimeError:  # a FileStore on a full disk: no word, not the run
                self.said = True

    def uneven(self, steps: StepCounter, group, fed: int) -> str | None:
        """Once this step's collectives completed: the ranks' kept rows in words, if they
        differ while the fed rows agree (once per run); then the count starts afresh."""
        kept, self.kept = self.kept, (0 if self.kept is not None else None)
        if kept is None or self.said or steps.off:
            return None
        seen = {dist.get_rank(): (kept, fed)}
        for r, entry in _entries(KEY, group).items():
            step, k, f = map(int, entry.split())
            if step == steps.step:
                seen.setdefault(r, (k, f))
        if len({k for k, _ in seen.values()}) < 2 or len({f for _, f in seen.values()}) > 1:
            return None
        self.said = True
        counts = ", ".join(f"rank {r} {k} of {f}" for r, (k, f) in sorted(seen.items()))
        return (f"the ranks' forwards kept different numbers of rows in {steps.owner} step "
                f"{steps.step} (dim 0 of the output, of the rows fed): {counts}. Each rank's "
                "loss is a mean over its own rows and data parallelism averages the ranks' "
                "gradients with equal weight (torch's DDP too), so a row on a rank that kept "
                "fewer weighs more and the result is not the gradient of the mean over all "
                "kept rows. Keep every row and mask the dropped ones out of the loss (a sum "
                "over kept rows divided by the global count), or scale each rank's loss by its "
                "kept rows x world / total kept rows")
