"""Hyper-parameter search over real runs: learning rate, warm-up, global batch, weight decay.

Each trial trains the tiny GPT (world size 1) on a fixed budget of training rows, `rows`
sequences: steps = rows // global_batch, so a larger batch takes fewer, larger steps at the
same compute, and the search has a real trade-off to find rather than "more data is better".
The objective is the held-out loss after the last step (64 rows no step trains on); every
trial starts from the same seed, so a configuration's loss is the same number every time it
is run, and a seeded study is the same study every time.

    compare_methods(spec, n, seed)          grid, random, TPE and GP, n trials each
    random_vs_grid(spec, levels, seeds)     two parameters, one that matters (lr) and one that
                                            barely does (weight decay): Bergstra & Bengio 2012
    pruning_comparison(spec, n, seed)       the same n trials unpruned, under successive halving
                                            (Jamieson & Talwalkar 2016) and Hyperband (Li et al.
                                            2018): steps and seconds saved, best trial kept?
    parallel_speedup(spec, params, n_jobs)  the same trials by 1 and by n_jobs workers
    optimize_together(study, spec, n)       non-adaptive samplers (grid, random): n trials asked
                                            up front and trained in ONE launch (lab.runs)

A worker in another process, or on another machine (the storage must be a database server
then; distlab.lab.search's docstring), adds trials to a study made here:

    python -m distlab.lab.hp_search --storage sqlite:///runs/search.db --study NAME --trials 4
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass

import optuna

from distlab import RunConfig
from distlab.lab.runs import launch_together
from distlab.lab.search import (
    N_STARTUP,
    completed,
    grid_values,
    held_out_loss,
    measured,
    new_study,
    open_storage,
    record,
    run_trial,
    sampler,
    suggest,
    torch_threads,
    trial_result,
)

# lr spans the useless (1e-4: barely moves in 40 steps) to the unstable (1e-1 with AdamW);
# warm-up up to 16 steps, more than a batch-32 trial's 10 steps (a real trap to find); weight
# decay up to 0.1, AdamW's decoupled decay: over 40 steps at lr 1e-2 it shrinks weights by at
# most 4%, which is why it barely matters here.
HP_SPACE = {"lr": ("float", 1e-4, 1e-1, True), "warmup_steps": ("int", 0, 16),
            "global_batch": ("cat", (8, 16, 32)), "weight_decay": ("float", 0.0, 0.1, False)}
# The trial model: ~30k parameters, 16-token Markov sequences, one rank with one thread; a step
# of batch 8 takes ~8 ms on the 2-core machine.
BASE = RunConfig(strategy="single", n_layer=2, n_embd=32, n_head=2, seq_len=16, vocab_size=32,
                 global_batch=8, steps=40, threads_per_rank=1, timeout_s=60)
ROWS = 320  # training sequences per trial: 40 steps at batch 8, 10 at batch 32
REPORT_ROWS = 64  # pruning: a report every 64 rows (every 8 steps at batch 8, 2 at batch 32)


@dataclass
class HPSpec:
    """The objective, as plain data (kept in the study, so a worker anywhere rebuilds it)."""
    base: dict  # RunConfig.to_dict() every trial starts from
    rows: int = ROWS
    space: dict | None = None  # HP_SPACE when None
    report_rows: int = 0  # > 0: report the live loss to the pruner every report_rows rows
    prune: bool = False

    def __post_init__(self):
        self.space = {k: tuple(v) for k, v in (self.space or HP_SPACE).items()}
        kind, *args = self.space.get("global_batch", ("cat", (self.base["global_batch"],)))
        bad = [b for b in args[0] if self.rows % b] if kind == "cat" else ["not a choice"]
        if bad:
            raise ValueError(f"rows={self.rows} must divide by every global_batch choice "
                             f"(steps = rows // global_batch); not by {bad}")

    @classmethod
    def make(cls, base: RunConfig = BASE, **kw) -> "HPSpec":
        return cls(base=base.to_dict(), **kw)

    def config(self, params: dict) -> RunConfig:
        """The run of one trial: the base with `params`, steps = rows // global_batch, and a
        held-out evaluation after the last step (eval_every = steps)."""
        base = RunConfig.from_dict(self.base)
        steps = self.rows // params.get("global_batch", base.global_batch)
        return base.replace(**params, steps=steps, eval_every=steps)


def objective(spec: HPSpec):
    """Optuna's objective: one live run per trial (search.run_trial), its held-out loss."""
    def run(trial: optuna.Trial) -> float:
        result = run_trial(spec.config(suggest(trial, spec.space)), trial, spec.report_rows,
                           spec.prune)
        record(trial, result)
        if result.pruned_at is not None:
            raise optuna.TrialPruned(f"stopped after {result.rows_run} of {spec.rows} rows")
        return result.loss
    return run


