"""Debugging drills: each injected bug (distlab.debug.bugs) is caught by its check (distlab.debug.diagnose)
in a real multi-process run, each fix passes every check (no false alarm), and the pieces the
checks stand on (the unigram entropy, the hooks, the probe's measures, RunConfig's refusals)
are right on their own.

The drills run once for the module (two launches: one rank, two ranks), 30 steps each: the
notebook's quick mode, where every drill must already show its symptom.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from distlab import RunConfig
from distlab.debug.bugs import Bugs
from distlab.data.dataset import MarkovData
from distlab.debug.diagnose import Trace, findings, gradient_growth, symmetry, unigram
from distlab.debug.probe import fingerprint, unit_spread

STEPS = 30


@pytest.fixture(scope="module")
def runs():
    from distlab.lab.debugging import drill_base, run_drills
    return run_drills(drill_base(STEPS))


@pytest.fixture(scope="module")
def results(runs):
    from distlab.lab.debugging import drill_results
    return drill_results(runs)


# -- the unigram entropy ------------------------------------------------------------------------
def test_unigram_entropy_matches_a_count_on_sampled_data():
    """Per position, the entropy of the targets counted over 24,000 sampled rows, averaged
    over positions, against the exact value. Miller-Madow's correction removes the plug-in
    estimate's bias ((K-1)/2N, ~0.001 here); what is left is sampling noise, ~0.01 per position
    (sd of -ln p ~1 over 24,000 rows) and ~0.003 averaged over 16 of them: 0.02 is 6 of those."""
    data = MarkovData(vocab_size=64, seq_len=16, successors=3, seed=3)
    y = torch.cat([data.global_batch(step, 2000)[1] for step in range(12)]).numpy()
    n = len(y)
    per_position = []
    for t in range(y.shape[1]):
        counts = np.bincount(y[:, t], minlength=64)
        p = counts[counts > 0] / n
        per_position.append(-(p * np.log(p)).sum() + (len(p) - 1) / (2 * n))
    counted = float(np.mean(per_position))
    assert abs(counted - data.unigram_entropy) < 0.02, (counted, data.unigram_entropy)
    # between what the input tells (the floor) and a uniform guess, and far from both here
    assert data.loss_floor + 1 < data.unigram_entropy < data.loss_at_start - 0.1


# -- RunConfig refuses what cannot work -----------------------------------------------------------
@pytest.mark.parametrize("changes, words", [
    (dict(bug="nope"), ["bug='nope' is not one of", "'shuffled_labels'", "'same_rows'"]),
    (dict(bug=1), ["bug=1 must be a string"]),
    (dict(bug="same_rows"), ["bug='same_rows'", "world_size >= 2"]),
    (dict(bug="loss_not_divided"), ["grad_accum >= 2"]),
    (dict(bug="shuffled_labels", global_batch=1), ["at least 2 rows per rank"]),
    (dict(bug="zero_init", strategy="ddp", world_size=2), ["strategy 'ddp' does not support",
                                                           "single, allreduce"]),
    (dict(bug="no_zero_grad", checkpoint_every=5), ["checkpoints do not hold"]),
    (dict(diagnostics=True, strategy="zero2", world_size=2), ["diagnostics=True"]),
    (dict(diagnostics=True, precision="fp16"), ["loss scaling"]),
])
def test_bad_bug_settings_are_refused_with_a_clear_message(changes, words):
    with pytest.raises(ValueError) as e:
        RunConfig(**changes)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


# -- the hooks and the probe's measures, without a launch -----------------------------------------
def test_the_hooks_do_what_each_bug_says():
    cfg = RunConfig(global_batch=8, grad_accum=4, n_layer=1, n_embd=16, n_head=2, seq_len=8)
    data = MarkovData(cfg.vocab_size, cfg.seq_len, cfg.successors, cfg.seed)
    x, y = data.rank_batch(3, 8, 1, 2)
    sx, sy = Bugs(cfg.replace(bug="shuffled_labels"), 0, 1).rows((x, y), data, 3)
    assert torch.equal(sx, x) and not any(torch.equal(sy[i], y[i]) for i in range(len(y)))
    two = cfg.replace(strategy="allreduce", world_size=2, bug="same_rows")
    got = Bugs(two, 1, 2).rows((x, y), data, 3)  # rank 1 reads rank 0's rows
    assert torch.equal(got[0], data.rank_batch(3, 8, 0, 2)[0])
    assert Bugs(cfg, 0, 1).loss_divisor == 4 and Bugs(cfg, 0, 1).zero_grad
    assert Bugs(cfg.replace(bug="loss_not_divided"), 0, 1).loss_divisor == 1
    assert not Bugs(cfg.replace(bug="no_zero_grad"), 0, 1).zero_grad
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4))
    Bugs(cfg.replace(bug="zero_init"), 0, 1).initialise(model)
    assert model[1].weight.abs().sum() == 0 and model[1].bias.abs().sum() == 0
    assert model[0].weight.abs().sum() > 0  # embeddings are tables, not units: left random


def test_unit_spread_and_fingerprints():
    g = torch.Generator().manual_seed(0)
    assert unit_spread(torch.zeros(4, 3)) == 0.0
    assert unit_spread(torch.randn(1, 3, generator=g).repeat(5, 1)) < 1e-6
    assert unit_spread(torch.randn(64, 32, generator=g)) > 0.9  # rows' mean ~0: ~1
    assert math.isnan(unit_spread(torch.full((2, 2), float("nan"))))
    x = torch.arange(12).reshape(3, 4)
    assert fingerprint(x) == fingerprint(x.clone()) != fingerprint(x.flip(0))


def test_checks_can_fail_and_pass_on_made_up_traces():
    """The checks' logic on its own: the same growing norms flag only when the loss stalls."""
    diag = [{0: {"grad_norm_total": 1.0 + s}} for s in range(40)]
    falling = Trace([4 - 0.05 * s for s in range(40)], 4.16, 3.78, 0.86, diag)
    stalled = Trace([4 - 0.05 * min(s, 10) for s in range(40)], 4.16, 3.78, 0.86, diag)
    assert gradient_growth(falling).passed and not gradient_growth(stalled).passed
    at_unigram = Trace([3.78] * 40, 4.16, 3.78, 0.86, diag)
    assert not unigram(at_unigram).passed and unigram(falling).passed
    # without diagnostics the checks that read them are left out, not failed
    plain = Trace(stalled.losses, 4.16, 3.78, 0.86, [])
    assert gradient_growth(plain) is None and symmetry(plain) is None


