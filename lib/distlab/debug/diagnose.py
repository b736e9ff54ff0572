"""Checks over a finished run's events: what a debugging drill's bug does to training, found
by computation instead of by eye.

    findings(run, reference=None) -> [Finding(check, passed, evidence, suspect), ...]

Each check reads the loss per step, the data's reference points (ln V, the unigram entropy,
the loss floor: the "start" event) and, for runs with RunConfig.diagnostics=True, what
distlab.debug.probe measured per step. A check that does not apply to a run (no diagnostics, one
rank, no reference) is left out. A run with no bug must pass every check (tests prove it).

    check            fails when                                              points to
    initial_loss     step 0's loss is more than 10% from ln V                a loss summed, not
                                                                             averaged
    finite           a loss or gradient norm is NaN or inf                   exploding gradients
    no_divergence    the last quarter's loss is above step 0's by > 5%      lr too high
    learning         the loss went < 10% of the way to the floor, and the   lr too low
                     median update/weight ratio is below 1e-3
    unigram          the 3rd and 4th quarters' loss sit within 0.1 nats of   labels unrelated to
                     the unigram entropy                                     the inputs
    gradient_growth  the gradient norm rises step after step (rank          zero_grad forgotten
                     correlation >= 0.9) to >= 3x, while the loss stopped
                     falling
    symmetry         a weight matrix's units are identical (spread < 1e-6)   constant/zero init
    distinct_rows    two ranks read the same rows at a step                  sampler ignores rank
    memorises        a one-batch run ends above half the loss floor          a loop that cannot fit
    reference        step 0's gradient norm differs from the reference run   loss scaled by k
                     (same data, same init) by more than 1%

The 1e-3 update/weight ratio is a heuristic from Karpathy's CS231n notes ("Neural Networks
Part 3", babysitting the learning process: "somewhere around 1e-3"; much lower suggests a
learning rate too low); the other thresholds are argued beside each check.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np

# CS231n's heuristic for a healthy update/weight ratio ||dW|| / ||W|| (see the docstring)
HEALTHY_UPDATE_RATIO = 1e-3


@dataclass(frozen=True)
class Finding:
    check: str  # the check's name (the table above)
    passed: bool
    evidence: str  # what was measured, with the numbers
    suspect: str = ""  # the bug a failure points to

    def __str__(self):
        return f"{'ok ' if self.passed else 'BUG'} {self.check}: {self.evidence}"


@dataclass
class Trace:
    """What the checks read from a run: the loss per step, the data's reference points, and
    per step the diagnostics of every rank (rank -> its "diag" field)."""
    losses: list[float]
    ln_v: float | None
    unigram: float | None
    floor: float | None
    diag: list[dict[int, dict]]
    one_batch: bool = False  # a finite dataset of one global batch (the overfitting check)

    @classmethod
    def of(cls, run) -> "Trace":
        by_step: dict[int, dict[int, dict]] = {}
        for e in run.history("step"):
            if "diag" in e:
                by_step.setdefault(e["step"], {})[e["rank"]] = e["diag"]
        cfg = run.cfg
        return cls(losses=run.losses(), ln_v=run.info("loss_at_start"),
                   unigram=run.info("unigram_entropy"), floor=run.info("loss_floor"),
                   diag=[by_step[s] for s in sorted(by_step)],
                   one_batch=bool(cfg and cfg.dataset_size and
                                  cfg.dataset_size <= cfg.global_batch))

    @property
    def all_finite(self) -> bool:
        return all(map(math.isfinite, self.losses))

    def rank0(self, key: str) -> list:
        return [d[min(d)][key] for d in self.diag]

    def quarter(self, q: int) -> list[float]:
        """The losses of quarter q (1..4) of the run."""
        n = len(self.losses)
        return self.losses[(q - 1) * n // 4: q * n // 4]


def findings(run, reference=None) -> list:
    """Every check that applies to `run`; `reference` is the same config without the bug (for
    the checks that compare two runs). See the module's table."""
    t = Trace.of(run)
    checks = [initial_loss(t), finite(t), no_divergence(t), learning(t), unigram(t),
              gradient_growth(t), symmetry(t), distinct_rows(t), memorises(t)]
    if reference is not None:
        checks.append(matches_reference(t, Trace.of(reference)))
    return [c for c in checks if c is not None]


def problems(run, reference=None) -> list:
    """The checks this run failed."""
    return [f for f in findings(run, reference) if not f.passed]