def optimize(study: optuna.Study, spec: HPSpec, n_trials: int, n_jobs: int = 1):
    """study.optimize with our objective; the GP's fit runs on one thread (search.torch_threads).
    A failed run raises (catch=()): a crash is a bug, not a bad hyper-parameter."""
    with torch_threads(1):
        study.optimize(objective(spec), n_trials=n_trials, n_jobs=n_jobs)
    return study


def optimize_together(study: optuna.Study, spec: HPSpec, n_trials: int) -> float:
    """For samplers that do not learn from results (grid, random): ask n_trials up front, train
    them one after another in ONE launch (lab.runs.launch_together), tell the losses. The same
    runs as one launch each (a trial's run depends only on its config), less the launches.
    Returns the launch's wall seconds."""
    trials = [study.ask() for _ in range(n_trials)]
    cfgs = {str(t.number): spec.config(suggest(t, spec.space)) for t in trials}
    t0 = time.perf_counter()
    runs = launch_together(cfgs, name="search-together")
    wall = time.perf_counter() - t0
    for t in trials:
        cfg, run = cfgs[str(t.number)], runs[str(t.number)]
        result = trial_result(run, cfg, held_out_loss(run, cfg.steps),
                              len(run.history("step", rank=0)), wall / n_trials)
        record(t, result)
        _tell(study, t, result.loss)
    return wall


def _tell(study: optuna.Study, trial: optuna.Trial, value: float) -> None:
    """study.tell, for a grid's last trial too: GridSampler.after_trial calls study.stop() once
    the grid is done, which raises outside study.optimize(); optuna records the trial's value
    and state before that (optuna.study._tell: the storage write is in a `finally`)."""
    try:
        study.tell(trial, value)
    except RuntimeError as e:
        if "Study.stop" not in str(e):
            raise


# -- the comparisons -----------------------------------------------------------------------------
def compare_methods(spec: HPSpec, n_trials: int, seed: int, grid: dict,
                    methods=("grid", "random", "tpe", "gp"), n_startup: int = N_STARTUP,
                    storage: str | None = None) -> dict[str, optuna.Study]:
    """One study per method, n_trials live trials each (the grid: its product of values, which
    should be n_trials). Every study has the same seed; TPE and GP fit their model after
    n_startup random trials."""
    out = {}
    for m in methods:
        study = new_study(f"hp-{m}", sampler(m, seed, grid if m == "grid" else None,
                                             n_startup=n_startup),
                          storage=storage, spec=asdict(spec))
        out[m] = optimize(study, spec, n_trials)
    return out


def random_vs_grid(spec: HPSpec, levels: int, seeds=(0,), storage: str | None = None) -> dict:
    """A levels x levels grid against random search with as many trials, per seed, over
    spec.space (two parameters). Trials go through optimize_together: neither sampler learns
    from results. Returns {"grid": study, "random": [study per seed], "walls": [seconds]}."""
    grid = grid_values(spec.space, {k: levels for k in spec.space})
    n = levels ** len(spec.space)
    g = new_study("rvg-grid", sampler("grid", seeds[0], grid), storage=storage, spec=asdict(spec))
    walls = [optimize_together(g, spec, n)]
    randoms = []
    for s in seeds:
        r = new_study(f"rvg-random{s}", sampler("random", s), storage=storage, spec=asdict(spec))
        walls.append(optimize_together(r, spec, n))
        randoms.append(r)
    return {"grid": g, "random": randoms, "walls": walls, "trials_per_launch": n}