# -- the drills, run for real ---------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("drill", ["lr too high", "lr too low", "shuffled labels", "zero init",
                                   "zero_grad forgotten", "loss not divided by k",
                                   "exploding gradients", "same rows on every rank"])
def test_each_drill_is_caught_by_its_check_and_its_fix_passes_every_check(results, drill):
    r = results[drill]
    assert r["caught"], (drill, r)
    assert r["fixed"], (drill, r)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["healthy", "sgd", "overfit", "divided", "clipped",
                                  "per-rank rows"])
def test_no_finding_on_a_clean_run(runs, name):
    from distlab.lab.debugging import drill_findings
    found = drill_findings(runs)[name]
    assert len(found) >= 7, found  # the checks ran (diagnostics on), not just skipped
    assert [f for f in found if not f.passed] == [], name


@pytest.mark.slow
def test_the_fixes_measured(runs):
    """The numbers behind each fix, as the notebook states them."""
    from distlab.debug.diagnose import Trace, matches_reference
    losses = runs["exploding gradients"].losses()
    clipped = runs["clipped"].losses()
    assert not math.isfinite(losses[-1]) and all(map(math.isfinite, clipped))
    assert clipped[-1] < 0.9 * clipped[0]  # not merely finite: it trains
    # step 0, same init and rows: the undivided gradient is exactly k = 4 times the mean's,
    # up to summation order (~1e-6); divided, it equals the step without accumulation
    sgd = Trace.of(runs["sgd"])
    bug = matches_reference(Trace.of(runs["loss not divided by k"]), sgd)
    fix = matches_reference(Trace.of(runs["divided"]), sgd)
    g = [Trace.of(runs[k]).rank0("grad_norm_total")[0] for k in
         ("loss not divided by k", "divided", "sgd")]
    assert abs(g[0] / g[2] - 4) < 1e-3 and abs(g[1] / g[2] - 1) < 1e-3 and fix.passed
    assert not bug.passed
    # the sampler: equal fingerprints at every step with the bug, distinct at every step without
    for name, same in (("same rows on every rank", True), ("per-rank rows", False)):
        t = Trace.of(runs[name])
        assert len(t.diag) == STEPS
        assert all((len({v["batch"] for v in d.values()}) == 1) == same for d in t.diag)
    # shuffled labels end at the unigram entropy (the check's band: 0.1 nats)
    shuffled = Trace.of(runs["shuffled labels"])
    assert abs(np.mean(shuffled.quarter(4)) - shuffled.unigram) < 0.1
    assert findings(runs["overfit"])[-1].check == "memorises"