# -- the checks -------------------------------------------------------------------------------
def initial_loss(t: Trace) -> Finding | None:
    """Step 0's loss against ln V. GPT-2's init (std 0.02) keeps the first logits within
    ~0.01 nats of uniform (4.155 against ln 64 = 4.159 measured), so 10% is far outside what
    an init does, and far inside a loss summed over 2 or more micro-batches (100% off)."""
    if not t.losses or not t.ln_v:
        return None
    ratio = t.losses[0] / t.ln_v
    return Finding("initial_loss", abs(ratio - 1) <= 0.10,
                   f"step-0 loss {t.losses[0]:.3f} = {ratio:.2f} x ln V ({t.ln_v:.3f})",
                   "a loss summed, not averaged (not divided by grad_accum), or an init "
                   "far from uniform predictions")


def finite(t: Trace) -> Finding | None:
    if not t.losses:
        return None
    norms = t.rank0("grad_norm_total") if t.diag else []
    bad = [s for s, v in enumerate(t.losses) if not math.isfinite(v)]
    bad_grad = [s for s, v in enumerate(norms) if not math.isfinite(v)]
    if not bad and not bad_grad:
        return Finding("finite", True, f"every loss finite over {len(t.losses)} steps")
    first = min(bad + bad_grad)
    where = "; ".join(f"{what} non-finite from step {s[0]}" for what, s in
                      (("gradient norm", bad_grad), ("loss", bad)) if s)
    before = (f"; step {first - 1}: loss {t.losses[first - 1]:.3g}"
              + (f", gradient norm {norms[first - 1]:.3g}" if norms else "")) if first else ""
    return Finding("finite", False,
                   f"{where} ({len(bad)} of {len(t.losses)} losses)" + before,
                   "exploding gradients: learning rate too high, no clipping")


def no_divergence(t: Trace) -> Finding | None:
    """A model that learns nothing stays at step 0's loss; ending above it means confident,
    wrong predictions. 5%: flat runs (lr 1e-5, shuffled labels) stay within 2% of their start
    in the last quarter, while runs that diverge end far above (lr 1.0: x20)."""
    if len(t.losses) < 4 or not t.all_finite:
        return None  # the finite check speaks for this run
    end = statistics.mean(t.quarter(4))
    return Finding("no_divergence", end <= 1.05 * t.losses[0],
                   f"last-quarter loss {end:.3f} against {t.losses[0]:.3f} at step 0",
                   "learning rate too high")


def learning(t: Trace) -> Finding | None:
    """Flat loss with tiny updates. The loss must go 10% of the way from step 0 to the floor
    (the drills' healthy runs go 20-85% of it in 30 steps, SGD the least); below that, an
    update/weight ratio under CS231n's 1e-3 says the steps are too small to move it (a ratio
    above 1e-3 with a flat loss points elsewhere: the other checks)."""
    if len(t.losses) < 4 or t.floor is None or not t.diag or not t.all_finite:
        return None
    end = statistics.mean(t.quarter(4))
    progress = (t.losses[0] - end) / (t.losses[0] - t.floor)
    ratio = statistics.median(statistics.median(r.values()) for r in t.rank0("update_ratio"))
    flat = progress < 0.10 and ratio < HEALTHY_UPDATE_RATIO
    moved = (f"loss went {progress:.0%} of the way from {t.losses[0]:.3f} to the floor "
             f"{t.floor:.3f}" if progress >= 0 else  # a percentage of a rise reads as nonsense
             f"loss rose from {t.losses[0]:.3f} to {end:.3f}, away from the floor "
             f"{t.floor:.3f} (not too small a step: see no_divergence)")
    return Finding("learning", not flat, f"{moved}; median update/weight ratio {ratio:.1e}",
                   "learning rate too low")


def unigram(t: Trace) -> Finding | None:
    """Stuck at the unigram entropy: the model predicts the marginal and reads nothing from
    its input. 0.1 nats: shuffled-labels runs end within ~0.04 of it (the noise of a quarter's
    mean loss is ~0.02), and a model that reads its input at all falls far below (the floor
    is ~3 nats lower). Both late quarters, so a healthy run merely passing through the
    unigram entropy on its way down is not stuck. Only where the unigram entropy is 0.1 nats
    clear of ln V (else stuck there is stuck at the start)."""
    if (len(t.losses) < 8 or t.unigram is None or t.ln_v is None or not t.all_finite
            or t.ln_v - t.unigram < 0.1):
        return None
    late = [statistics.mean(t.quarter(q)) for q in (3, 4)]
    stuck = all(abs(v - t.unigram) <= 0.1 for v in late)
    return Finding("unigram", not stuck,
                   f"3rd/4th-quarter loss {late[0]:.3f}/{late[1]:.3f}; unigram entropy "
                   f"{t.unigram:.3f}, floor {t.floor:.3f}",
                   "labels unrelated to the inputs (shuffled apart), or training collapsed "
                   "to the marginal")


