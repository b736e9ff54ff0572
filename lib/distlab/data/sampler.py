"""A distributed sampler over a finite dataset, and a rank's batches from it.

Each epoch the dataset's row numbers are shuffled by a generator seeded with seed + epoch (every
rank draws the same permutation without talking to the others), and rank r of N takes
positions r, r+N, r+2N, ... of it: disjoint shards whose union is the epoch.

    drop_last=True   the tail that does not divide by N is dropped: every rank gets
                     floor(size / N) rows, so every rank has the same number of batches.
    drop_last=False  nothing is dropped and nothing is added: ranks r < size % N get one row
                     more. When that extra row starts one more batch, that rank runs one more
                     step than the others, and its gradient all-reduce waits for peers that
                     have stopped: the "DDP hangs on uneven inputs" failure.

Difference from torch.utils.data.distributed.DistributedSampler: with drop_last=False torch
*pads* the permutation by repeating its first indices until it divides by N, so every rank gets
ceil(size / N) rows (some rows are seen twice per epoch) and ranks never go uneven. We do not pad,
so the workbook can show the hang and its fixes (drop_last, equal batches, join). With
drop_last=True the two samplers give identical indices (tested); with drop_last=False ours is
torch's with the padded duplicates removed.

The batches of a rank: its shard for epoch 0, cut into batches of `batch` rows (the last one may
be shorter, like a DataLoader with drop_last=False), then epoch 1's, and so on; `None` after the
last batch of the last epoch.
"""

from __future__ import annotations

import math

import torch


class DistributedSampler:
    def __init__(self, size: int, world: int, rank: int, seed: int = 0, drop_last: bool = True,
                 shuffle: bool = True):
        if size < 1 or not 0 <= rank < world:
            raise ValueError(f"need size >= 1 and 0 <= rank < world (size={size}, rank={rank}, "
                             f"world={world})")
        self.size, self.world, self.rank, self.seed = size, world, rank, seed
        self.drop_last, self.shuffle = drop_last, shuffle

    def order(self, epoch: int) -> list[int]:
        """The epoch's permutation of all row numbers (the same on every rank)."""
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)  # as torch's DistributedSampler seeds it
        return torch.randperm(self.size, generator=g).tolist()

    def indices(self, epoch: int = 0) -> list[int]:
        """This rank's row numbers for `epoch`."""
        order = self.order(epoch)
        if self.drop_last:
            order = order[: self.size - self.size % self.world]
        return order[self.rank::self.world]

    def __len__(self) -> int:
        return rows_per_rank(self.size, self.world, self.drop_last)[self.rank]


def rows_per_rank(size: int, world: int, drop_last: bool) -> list[int]:
    """How many rows each rank reads per epoch."""
    if drop_last:
        return [size // world] * world
    return [size // world + (r < size % world) for r in range(world)]


def batches_per_rank(size: int, world: int, batch: int, drop_last: bool,
                     epochs: int = 1) -> list[int]:
    """How many steps each rank has data for: the shapes of the uneven-inputs problem."""
    return [epochs * math.ceil(n / batch) for n in rows_per_rank(size, world, drop_last)]


class ShardReader:
    """A rank's batches from a finite dataset: batch(step) -> (inputs, targets) or None."""

    def __init__(self, dataset, sampler: DistributedSampler, batch: int, epochs: int = 1):
        self.dataset, self.sampler, self.batch_rows, self.epochs = dataset, sampler, batch, epochs
        self._batches = []  # row numbers of each step's batch, epoch after epoch
        for epoch in range(epochs):
            idx = sampler.indices(epoch)
            self._batches += [idx[i:i + batch] for i in range(0, len(idx), batch)]

    def __len__(self) -> int:
        return len(self._batches)

    def rows(self, step: int) -> list[int] | None:
        return self._batches[step] if step < len(self._batches) else None

    def batch(self, step: int):
        rows = self.rows(step)
        return None if rows is None else self.dataset[torch.tensor(rows)]


def shard_reader(cfg, data, rank: int, world: int) -> ShardReader:
    """The reader a data-parallel rank uses when cfg.dataset_size > 0: a FiniteDataset of
    dataset_size rows from `data`, cfg.local_batch rows per step, cfg.epochs passes."""
    from distlab.data.dataset import FiniteDataset

    sampler = DistributedSampler(cfg.dataset_size, world, rank, cfg.seed, cfg.drop_last)
    return ShardReader(FiniteDataset(data, cfg.dataset_size), sampler,
                       cfg.global_batch // world, cfg.epochs)


def global_rows(cfg, world: int) -> list[list[int]]:
    """The row numbers (sample ids) of each step's global batch at `world` ranks, sorted: the
    union of every rank's batch. Rank r takes positions r, r+N, ... of the epoch's permutation,
    so a step's union is a run of consecutive positions whatever N is, save where drop_last
    trims a different tail or the epochs cut into a different number of steps."""
    readers = [ShardReader(None, DistributedSampler(cfg.dataset_size, world, r, cfg.seed,
                                                    cfg.drop_last),
                           cfg.global_batch // world, cfg.epochs) for r in range(world)]
    steps = max(len(reader) for reader in readers)
    return [sorted(i for reader in readers for i in (reader.rows(s) or [])) for s in range(steps)]


def resume_changes_samples(cfg, saved_world: int, steps_done: int) -> str | None:
    """Why resuming a finite-data run saved at `saved_world` ranks after `steps_done` steps, at
    cfg.world_size ranks, would not read the samples the uninterrupted run reads in its steps
    left (the first step whose sample ids differ); None when each of them reads the same."""
    before, now = global_rows(cfg, saved_world), global_rows(cfg, cfg.world_size)
    for step in range(steps_done, cfg.steps):
        a, b = (rows[step] if step < len(rows) else None for rows in (before, now))
        if a == b:
            continue
        if a is None or b is None:
            short = saved_world if a is None else cfg.world_size
            return (f"at {short} ranks the data runs out before step {step} (dataset_size="
                    f"{cfg.dataset_size}, drop_last={cfg.drop_last}, global_batch="
                    f"{cfg.global_batch})")
        differ = sorted(set(a) ^ set(b))
        return (f"step {step} reads other samples at {cfg.world_size} ranks than at "
                f"{saved_world} (rows {differ[:4]} are in one and not the other)")
    return None


def uneven_inputs_report(cfg, world: int) -> str:
    """One line naming which ranks run out of data first, for error messages and notebooks."""
    counts = batches_per_rank(cfg.dataset_size, world, cfg.global_batch // world, cfg.drop_last,
                              cfg.epochs)
    if len(set(counts)) == 1:
        return f"every rank has {counts[0]} batches"
    short = [r for r, c in enumerate(counts) if c < max(counts)]
    return (f"uneven inputs: batches per rank {counts} (dataset_size={cfg.dataset_size}, "
            f"drop_last={cfg.drop_last}); rank(s) {short} ran out of data after "
            f"{min(counts)} steps and stopped, so the others wait in the all-reduce of step "
            f"{min(counts)} for peers that never come. Fixes: drop_last=True, a dataset that "
            f"divides into equal batches, or join=True")