@pytest.mark.slow
def test_the_explorer_runs_a_drill_and_shows_its_findings():
    from distlab.lab.debugging import DebugExplorer, drill_base
    explorer = DebugExplorer(drill_base(12))
    run = explorer.run(drill="lr too low", wait=True)
    assert run.status == "done"
    assert "learning" in explorer.status.value and "FAILED" in explorer.report.value
    # ln V and the unigram entropy go in with the dashboard's axes (a hint stood before)
    from distlab.lab.common import has_hint
    from distlab.lab.debugging import REFERENCE_LINES
    names = [t.name for t in explorer.dashboard.fig.data]
    assert not has_hint(explorer.dashboard.fig)
    assert all(any(n.startswith(label) for n in names) for _, label, *_ in REFERENCE_LINES[:2])


def test_a_rising_loss_is_not_reported_as_a_negative_share_of_the_way():
    # 11 printed "learning ok: loss went -3207%" for the lr-too-high drill (issue 25)
    from distlab.debug.diagnose import Trace, learning
    diag = [{0: {"update_ratio": {"w": 0.5}}}] * 8
    t = Trace(losses=[3.0, 5.0, 9.0, 20.0, 40.0, 60.0, 80.0, 99.0], ln_v=3.0, unigram=2.9,
              floor=1.0, diag=diag)
    f = learning(t)
    assert "%" not in f.evidence and "loss rose from 3.000 to" in f.evidence, f.evidence
    assert f.passed  # not the too-small-step symptom: no_divergence speaks for this run


def test_the_two_stalled_drills_show_their_reference_lines_apart(runs):
    """11's drill grid: "lr too low" stalls at ln V, "shuffled labels" at the unigram entropy,
    0.37 nats apart. On the grid's shared log axis the two lines sat a few pixels apart and the
    two drills looked alike (issue 25); their panels now draw them at least a tenth of the
    panel's height apart."""
    from distlab.lab.debugging import DRILLS, loss_figure
    fig = loss_figure(runs)
    names = list(DRILLS) + ["overfit"]
    for name in ("lr too low", "shuffled labels"):
        i = names.index(name) + 1
        axis = fig.layout[f"yaxis{i if i > 1 else ''}"]
        lines = [t.y[0] for t in fig.data
                 if t.yaxis == f"y{i if i > 1 else ''}" and t.name in ("ln V: uniform guess",
                                                                       "unigram entropy: the "
                                                                       "marginal")]
        assert len(lines) == 2, (name, lines)
        lo, hi = axis.range
        scale = (lambda v: math.log10(v)) if axis.type == "log" else (lambda v: v)
        apart = abs(scale(lines[0]) - scale(lines[1])) / (hi - lo)
        assert apart >= 0.1, (name, axis.type, apart)