def main_effects(study: optuna.Study) -> dict[str, float]:
    """Per parameter: the spread (max - min) of the mean loss at each of its values, over the
    study's completed trials. On a full grid this is the parameter's main effect: how much the
    loss moves when it alone changes, the other averaged out."""
    trials = completed(study)
    out = {}
    for name in trials[0].params:
        by_value: dict = {}
        for t in trials:
            by_value.setdefault(t.params[name], []).append(t.value)
        means = [sum(v) / len(v) for v in by_value.values()]
        out[name] = max(means) - min(means)
    return out


def pruning_comparison(spec: HPSpec, n_trials: int, seed: int, pruners: dict | None = None,
                       storage: str | None = None) -> dict[str, optuna.Study]:
    """The same n_trials random configurations three times: unpruned (every run to the end,
    its live losses reported), then under each pruner (runs stopped when pruned). Every study
    trains exactly the unpruned study's configurations (enqueued), so the difference is only
    what pruning stopped."""
    if not spec.report_rows:
        raise ValueError("pruning needs spec.report_rows > 0 (how often the live loss is "
                         "reported)")
    pruners = pruners if pruners is not None else default_pruners(spec)
    live = HPSpec(**{**asdict(spec), "prune": False})
    ref = new_study("prune-none", sampler("random", seed), storage=storage,
                    pruner=optuna.pruners.NopPruner(), spec=asdict(live))
    out = {"unpruned": optimize(ref, live, n_trials)}
    pruned = HPSpec(**{**asdict(spec), "prune": True})
    for name, pruner in pruners.items():
        study = new_study(f"prune-{name.replace(' ', '-')}", sampler("random", seed),
                          storage=storage, pruner=pruner, spec=asdict(pruned))
        for t in ref.trials:
            study.enqueue_trial(t.params)
        out[name] = optimize(study, pruned, n_trials)
    return out


def pruning_repeats(pruning: dict, spec: HPSpec, repeats: int,
                    storage: str | None = None) -> dict[str, dict]:
    """Steps saved is a race: a pruned run is stopped by the caller, and the steps it runs
    before the stop lands depend on the machine's load (a short run may even finish first). So
    each pruner's studies run `repeats` times in all (`pruning` is the first:
    pruning_comparison's), on the unpruned study's configurations. Per pruner: "saved", the
    share of the unpruned study's steps saved, one per repeat (timed); "decided", the share the
    pruner's decisions saved (the steps after each report that pruned a trial: what a stop
    that lands at once saves; a count, the same in every repeat when the decisions are); and
    "kept", whether every repeat kept the unpruned best trial (measured)."""
    ref = pruning["unpruned"]
    ref_steps = compute_spent(ref)["steps_run"]
    pruned = HPSpec(**{**asdict(spec), "prune": True})
    out = {}
    for name in default_pruners(spec):
        studies = [pruning[name]]
        for _ in range(repeats - 1):
            study = new_study(f"prune-{name.replace(' ', '-')}", sampler("random", 0),
                              storage=storage, pruner=default_pruners(spec)[name],
                              spec=asdict(pruned))
            for t in ref.trials:
                study.enqueue_trial(t.params)
            studies.append(optimize(study, pruned, len(ref.trials)))
        out[name] = {
            "saved": [1 - compute_spent(s)["steps_run"] / ref_steps for s in studies],
            "decided": [1 - sum(measured(t)["steps_needed"] for t in s.trials) / ref_steps
                        for s in studies],
            "kept": all(s.best_trial.number == ref.best_trial.number
                        and s.best_value == ref.best_value for s in studies)}
    return out


