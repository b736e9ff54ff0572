"""PyTorch's FLOP count of a training step against 6N + 12·L·h·s (distlab.studies.flop_count), and the
arithmetic of time to train (distlab.lab.time_to_train) on events whose answer is known."""

from __future__ import annotations

import pytest

from distlab import RunConfig
from distlab.studies.flop_count import count_step_flops, matmul_peak
from distlab.theory.flops import matmul_params
from distlab.lab.time_to_train import cluster_days, scaling_rows, step_seconds, trained_seconds
from distlab.models.gpt import GPT, GPTConfig

SHAPES = [dict(n_layer=2, n_embd=32, n_head=2, seq_len=16, global_batch=4),
          dict(n_layer=3, n_embd=48, n_head=4, seq_len=24, global_batch=2, mlp_ratio=2,
               vocab_size=40)]


@pytest.mark.parametrize("shape", SHAPES)
def test_counted_flops_equal_the_formula_exactly(shape):
    """Integers on both sides: the counter multiplies shapes, the formula parameters; the math
    attention kernel computes the full s×s the formula assumes, so no tolerance is needed."""
    c = count_step_flops(RunConfig(**shape))
    assert c["counted"] == c["formula"]
    assert c["attention"] == c["formula_attention"] > 0
    assert c["counted"] - c["attention"] == c["formula_6n"]


def test_the_formula_counts_the_parameters_that_multiply():
    """N of 6N: every Linear weight (q, k, v, o, MLP, head), not embeddings, norms or biases."""
    cfg = RunConfig(n_layer=2, n_embd=32, n_head=2, seq_len=16)
    model = GPT(GPTConfig.from_run(cfg))
    weights = sum(m.weight.numel() for m in model.modules()
                  if isinstance(m, __import__("torch").nn.Linear))
    assert matmul_params(cfg) == weights


def test_attention_flops_grow_with_sequence_length_per_token():
    short = count_step_flops(RunConfig(n_layer=2, n_embd=32, n_head=2, seq_len=16, global_batch=4))
    long = count_step_flops(RunConfig(n_layer=2, n_embd=32, n_head=2, seq_len=32, global_batch=2))
    assert short["tokens"] == long["tokens"]  # same tokens: the Linear FLOPs are equal
    assert long["formula_6n"] == short["formula_6n"]
    assert long["attention"] == 2 * short["attention"]  # per token ∝ s


def test_matmul_peak_is_a_rate_of_the_threads_asked():
    p = matmul_peak(n=256, repeats=3, threads=1)
    assert p["threads"] == 1 and p["flops_per_s"] == pytest.approx(2 * 256**3 / p["seconds"])


class _Run:
    def __init__(self, world, rows_per_rank, step_s_by_rank):
        self.cfg = RunConfig(world_size=world, strategy="ddp" if world > 1 else "single",
                             global_batch=rows_per_rank * world, seq_len=16)
        self._events = [{"kind": "step", "step": s, "rank": r, "step_s": t}
                        for r, times in enumerate(step_s_by_rank) for s, t in enumerate(times)]

    def history(self, kind="step", rank=None):
        return [e for e in self._events if e["kind"] == kind]


def test_a_step_lasts_as_long_as_its_slowest_rank_and_warmup_is_skipped():
    run = _Run(2, 4, [[9.0, 9.0, 1.0, 1.0, 1.0], [9.0, 9.0, 2.0, 2.0, 2.0]])
    assert step_seconds(run, skip=2) == 2.0
    assert trained_seconds(run) == 9 + 9 + 2 + 2 + 2


def test_efficiency_is_throughput_over_n_times_one_rank():
    runs = {1: _Run(1, 4, [[1.0] * 4]), 2: _Run(2, 4, [[1.25] * 4, [1.0] * 4])}
    rows = scaling_rows(runs)
    assert rows[0]["efficiency"] == 1.0
    assert rows[1]["efficiency"] == pytest.approx(1 / 1.25)  # twice the rows in 1.25× the time


def test_cluster_days_is_6nd_over_flops():
    # GPT-3: 175B parameters, 300B tokens on 1024 GPUs at 140 TFLOP/s each (MFU 1 of 140e12)
    assert cluster_days(175e9, 300e9, 1024, 140e12, 1.0, 1.0) == pytest.approx(
        6 * 175e9 * 300e9 / (1024 * 140e12) / 86400)
    assert cluster_days(1, 1, 1, 1, 0.5, 0.5) == pytest.approx(4 * 6 / 86400)
