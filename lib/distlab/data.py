"""Training data made on the machine: token sequences from a fixed random Markov chain.

Nothing is downloaded. The chain is sparse (each token has only `successors` possible next
tokens), so a model can learn it in a few hundred steps, and the best achievable loss is known
exactly: the conditional entropy of the chain (`MarkovData.loss_floor`). Plots draw that floor
so a reader can see how close training came to it.

Every optimizer step has one global batch, drawn from a generator seeded by (seed, step). Each
data-parallel rank takes its own disjoint block of rows, so the union over ranks is exactly the
batch that `single` trains on at the same step, whatever the world size.
"""

from __future__ import annotations

import numpy as np
import torch


class MarkovData:
    def __init__(self, vocab_size: int = 64, seq_len: int = 64, successors: int = 3,
                 seed: int = 0):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        rng = np.random.default_rng([seed, 0])
        # successor table: token a may be followed only by succ[a, 0..k-1], with probs[a]
        self.succ = np.stack([rng.permutation(vocab_size)[:successors] for _ in range(vocab_size)])
        self.probs = rng.dirichlet(np.ones(successors), size=vocab_size)
        self._cum = np.cumsum(self.probs, axis=1)
        self._cum[:, -1] = 1.0  # guard against rounding: a draw u < 1 always finds a successor

    def global_batch(self, step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of shape (batch, seq_len) for one optimizer step."""
        rng = np.random.default_rng([self.seed, 1, step])
        seq = np.empty((batch, self.seq_len + 1), dtype=np.int64)
        seq[:, 0] = rng.integers(0, self.vocab_size, size=batch)
        u = rng.random((batch, self.seq_len))
        for t in range(self.seq_len):
            cur = seq[:, t]
            choice = (u[:, t, None] > self._cum[cur]).sum(axis=1)
            seq[:, t + 1] = self.succ[cur, choice]
        seq = torch.from_numpy(seq)
        return seq[:, :-1], seq[:, 1:]

    def rank_batch(self, step: int, batch: int, rank: int, world: int):
        """This rank's disjoint rows of the global batch (batch must divide by world)."""
        if batch % world:
            raise ValueError(f"batch {batch} does not divide among {world} ranks")
        x, y = self.global_batch(step, batch)
        rows = slice(rank * batch // world, (rank + 1) * batch // world)
        return x[rows], y[rows]

    @property
    def loss_floor(self) -> float:
        """Cross-entropy (nats/token) of the true chain on this data: no model can do better.

        Position t's target depends only on token t, whose distribution starts uniform and then
        follows the chain, so the floor is the mean over positions of E_{a~p_t}[H(next | a)].
        """
        V = self.vocab_size
        P = np.zeros((V, V))
        np.put_along_axis(P, self.succ, self.probs, axis=1)
        row_entropy = -(self.probs * np.log(self.probs)).sum(axis=1)
        p = np.full(V, 1.0 / V)
        total = 0.0
        for _ in range(self.seq_len):
            total += p @ row_entropy
            p = p @ P
        return float(total / self.seq_len)

    @property
    def loss_at_start(self) -> float:
        """Cross-entropy of a uniform guess, ln V: where an untrained model starts."""
        return float(np.log(self.vocab_size))


def make_data(cfg) -> MarkovData:
    return MarkovData(cfg.vocab_size, cfg.seq_len, cfg.successors, cfg.seed)
