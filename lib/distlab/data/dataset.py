"""Training data made on the machine: token sequences from a fixed random Markov chain.

Nothing is downloaded. The chain is sparse (each token has only `successors` possible next
tokens), so a model can learn it in a few hundred steps, and the best achievable loss is known
exactly: the conditional entropy of the chain (`MarkovData.loss_floor`). Plots draw that floor
so a reader can see how close training came to it.

Every optimizer step has one global batch, drawn from a generator seeded by (seed, step). Each
data-parallel rank takes its own disjoint block of rows, so the union over ranks is exactly the
batch that `single` trains on at the same step, whatever the world size.

ClusterData (Gaussian clusters, the BatchNorm net's classification data) follows the same
conventions; FiniteDataset is a fixed set of rows that a distributed sampler reads
(distlab.data.sampler), for the finite-dataset and uneven-inputs lessons.
"""

from __future__ import annotations

import numpy as np
import torch


# Tasks k >= 1 redraw this fraction of task 0's successor rows (MarkovData._shift_task).
TASK_SHIFT = 0.5
# Held-out evaluation rows are the batches of "steps" EVAL_STREAM + i: no run trains that long,
# and finite datasets (DATASET_STREAM + i, below) would need 2**32 rows to reach them.
EVAL_STREAM = 2 ** 33