def gradient_growth(t: Trace) -> Finding | None:
    """Gradients that pile up: with zero_grad forgotten each step's .grad is the sum of all
    gradients so far, so its norm climbs step after step. Rank correlation with the step >= 0.9
    (the drills' clean runs: -0.6 to 0.8) and the last quarter's median >= 3x the first's (the
    bug: x6 in 30 steps, x9 in 150), while the loss stopped falling (last quarter not below
    the third: an SGD run whose gradients grow x3 as it leaves the plateau is not flagged)."""
    if len(t.diag) < 8:
        return None
    norms = t.rank0("grad_norm_total")
    if not all(map(math.isfinite, norms)):
        return None  # the finite check speaks for this run
    n = len(norms)
    rho = spearman(list(range(n)), norms)
    growth = statistics.median(norms[3 * n // 4:]) / max(statistics.median(norms[:n // 4]), 1e-12)
    stalled = statistics.mean(t.quarter(4)) >= statistics.mean(t.quarter(3))
    piling = rho >= 0.9 and growth >= 3 and stalled
    return Finding("gradient_growth", not piling,
                   f"gradient norm x{growth:.1f} from the first quarter to the last, rank "
                   f"correlation with the step {rho:.2f}; loss {'stopped' if stalled else 'kept'}"
                   " falling", "zero_grad forgotten: gradients accumulate across steps")


def symmetry(t: Trace) -> Finding | None:
    """Identical units at the last step. 1e-6: equal rows have spread exactly 0 (the same
    arithmetic on the same values); a random init has ~1."""
    if not t.diag:
        return None
    spread = t.rank0("unit_spread")[-1]
    same = [n for n, v in spread.items() if math.isfinite(v) and v < 1e-6]
    return Finding("symmetry", not same,
                   f"{len(same)} of {len(spread)} weight matrices have identical units at the "
                   f"last step" + (f" ({_names(same)})" if same else ""),
                   "a constant (e.g. all-zero) initialisation: nothing breaks the symmetry")


def distinct_rows(t: Trace) -> Finding | None:
    if not t.diag or max(len(d) for d in t.diag) < 2:
        return None
    dup = [s for s, d in enumerate(t.diag)
           if len({v["batch"] for v in d.values()}) < len(d)]
    return Finding("distinct_rows", not dup,
                   f"ranks read identical rows at {len(dup)} of {len(t.diag)} steps "
                   f"(batch fingerprints, {max(len(d) for d in t.diag)} ranks)",
                   "a sampler that ignores the rank: every rank reads the same rows")


def memorises(t: Trace) -> Finding | None:
    """Overfit one batch: a correct loop drives the loss on a single batch far below the data's
    floor (below it, only memorising the rows helps). Half the floor is a wide margin: a
    healthy loop gets to a few percent of it."""
    if not t.one_batch or t.floor is None or len(t.losses) < 4:
        return None
    end = statistics.mean(t.quarter(4))
    return Finding("memorises", math.isfinite(end) and end < 0.5 * t.floor,
                   f"last-quarter loss {end:.3f} on one batch; the data's floor is {t.floor:.3f}",
                   "a loop that cannot fit even one batch")


def matches_reference(t: Trace, ref: Trace) -> Finding | None:
    """Step 0 against the same config without the bug: the same init and the same rows, so
    the gradients agree to rounding (~1e-6); 1% leaves room only for that. A bug that scales
    the loss by k shows as a ratio of k."""
    if not t.diag or not ref.diag:
        return None
    g, g_ref = t.rank0("grad_norm_total")[0], ref.rank0("grad_norm_total")[0]
    u = statistics.median(t.rank0("update_ratio")[0].values())
    u_ref = statistics.median(ref.rank0("update_ratio")[0].values())
    ratio = g / g_ref
    return Finding("reference", abs(ratio - 1) <= 0.01,
                   f"step-0 gradient norm {g:.3f} = {ratio:.2f} x the reference's ({g_ref:.3f});"
                   f" update/weight ratio {u / u_ref:.2f} x",
                   "the loss scaled by a constant (not divided by grad_accum: k)")


# -- helpers ------------------------------------------------------------------------------------
def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (no ties handling needed for measured floats)."""
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return float(np.corrcoef(rx, ry)[0, 1])


def _names(names: list[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most
                                      else "")
