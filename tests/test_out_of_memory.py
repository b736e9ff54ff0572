"""Out of memory after hours: a rare long sequence against a device budget, the leak of kept
graphs, and the fragmentation report without CUDA (distlab.studies.long_sequences, memory_budget,
leak, fragmentation).

All in this process, with one tiny GPT (2 layers, 32 wide, vocabulary 64, block 256) and plain
SGD; the runs are shared by the tests through module-scoped fixtures.

Tolerances:

* Measured peak against memory_budget.predicted_peak: 1% relative. The formula lists every
  tensor alive at the peak; the only known residual is its batch term (it assumes inputs and
  targets are views of one (R, T+1) array: 8·R bytes), tens of bytes of MiB. A term missing
  from the formula would be at least one saved tensor of one layer, 4·R·T·h bytes ≈ 2.7% of
  the peak at h = 32: 1% tells the two apart.
* Leak growth: exact, to the byte. PeakMemoryTracker counts every aten-allocated storage and
  takes it off when it is freed, so a kept graph adds exactly its saved storages (what
  ActivationMeter counted) plus the 4-byte loss scalar; nothing else allocates between steps.
* The Pareto tail: the empirical frequency of L > 16 within 4 standard errors of the formula
  (seeded, so it cannot flake; 4σ so that a correct formula is never near the edge).
"""

import math

import numpy as np
import pytest
import torch

from distlab.studies.fragmentation import NO_CUDA, fragmentation_from_stats, measure_fragmentation
from distlab.studies.leak import growth_per_step, leak_run
from distlab.studies.long_sequences import (
    IGNORE_INDEX,
    Documents,
    capped,
    pad_to_longest,
    reserve_first,
    token_buckets,
    worst_shape,
)
from distlab.studies.memory_budget import fit_length, predicted_peak, train_under_budget
from distlab.models.gpt import GPT, GPTConfig

MiB = 2**20
CFG = GPTConfig(vocab_size=64, block_size=256, n_layer=2, n_embd=32, n_head=2)
ROWS, STEPS = 8, 30
# 2 MiB: typical batches (8 rows of ~20 tokens) need ~1.3 MiB; the longest that fits is
# 8 × L* with L* ~ 40, so ~13% of steps pad past it (seed 0: several in 30 steps)
BUDGET = 2 * MiB
FORMULA_TOL = 0.01  # module doc


@pytest.fixture(scope="module")
def setting():
    torch.set_num_threads(1)
    L = fit_length(CFG, ROWS, BUDGET)
    docs = Documents(STEPS * ROWS * L // 8, min_len=8, max_len=256, alpha=2.5, seed=0)
    return docs, L


@pytest.fixture(scope="module")
def runs(setting):
    docs, L = setting
    pad = pad_to_longest(docs, ROWS)[:STEPS]
    buckets = token_buckets(docs, ROWS * L)[:STEPS]
    out = {
        "unbounded": train_under_budget(docs, pad, BUDGET, CFG, stop_at_oom=False),
        "pad": train_under_budget(docs, pad, BUDGET, CFG),
        "cap": train_under_budget(docs, capped(docs, ROWS, L)[:STEPS], BUDGET, CFG),
        "buckets": train_under_budget(docs, buckets, BUDGET, CFG),
        "pad+reserve": train_under_budget(
            docs, reserve_first(pad, *worst_shape("pad", docs, ROWS)), BUDGET, CFG),
        "buckets+reserve": train_under_budget(
            docs, reserve_first(buckets[:3], *worst_shape("buckets", docs, ROWS,
                                                          max_tokens=ROWS * L)), BUDGET, CFG),
    }
    return out, pad


def test_spike_lands_on_the_long_sequence_step(setting, runs):
    docs, L = setting
    (r, pad) = runs[0]["unbounded"], runs[1]
    peaks = [s.peak for s in r.steps]
    longest = max(range(STEPS), key=lambda i: (pad[i].T, -i))
    assert max(range(STEPS), key=lambda i: (peaks[i], -i)) == longest
    # the spike is the long row's: seed 0's longest batch pads to 56 tokens against a median
    # of 21, and the peak is mostly activations, linear in T: over twice the median peak
    assert peaks[longest] > 2 * float(np.median(peaks))
    # a step is over the budget exactly when it pads past L* (the formula's longest fit)
    over = [s.step for s in r.steps if s.oom]
    assert over, "precondition: seed 0 brings a batch longer than L* in 30 steps"
    assert over == [i for i in range(STEPS) if pad[i].T > L]
    # and the plain run dies at the first of them, after steps that all fit
    first = runs[0]["pad"].first_oom
    assert first is not None and first.step == over[0] and len(runs[0]["pad"].steps) == over[0] + 1
    assert all(s.peak <= BUDGET for s in runs[0]["pad"].steps[:-1])


def test_measured_peak_matches_the_formula(runs):
    for s in runs[0]["unbounded"].steps:
        pred = predicted_peak(CFG, s.rows, s.T)
        assert abs(s.peak - pred) <= FORMULA_TOL * pred, (s.step, s.rows, s.T, s.peak, pred)


def test_cap_and_buckets_keep_the_peak_under_the_budget(setting, runs):
    docs, L = setting
    for name in ("cap", "buckets"):
        r = runs[0][name]
        assert r.first_oom is None and len(r.steps) == STEPS, name
        assert r.max_peak <= BUDGET, name
    # the cap drops tokens; the buckets train every token of their documents
    assert runs[0]["cap"].tokens_trained < int(docs.lengths[:STEPS * ROWS].sum())
    assert runs[0]["buckets"].tokens_trained == sum(b.tokens for b in token_buckets(
        docs, ROWS * L)[:STEPS])


def test_reserve_at_start_fails_at_step_0_when_the_max_does_not_fit(runs):
    r = runs[0]["pad+reserve"]
    assert r.first_oom is not None and r.first_oom.step == 0 and r.first_oom.probe
    assert len(r.steps) == 1 and r.tokens_trained == 0
    ok = runs[0]["buckets+reserve"]  # its worst shape fits: the probe passes, training goes on
    assert ok.steps[0].probe and ok.first_oom is None and len(ok.steps) == 4


def test_token_buckets_respect_the_budget_and_keep_every_document(setting):
    docs, L = setting
    batches = token_buckets(docs, ROWS * L, window=64)
    assert all(b.rows * b.T <= ROWS * L for b in batches)
    seen = sorted(i for b in batches for i in b.docs)
    assert seen == list(range(docs.n))


def test_padding_changes_no_loss():
    """A row padded to T gives the loss of the row alone: padded targets are ignored and
    causal attention keeps real positions from reading padded ones."""
    docs = Documents(2, min_len=8, max_len=64, seed=1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_embd=32, n_head=2))
    batch = capped(docs, 2, 64)[0]
    x, y = docs.padded(batch)
    short = min(range(2), key=lambda j: batch.lengths[j])
    n = batch.lengths[short]
    assert (y[short, n:] == IGNORE_INDEX).all()
    alone = model(x[short:short + 1, :n], y[short:short + 1, :n])
    padded = model(x[short:short + 1], y[short:short + 1])
    assert abs(alone.item() - padded.item()) < 1e-6  # same sums, fp32 rounding at most