class MarkovData:
    def __init__(self, vocab_size: int = 64, seq_len: int = 64, successors: int = 3,
                 seed: int = 0, task: int = 0):
        self.vocab_size, self.seq_len, self.seed, self.task = vocab_size, seq_len, seed, task
        rng = np.random.default_rng([seed, 0])
        # successor table: token a may be followed only by succ[a, 0..k-1], with probs[a]
        self.succ = np.stack([rng.permutation(vocab_size)[:successors] for _ in range(vocab_size)])
        self.probs = rng.dirichlet(np.ones(successors), size=vocab_size)
        if task:
            self._shift_task(task, successors)
        self._cum = np.cumsum(self.probs, axis=1)
        self._cum[:, -1] = 1.0  # guard against rounding: a draw u < 1 always finds a successor

    def _shift_task(self, task: int, successors: int):
        """Task k >= 1 (the transfer-learning lessons): task 0's chain with the successors and
        probabilities of TASK_SHIFT of the tokens drawn anew (from a generator of its own).
        The tasks share the other rows, so what was learnt on task 0 partly transfers; the
        redrawn rows conflict, so training on task k alone overwrites them (forgetting). A
        sequence that visits a redrawn token shows which chain it follows, so one model can
        learn both tasks (what replay and EWC aim at)."""
        V = self.vocab_size
        rng = np.random.default_rng([self.seed, 0, task])
        self.shifted = np.sort(rng.choice(V, size=round(TASK_SHIFT * V), replace=False))
        for a in self.shifted:
            self.succ[a] = rng.permutation(V)[:successors]
            self.probs[a] = rng.dirichlet(np.ones(successors))

    def global_batch(self, step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of shape (batch, seq_len) for one optimizer step. Task 0's rows
        come from generator (seed, 1, step); task k's from (seed, 1, step, k), a stream of its
        own. Held-out rows for evaluation are "steps" EVAL_STREAM + i (eval_batch)."""
        rng = np.random.default_rng([self.seed, 1, step] + ([self.task] if self.task else []))
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

    def eval_batch(self, i: int, batch: int):
        """Held-out batch i: rows of a stream no training step reaches (EVAL_STREAM + i)."""
        return self.global_batch(EVAL_STREAM + i, batch)

    @property
    def loss_floor(self) -> float:
        """Cross-entropy (nats/token) of the true chain on this data: no model can do better.

        Position t's target depends only on token t, whose distribution starts uniform and then
        follows the chain, so the floor is the mean over positions of E_{a~p_t}[H(next | a)].
        """
        row_entropy = -(self.probs * np.log(self.probs)).sum(axis=1)
        return float(np.mean([p @ row_entropy for p in self._marginals()[:-1]]))

    @property
    def unigram_entropy(self) -> float:
        """Cross-entropy (nats/token) of the best model that does not read the inputs: one
        that knows only the position. Target t is token t+1, whose distribution is p_{t+1}
        (the start is uniform, then the chain), so this is the mean over positions of
        H(p_{t+1}): the entropy of the marginal next-token distribution. Labels shuffled
        independently of the inputs (distlab.debug.bugs) leave a model nothing better to learn.
        loss_floor is H(target | input); the gap between the two is what the input tells."""
        return float(np.mean([_entropy(p) for p in self._marginals()[1:]]))

    def _marginals(self) -> list[np.ndarray]:
        """The distribution of token t for t = 0..seq_len: uniform at 0, then p_{t+1} = p_t P."""
        V = self.vocab_size
        P = np.zeros((V, V))
        np.put_along_axis(P, self.succ, self.probs, axis=1)
        out = [np.full(V, 1.0 / V)]
        for _ in range(self.seq_len):
            out.append(out[-1] @ P)
        return out

    @property
    def loss_at_start(self) -> float:
        """Cross-entropy of a uniform guess, ln V: where an untrained model starts."""
        return float(np.log(self.vocab_size))


def _entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def make_data(cfg):
    """The data a run trains on: MarkovData for the GPT, ClusterData (below) for the BatchNorm
    net. A finite dataset (cfg.dataset_size > 0) is built from it by the strategy that reads it
    (distlab.data.sampler)."""
    if cfg.model == "bnnet":
        return cluster_data(cfg)
    return MarkovData(cfg.vocab_size, cfg.seq_len, cfg.successors, cfg.seed, cfg.task)


# -- a classification set for the BatchNorm model ---------------------------------------------

class ClusterData:
    """Labelled points from Gaussian clusters, one cluster per class: the BatchNorm net's data.

    Class c has a centre mu_c in `features` dimensions (drawn once from the seed); a point of
    class c is mu_c + std * noise. Inputs are then given a fixed per-feature offset and scale
    (x -> a * x + b), as raw features are in practice, so BatchNorm has something to normalise.
    Like MarkovData, each optimizer step's global batch comes from a generator seeded by
    (seed, step), and rank r of N takes the r-th of N equal blocks of it.
    """

    def __init__(self, classes: int = 4, features: int = 16, std: float = 1.0,
                 separation: float = 0.7, seed: int = 0):
        self.classes, self.features, self.std, self.seed = classes, features, std, seed
        rng = np.random.default_rng([seed, 10])
        self.centres = rng.normal(0.0, separation, size=(classes, features))
        self.offset = rng.normal(0.0, 3.0, size=features)          # features far from mean 0 ...
        self.scale = np.exp(rng.uniform(-1.0, 1.5, size=features))  # ... and from variance 1
        self._floor = None

    def _draw(self, rng, batch: int):
        y = rng.integers(0, self.classes, size=batch)
        z = self.centres[y] + self.std * rng.standard_normal((batch, self.features))
        return z, y

    def _to_tensors(self, z, y):
        x = torch.from_numpy((z * self.scale + self.offset).astype(np.float32))
        return x, torch.from_numpy(y.astype(np.int64))

    def global_batch(self, step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs (batch, features) float32, class labels (batch,) int64) for one step."""
        return self._to_tensors(*self._draw(np.random.default_rng([self.seed, 11, step]), batch))

    rank_batch = MarkovData.rank_batch  # the same disjoint blocks of the global batch

    @property
    def loss_floor(self) -> float:
        """The Bayes cross-entropy E[-ln p(y | x)] of the true model, the best any classifier
        can do. The offset and scale are invertible and the same for every class, so they do
        not change it. With equal priors and a shared isotropic std, p(y | x) is a softmax of
        -|z - mu_c|^2 / (2 std^2); its expectation is estimated on 40,000 fixed draws (a Monte
        Carlo mean: `loss_floor_stderr` is its standard error, ~0.003 at the defaults, where
        the floor is ~0.21 against ln 4 = 1.39 at the start)."""
        if self._floor is None:
            self._floor = self._bayes_loss()
        return self._floor[0]

    @property
    def loss_floor_stderr(self) -> float:
        self.loss_floor
        return self._floor[1]

    def _bayes_loss(self, n: int = 40_000):
        z, y = self._draw(np.random.default_rng([self.seed, 12]), n)
        logits = -((z[:, None, :] - self.centres[None]) ** 2).sum(-1) / (2 * self.std ** 2)
        logits -= logits.max(1, keepdims=True)
        nll = np.log(np.exp(logits).sum(1)) - logits[np.arange(n), y]
        return float(nll.mean()), float(nll.std() / np.sqrt(n))

    @property
    def loss_at_start(self) -> float:
        """Cross-entropy of a uniform guess over the classes, ln(classes)."""
        return float(np.log(self.classes))

    @property
    def unigram_entropy(self) -> float:
        """The best loss without reading x: the classes are equally likely, so ln(classes)."""
        return self.loss_at_start


# -- finite datasets ----------------------------------------------------------------------------

# Row i of a finite dataset is the one-row batch of "step" DATASET_STREAM + i of its source: a
# stream of its own (no run reaches 2**32 steps), deterministic by (seed, index), and a dataset
# of n rows is the first n rows of a larger one.
DATASET_STREAM = 2 ** 32


class FiniteDataset:
    """`size` rows of a source (MarkovData, ClusterData), drawn once and indexed by row number.
    A distributed sampler (distlab.data.sampler) decides which rows each rank reads."""

    def __init__(self, source, size: int):
        if size < 1:
            raise ValueError(f"size={size} must be >= 1")
        rows = [source.global_batch(DATASET_STREAM + i, 1) for i in range(size)]
        self.x = torch.cat([r[0] for r in rows])
        self.y = torch.cat([r[1] for r in rows])
        self.source = source
        self.loss_floor, self.loss_at_start = source.loss_floor, source.loss_at_start
        self.unigram_entropy = getattr(source, "unigram_entropy", None)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index):
        """Rows by index (an int, a list or a tensor of indices): (inputs, targets)."""
        return self.x[index], self.y[index]


def cluster_data(cfg) -> ClusterData:
    """ClusterData for a RunConfig: its bn_classes, bn_features, bn_cluster_std and
    bn_separation (the std of the class centres)."""
    return ClusterData(cfg.bn_classes, cfg.bn_features, cfg.bn_cluster_std, cfg.bn_separation,
                       cfg.seed)
