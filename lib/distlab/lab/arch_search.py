"""Architecture search under a memory budget: the GPT's depth, width, heads and MLP ratio.

Neural architecture search (Zoph & Le 2017) trains candidate networks and keeps the good ones;
here a candidate is a distlab run of the tiny GPT with the trial's n_layer, n_embd, n_head and
mlp_ratio, and two objectives are minimised at once: the held-out loss after a fixed number of
steps, and the parameter count (a smaller model that is nearly as good is worth knowing about).
No single best trial exists then, only the Pareto front: the trials no other trial beats on
both. NSGA-II (Deb et al. 2002) breeds the next trials from the front so far (non-dominated
sorting, crowding distance); random search only draws.

**The budget.** A candidate that cannot fit is refused BEFORE any process starts: its bytes per
rank come from distlab.theory.estimate (parameters, gradients, AdamW state and activations, the same
formulas launch()'s preflight uses; they equal what a run measures, byte for byte, which
`estimate_vs_measured` checks on every completed trial), and one over budget_bytes is pruned
with the reason kept in the trial (user attribute "refused"). So is a combination RunConfig
refuses (n_head not dividing n_embd). Refused trials cost no run: `arch_search` counts the run
folders the study created and keeps the count in the study.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import optuna

from distlab import RunConfig
from distlab.theory.estimate import estimate_run, gpt_params_of
from distlab.lab.hp_search import BASE
from distlab.lab.search import (
    completed,
    measured,
    new_study,
    record,
    run_trial,
    sampler,
    suggest,
    torch_threads,
)
from distlab.caller.launch import new_run_dir, runs_root
from distlab.caller.retention import run_folders
from distlab.units import MiB

# n_head 3 divides only n_embd 48: the other widths' trials with 3 heads are invalid configs,
# refused by RunConfig's own check (each rank of attention needs whole heads)
ARCH_SPACE = {"n_layer": ("int", 1, 4), "n_embd": ("cat", (16, 32, 48, 64)),
              "n_head": ("cat", (1, 2, 3, 4)), "mlp_ratio": ("cat", (1, 2, 4))}
# The space runs from 0.16 MiB (1 layer of 16) to 5.2 MiB (4 of 64, ratio 4) by the estimate;
# 1.5 MiB refuses about a third of it, the large end.
BUDGET_BYTES = 1.5 * MiB
# Every candidate trains as hp_search's best region (lr 1e-2 at batch 8, from its sweep of the
# 2-layer model): 40 steps, a held-out evaluation at the end.
ARCH_BASE = BASE.replace(lr=1e-2, steps=40, eval_every=40)
MEMORY_KEYS = ("params", "grads", "optim", "activations")


@dataclass
class ArchSpec:
    base: dict  # RunConfig.to_dict() every candidate starts from
    budget_bytes: float = BUDGET_BYTES
    space: dict | None = None

    def __post_init__(self):
        self.space = {k: tuple(v) for k, v in (self.space or ARCH_SPACE).items()}

    @classmethod
    def make(cls, base: RunConfig = ARCH_BASE, **kw) -> "ArchSpec":
        return cls(base=base.to_dict(), **kw)


def estimated_bytes(cfg: RunConfig) -> float:
    """Bytes per rank by distlab.theory.estimate: parameters, gradients, optimizer state, activations."""
    est = estimate_run(cfg)
    return sum(est[k] for k in MEMORY_KEYS)


def admit(spec: ArchSpec, params: dict) -> tuple[RunConfig | None, str | None]:
    """(the candidate's config, None), or (None, why it is refused). Starts nothing."""
    try:
        cfg = RunConfig.from_dict(spec.base).replace(**params)
    except ValueError as e:
        return None, f"invalid: {e}"
    need = estimated_bytes(cfg)
    if need > spec.budget_bytes:
        return None, (f"over budget: needs {need / MiB:.2f} MiB > {spec.budget_bytes / MiB:.2f} "
                      "MiB (distlab.theory.estimate)")
    return cfg, None


def objective(spec: ArchSpec):
    """(held-out loss, parameters) of one candidate, or TrialPruned with the refusal's reason."""
    def run(trial: optuna.Trial):
        cfg, reason = admit(spec, suggest(trial, spec.space))
        if reason is not None:
            trial.set_user_attr("refused", reason)
            raise optuna.TrialPruned(reason)
        result, n_params, est = run_trial(cfg), gpt_params_of(cfg), estimate_run(cfg)
        record(trial, result, n_params=n_params, estimated={k: est[k] for k in MEMORY_KEYS})
        return result.loss, n_params
    return run


def arch_search(method: str, spec: ArchSpec, n_runs: int, seed: int, max_trials: int,
                population: int = 8, storage: str | None = None) -> optuna.Study:
    """Trials until n_runs candidates have run (or max_trials were drawn): refused ones do not
    count as runs. `population`: NSGA-II's generation size. The study keeps "run_folders" (how
    many run folders its trials made) and "refused" (how many trials the budget or RunConfig
    refused). The trials' runs go into one folder of their own under the runs folder (named as a
    run folder is, so distlab.caller.retention ages it out as one), so runs launched meanwhile by
    anything else do not count."""
    study = new_study(f"arch-{method}", sampler(method, seed, population=population),
                      storage=storage,
                      directions=("minimize", "minimize"), spec=asdict(spec))
    root = new_run_dir(runs_root(RunConfig.from_dict(spec.base).runs_root), f"arch-{method}")
    spec = replace(spec, base={**spec.base, "runs_root": root})

    def enough(study, _trial):
        if len(completed(study)) >= n_runs:
            study.stop()

    with torch_threads(1):
        study.optimize(objective(spec), n_trials=max_trials, callbacks=[enough])
    study.set_user_attr("run_folders", len(run_folders(root)))
    study.set_user_attr("refused", len(refused(study)))
    return study


def refused(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.trials if "refused" in t.user_attrs]


def estimate_vs_measured(studies) -> float:
    """Largest |estimated - measured| bytes over the completed trials' parameters, gradients,
    optimizer state and activations (rank 0's last step)."""
    return max(abs(measured(t)["estimated"][k] - measured(t)["memory"][k])
               for s in studies for t in completed(s) for k in MEMORY_KEYS)


# -- the Pareto front ----------------------------------------------------------------------------
def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates (both objectives minimised: another point
    at least as good on both and better on one)."""
    def dominated(p):
        return any(q[0] <= p[0] and q[1] <= p[1] and q != p for q in points)
    return [i for i, p in enumerate(points) if not dominated(p)]


def hypervolume(points: list[tuple[float, float]], ref: tuple[float, float]) -> float:
    """The area dominated by `points` and bounded by `ref` (two objectives, minimised): larger
    is a better front. Zitzler & Thiele 1998's S metric, which NSGA-II studies report."""
    front = sorted(points[i] for i in pareto_front(points) if points[i][0] < ref[0]
                   and points[i][1] < ref[1])
    area, prev_y = 0.0, ref[1]
    for x, y in front:  # x ascending, so y descends along a front
        area += (ref[0] - x) * (prev_y - y)
        prev_y = y
    return area


def points(study: optuna.Study) -> list[tuple[float, float]]:
    """(loss, parameters) of each completed trial."""
    return [tuple(t.values) for t in completed(study)]


def front_shares(studies: dict) -> dict:
    """Each study's share of the hypervolume of all studies' points together, with the
    reference point 5% beyond the worst loss and the largest model any of them ran."""
    everything = [p for s in studies.values() for p in points(s)]
    ref = (max(p[0] for p in everything) * 1.05, max(p[1] for p in everything) * 1.05)
    total = hypervolume(everything, ref)
    return {m: hypervolume(points(s), ref) / total for m, s in studies.items()}