def test_length_tail_matches_the_pareto_formula():
    docs = Documents(20_000, min_len=8, max_len=256, alpha=2.5, seed=3)
    p = docs.tail(16)
    freq = float((docs.lengths > 16).mean())
    assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / docs.n), (freq, p)
    assert docs.lengths.min() >= 8 and docs.lengths.max() <= 256


@pytest.fixture(scope="module")
def leaks():
    torch.set_num_threads(1)
    return {k: leak_run(k, steps=4) for k in ("item", "detach", "tensor", "retain_graph")}


def test_a_kept_graph_leaks_one_steps_activations_per_step(leaks):
    r = leaks["retain_graph"]
    act = r[-1]["activations"]
    assert all(x["activations"] == act for x in r)  # same shapes every step
    assert growth_per_step(r) == act + 4  # its saved tensors and the 4-byte loss


def test_loss_kept_after_backward_keeps_only_itself(leaks):
    """history.append(loss) after loss.backward(): backward freed the saved tensors, so the
    tensor bytes grow by the loss scalar alone; the graph's nodes stay (on the host)."""
    assert growth_per_step(leaks["tensor"]) == 4
    nodes = [x["graph_nodes"] for x in leaks["tensor"]]
    assert nodes[-1] > nodes[0] > 0


def test_item_is_flat(leaks):
    assert growth_per_step(leaks["item"]) == 0
    assert growth_per_step(leaks["detach"]) == 4  # a detached scalar per step
    assert all(x["graph_nodes"] == 0 for x in leaks["item"] + leaks["detach"])


def test_fragmentation_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: tests/gpu/test_fragmentation.py measures it")
    rep = measure_fragmentation()
    assert not rep.cuda and rep.reason == NO_CUDA and rep.phases == {}


def test_fragmentation_from_stats():
    stats = {"allocated_bytes.all.current": 90 * MiB, "reserved_bytes.all.current": 200 * MiB,
             "inactive_split_bytes.all.current": 110 * MiB, "num_alloc_retries": 1,
             "num_ooms": 1}
    f = fragmentation_from_stats(stats)
    assert f["fragmentation"] == pytest.approx(0.55)
    assert (f["inactive_split"], f["num_alloc_retries"], f["num_ooms"]) == (110 * MiB, 1, 1)
    assert fragmentation_from_stats({})["fragmentation"] == 0.0