def default_pruners(spec: HPSpec) -> dict:
    """Successive halving and Hyperband with reduction factor 3 (Li et al.'s η = 3), the first
    rung at the first report; resources are rows of training data."""
    return {"successive halving": optuna.pruners.SuccessiveHalvingPruner(
                min_resource=spec.report_rows, reduction_factor=3),
            "hyperband": optuna.pruners.HyperbandPruner(
                min_resource=spec.report_rows, max_resource=spec.rows, reduction_factor=3)}


def compute_spent(study: optuna.Study) -> dict:
    """Steps, rows and seconds the study's runs took (measured: steps logged, wall clock)."""
    ts = [measured(t) for t in study.trials if measured(t)]
    return {k: sum(m[k] for m in ts)
            for k in ("steps_run", "steps_planned", "rows_run", "wall_s", "train_s")}


def pruning_rows(pruning: dict) -> tuple[list[list], list[bool]]:
    """The pruning table, a row per study (pruned trials, steps run and saved, seconds and
    seconds saved against the unpruned study, its best trial), and for each pruned study
    whether it kept the unpruned study's best trial (the same trial, the same loss to the bit)
    and still saved steps."""
    spent = {k: compute_spent(s) for k, s in pruning.items()}
    ref = pruning["unpruned"].best_trial
    rows, ok = [], []
    for name, study in pruning.items():
        c = spent[name]
        n_pruned = sum(t.state == optuna.trial.TrialState.PRUNED for t in study.trials)
        kept = study.best_trial.number == ref.number and study.best_value == ref.value
        saved = 1 - c["steps_run"] / spent["unpruned"]["steps_run"]
        if name != "unpruned":
            ok.append(kept and saved > 0)
        rows.append([name, f"{n_pruned} of {len(study.trials)}", c["steps_run"], f"{saved:.0%}",
                     f"{c['wall_s']:.1f}", f"{1 - c['wall_s'] / spent['unpruned']['wall_s']:.0%}",
                     f"{study.best_value:.3f} (trial {study.best_trial.number})"])
    return rows, ok


def parallel_speedup(spec: HPSpec, params: list[dict], n_jobs: int = 2,
                     storage: str | None = None) -> dict:
    """The same trials (params, enqueued) by one worker and by n_jobs workers (threads of this
    process, each launching its own run) against one study in the storage. Returns the wall
    seconds of each and the n_jobs study."""
    out = {}
    for jobs in (1, n_jobs):
        study = new_study(f"parallel-{jobs}", sampler("random", 0), storage=storage,
                          spec=asdict(spec))
        for p in params:
            study.enqueue_trial(p)
        t0 = time.perf_counter()
        optimize(study, spec, len(params), n_jobs=jobs)
        out[jobs] = {"wall_s": time.perf_counter() - t0, "study": study}
    return out


# -- a worker in another process ----------------------------------------------------------------
def main(argv=None):
    """Add trials to a study made elsewhere: the objective comes from the study itself."""
    p = argparse.ArgumentParser(prog="python -m distlab.lab.hp_search",
                                description="add trials to a distlab hyper-parameter study")
    p.add_argument("--storage", required=True, help="sqlite:///path or a database URL")
    p.add_argument("--study", required=True, help="the study's name")
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--sampler", default="random", choices=("random", "tpe", "gp"))
    p.add_argument("--seed", type=int, default=1, help="differ per worker, or they draw alike")
    a = p.parse_args(argv)
    study = optuna.load_study(study_name=a.study, storage=open_storage(a.storage),
                              sampler=sampler(a.sampler, a.seed))
    spec = HPSpec(**study.user_attrs["spec"])
    optimize(study, spec, a.trials)
    print(f"{a.study}: {len(study.trials)} trials, best {study.best_value:.4f}")


if __name__ == "__main__":
    main()
