"""Variable-length documents, and the ways to batch them: the rare long sequence behind an
"out of memory after five hours" that nobody changed the code for.

Real text has heavy-tailed lengths: most documents are short, a few are very long. A loader
that pads each batch to its longest row makes the step's activation memory proportional to
rows × (longest row), so one long document multiplies the step's memory, and it comes when the
data stream brings it: after hours, for a rare enough length. Here:

    docs = Documents(n=1200, min_len=8, max_len=256, alpha=2.5, seed=0)
    docs.lengths                      # tokens of each document (a truncated Pareto, below)
    pad_to_longest(docs, rows=8)      # [Batch]: consecutive rows, padded to the longest
    capped(docs, rows=8, cap=64)      # the same rows, each truncated to `cap` tokens
    token_buckets(docs, max_tokens=512)  # rows of similar length, rows × longest ≤ max_tokens
    reserve_first(batches, rows, T)   # one step at the worst shape first: an OOM, if it is
                                      # ever coming, comes at step 0
    x, y = docs.padded(batch)         # (rows, T) int64; targets past a row's end are
                                      # IGNORE_INDEX, so padding adds no loss

**Lengths.** A document's length L is a Pareto draw, floor(min_len · U^(−1/α)) with U uniform
on (0, 1], clipped to max_len (the model's block size): P(L > l) = (min_len / (l + 1))^α for
min_len − 1 ≤ l < max_len (`tail`). A batch of R independent rows pads past l with probability
1 − (1 − P(L > l))^R (`pad_probability`): small per step, certain over enough steps.

**Tokens.** Document i's tokens are row i mod 64 of MarkovData's batch of "step" i // 64 (rows
drawn at max_len, truncated to L_i), so each document is the same whichever policy batches it,
and the learnable chain and its loss floor are MarkovData's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from distlab.data.dataset import MarkovData

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index: padded targets add no loss
PAD_TOKEN = 0  # any valid id: causal attention never lets a real position read a padded one
_CHUNK = 64  # documents drawn per MarkovData batch
PROBE_STREAM = 2 ** 34  # reserve_first's probe rows: a MarkovData stream no document uses


@dataclass(frozen=True)
class Batch:
    """One step's rows: which documents, and how many tokens of each are trained. A probe
    (reserve_first) has no documents: rows of `lengths` tokens from the probe stream."""
    docs: tuple[int, ...]
    lengths: tuple[int, ...]
    probe: bool = False

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def T(self) -> int:
        """The padded length: the longest row."""
        return max(self.lengths)

    @property
    def tokens(self) -> int:
        """Real (not padded) tokens: what the step trains on."""
        return sum(self.lengths)

    @property
    def padded_tokens(self) -> int:
        return self.rows * self.T


class Documents:
    """`n` documents with Pareto(min_len, alpha) lengths clipped to max_len (module doc)."""

    def __init__(self, n: int, min_len: int = 8, max_len: int = 256, alpha: float = 2.5,
                 vocab_size: int = 64, seed: int = 0):
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len ({min_len}) <= max_len ({max_len})")
        if alpha <= 0:
            raise ValueError(f"alpha={alpha} must be > 0")
        self.n, self.min_len, self.max_len, self.alpha = n, min_len, max_len, alpha
        u = 1.0 - np.random.default_rng([seed, 30]).random(n)  # (0, 1]: no infinite draw
        self.lengths = np.minimum(np.floor(min_len * u ** (-1.0 / alpha)), max_len).astype(int)
        self.data = MarkovData(vocab_size, max_len, seed=seed)
        self._chunks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def tail(self, length: int) -> float:
        """P(L > length): the modelled chance that one document is longer than that."""
        if length >= self.max_len:
            return 0.0
        return float(min(1.0, (self.min_len / (length + 1)) ** self.alpha))

    def pad_probability(self, length: int, rows: int) -> float:
        """P(a batch of `rows` independent documents pads past `length`):
        1 − (1 − P(L > length))^rows."""
        return 1.0 - (1.0 - self.tail(length)) ** rows

    def _chunk(self, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        if c not in self._chunks:
            self._chunks[c] = self.data.global_batch(c, _CHUNK)
        return self._chunks[c]

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Document i's inputs and next-token targets, each lengths[i] long."""
        c, r = divmod(i, _CHUNK)
        x, y = self._chunk(c)
        n = int(self.lengths[i])
        return x[r, :n], y[r, :n]

    def padded(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both (rows, T): row j holds lengths[j] tokens of its document,
        then PAD_TOKEN inputs and IGNORE_INDEX targets."""
        x = torch.full((batch.rows, batch.T), PAD_TOKEN, dtype=torch.int64)
        y = torch.full((batch.rows, batch.T), IGNORE_INDEX, dtype=torch.int64)
        if batch.probe:
            px, py = self.data.global_batch(PROBE_STREAM, batch.rows)
            x[:], y[:] = px[:, :batch.T], py[:, :batch.T]
            return x, y
        for j, (i, n) in enumerate(zip(batch.docs, batch.lengths)):
            c, r = divmod(i, _CHUNK)
            dx, dy = self._chunk(c)
            x[j, :n], y[j, :n] = dx[r, :n], dy[r, :n]
        return x, y


# -- batching policies ----------------------------------------------------------------------
def pad_to_longest(docs: Documents, rows: int) -> list[Batch]:
    """Consecutive documents, `rows` per step, each batch padded to its longest row: the
    plain loader, and the one a rare long document blows up."""
    return capped(docs, rows, cap=docs.max_len)


def capped(docs: Documents, rows: int, cap: int) -> list[Batch]:
    """The same rows as pad_to_longest, each document truncated to `cap` tokens: the peak is
    bounded by rows × cap, and the tokens past the cap are never trained."""
    if cap < 1:
        raise ValueError(f"cap={cap} must be >= 1")
    L = np.minimum(docs.lengths, cap)
    return [Batch(tuple(range(s, min(s + rows, docs.n))),
                  tuple(int(v) for v in L[s:s + rows])) for s in range(0, docs.n, rows)]


def token_buckets(docs: Documents, max_tokens: int, window: int = 256,
                  seed: int = 0) -> list[Batch]:
    """Bucketing by length with a token budget per batch (fairseq's max_tokens, the "bucket
    iterator"): within each window of `window` consecutive documents, sort by length and cut
    into batches greedily while rows × longest ≤ max_tokens; then shuffle the window's batches
    (seeded), so lengths do not arrive in order. A long document comes with few rows, a short
    one with many: every batch holds at most max_tokens padded tokens, and little padding.
    A document longer than max_tokens is truncated to it (it could not fit even alone)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1")
    rng = np.random.default_rng([seed, 31])
    out = []
    for start in range(0, docs.n, window):
        idx = sorted(range(start, min(start + window, docs.n)),
                     key=lambda i: (docs.lengths[i], i))
        batches, cur = [], []
        for i in idx:
            n = min(int(docs.lengths[i]), max_tokens)  # sorted: the longest row so far
            if cur and (len(cur) + 1) * n > max_tokens:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
        for k in rng.permutation(len(batches)):
            b = batches[k]
            out.append(Batch(tuple(b), tuple(min(int(docs.lengths[i]), max_tokens)
                                             for i in b)))
    return out


def reserve_first(batches: list[Batch], rows: int, T: int) -> list[Batch]:
    """The same batches after one probe step of `rows` rows of T tokens: the worst shape the
    policy can make, run first. On a GPU this also makes the caching allocator reserve its
    largest blocks before anything else is allocated; here the point is the timing: if the
    worst batch does not fit, the run fails at step 0, not hours in."""
    return [Batch((), (T,) * rows, probe=True)] + list(batches)


def worst_shape(policy: str, docs: Documents, rows: int, cap: int | None = None,
                max_tokens: int | None = None) -> tuple[int, int]:
    """(rows, T) of the largest batch a policy can make from documents up to max_len long:
    what reserve_first should probe. "pad" (pad_to_longest): rows × max_len; "cap": rows ×
    cap; "buckets": one batch of max_len-token rows within max_tokens."""
    if policy == "pad":
        return rows, docs.max_len
    if policy == "cap":
        return rows, min(cap, docs.max_len)
    if policy == "buckets":
        T = min(docs.max_len, max_tokens)
        return max(1, max_tokens // T), T
    raise ValueError(f"policy={policy!r}: 'pad', 'cap' or 'buckets'")
