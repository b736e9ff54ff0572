"""Search by Optuna with real runs: the parts every study shares (hp_search.py and
arch_search.py build on them).

A trial is one distlab run (`launch(cfg)`), not a formula: its objective is the held-out loss
the run measured at its end (RunConfig.eval_every: 64 rows no training step reads). `run_trial`
launches it, reads its step events while it runs (StepFeed: the lines run.history("step")
returns, as the ranks write them), reports a loss to Optuna every `report_rows` rows of
training data, and stops the run (`run.stop()`) the moment the pruner says so
(`trial.should_prune()`): that is what early stopping saves, steps never run.

Samplers (`sampler(method, ...)`), each seeded so a study is the same study every time:

    grid     every combination of a few values per parameter (optuna.samplers.GridSampler)
    random   independent draws (Bergstra & Bengio 2012: when few parameters matter, random
             tries more distinct values of those than a grid of the same size)
    tpe      Tree-structured Parzen Estimator (Bergstra et al. 2011): models p(x | good) and
             p(x | bad) from the trials so far and samples where their ratio is largest
    gp       Gaussian-process Bayesian optimisation (Snoek et al. 2012): a GP posterior of the
             loss, next point where expected improvement is largest (optuna.samplers.GPSampler)
    nsga2    NSGA-II (Deb et al. 2002), for several objectives at once (arch_search.py)

TPE and GP start from the same seeded random trials as `random` (their first n_startup trials
are RandomSampler's draws with the same seed): the studies are paired, and differ from where
the model takes over.

**Storage.** Studies live in a database, by default the SQLite file `search.db` under the runs
folder (`storage_url()`), so a study outlives the kernel, `optuna.load_study` reopens it with
its trials, and several processes can add trials to one study at once (`study.optimize(...,
n_jobs=2)` in one process, or `python -m distlab.lab.hp_search --study NAME` in another: each
worker asks the storage for its next trial and writes its result back). Several *machines*
share a study the same way through a database server every machine can reach, e.g.
PostgreSQL or MySQL (SQLite is a local file; its locking is not safe across network
filesystems):

    storage = "postgresql://user:password@dbhost:5432/optuna"    # or mysql+pymysql://...
    optuna.create_study(storage=storage, study_name="lr-search", load_if_exists=True,
                        sampler=optuna.samplers.TPESampler(seed=rank))   # on every machine
    study.optimize(objective, n_trials=20)                            # each adds its trials

The first machine creates the study and the others load it (load_if_exists=True). Give each
machine its own sampler seed, or two machines draw the same "random" points. A pruner reads the
other machines' intermediate values from the same database, so pruning works across machines.
"""

from __future__ import annotations

import statistics

import contextlib
import math
import os
import sqlite3
import time
import uuid
from dataclasses import asdict, dataclass, field

import optuna
import sqlalchemy
import torch

from distlab import RunConfig, launch
from distlab.events import LogTail, rank_log_path
from distlab.caller.launch import runs_root

optuna.logging.set_verbosity(optuna.logging.WARNING)  # a line per trial would drown the cell

METHODS = ("grid", "random", "tpe", "gp")
# Random trials before TPE and GP fit their model. Optuna's default is 10; our studies have 8 to
# 24 trials, so 10 would leave the model almost nothing to do. 4 points in a 4-D space is the
# fewest that still gives the model a spread of losses to fit.
N_STARTUP = 4
POLL_S = 0.02  # how often run_trial reads a live run's events (a step takes ~8 ms here)


def storage_url(root: str = "") -> str:
    """The default storage: SQLite at <runs folder>/search.db (RunConfig.runs_root's rule)."""
    folder = runs_root(root)
    os.makedirs(folder, exist_ok=True)
    return f"sqlite:///{os.path.join(folder, 'search.db')}"


_STORAGES: dict[str, optuna.storages.RDBStorage] = {}


def open_storage(url: str) -> optuna.storages.RDBStorage:
    """Optuna's database storage for `url`, one per URL in this process. A SQLite file is put in
    write-ahead-log mode with synchronous=NORMAL: a commit is then an append, not an fsync, and
    readers do not block the writer (two workers on one file). Measured on the 2-core machine:
    a trial's storage writes (ask, params, result, a report, tell) took 0.16 s in SQLite's
    default mode and 0.04 s in this one. A crash of the machine may lose the last commits; the
    file stays consistent (SQLite's WAL guarantee)."""
    if url in _STORAGES:
        return _STORAGES[url]
    if url.startswith("sqlite:///"):
        with contextlib.closing(sqlite3.connect(url[len("sqlite:///"):])) as con:
            con.execute("PRAGMA journal_mode=WAL")  # kept in the file: every later opener
    storage = optuna.storages.RDBStorage(url)
    if url.startswith("sqlite:///"):
        sqlalchemy.event.listen(storage.engine, "connect", _synchronous_normal)
        storage.engine.dispose()  # the connections opened so far predate the listener
    _STORAGES[url] = storage
    return storage


def _synchronous_normal(dbapi_connection, _record):
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA synchronous=NORMAL")  # per connection, unlike journal_mode
    cursor.close()


def new_study(name: str, sampler: optuna.samplers.BaseSampler, *,
              storage: str | optuna.storages.BaseStorage | None = None,
              pruner: optuna.pruners.BasePruner | None = None, directions=("minimize",),
              spec: dict | None = None) -> optuna.Study:
    """A fresh study named `name-<6 hex>` (re-running a cell never mixes old trials in), in
    `storage` (a database URL or an optuna storage; None: storage_url()'s SQLite file).
    `spec`, the objective's plain-data description, is kept in the study's user attributes: a
    worker that loads the study anywhere rebuilds the same objective from it."""
    if storage is None or isinstance(storage, str):
        storage = open_storage(storage or storage_url())
    study = optuna.create_study(storage=storage, sampler=sampler,
                                pruner=pruner, study_name=f"{name}-{uuid.uuid4().hex[:6]}",
                                directions=list(directions))
    if spec is not None:
        study.set_user_attr("spec", spec)
    return study


def sampler(method: str, seed: int, grid: dict | None = None, n_startup: int = N_STARTUP,
            population: int = 8) -> optuna.samplers.BaseSampler:
    """A seeded sampler by name (module docstring). `grid`: {param: values}, for "grid";
    `population`: NSGA-II's generation size (its first generation is RandomSampler's draws)."""
    if method == "grid":
        if not grid:
            raise ValueError("method='grid' needs grid={param: [values, ...]}")
        return optuna.samplers.GridSampler(grid, seed=seed)
    if method == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if method == "tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup)
    if method == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=n_startup)
    if method == "nsga2":
        # our studies run 8-16 candidates, so generations of 50 (the default) would never get
        # past the first, random one
        return optuna.samplers.NSGAIISampler(population_size=population, seed=seed)
    raise ValueError(f"method={method!r} is not one of {METHODS + ('nsga2',)}")


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads in this process for a while. GPSampler fits its GP with torch in
    the caller's process, beside the ranks: on the 2-core machine one thread was faster
    (0.1-0.4 s per trial against 0.4-0.8 s with two, measured with a synthetic objective)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# -- the search space --------------------------------------------------------------------------
# {name: ("float", low, high, log) | ("int", low, high) | ("cat", (choices...))}
def suggest(trial: optuna.Trial, space: dict) -> dict:
    """Ask the trial for one value per parameter of `space`."""
    out = {}
    for name, (kind, *args) in space.items():
        if kind == "float":
            low, high, log = args
            out[name] = trial.suggest_float(name, low, high, log=log)
        elif kind == "int":
            out[name] = trial.suggest_int(name, *args)
        elif kind == "cat":
            out[name] = trial.suggest_categorical(name, list(args[0]))
        else:
            raise ValueError(f"{name}: kind {kind!r} is not 'float', 'int' or 'cat'")
    return out


def grid_values(space: dict, levels: dict) -> dict:
    """A grid inside `space`: `levels[name]` evenly spaced values from low to high (log-spaced
    for a log float; a categorical's first choices), or an explicit list; a parameter not in
    `levels` keeps one value, its lowest (first). The grid is exactly these values' product
    (GridSampler tries each once)."""
    out = {}
    for name, (kind, *args) in space.items():
        given = levels.get(name, 1)
        if isinstance(given, (list, tuple)):
            out[name] = list(given)
        elif kind == "cat":
            out[name] = list(args[0])[:given]
        elif given == 1:
            out[name] = [args[0]]  # low
        else:
            low, high = args[0], args[1]
            log = kind == "float" and args[2]
            ts = [i / (given - 1) for i in range(given)]
            vals = [low * (high / low) ** t if log else low + t * (high - low) for t in ts]
            vals[0], vals[-1] = low, high  # exactly: a rounded 0.10000000000000006 is outside
            out[name] = [round(v) for v in vals] if kind == "int" else vals
    return out


# -- one trial: one live run --------------------------------------------------------------------
@dataclass
class TrialRun:
    """What one trial's run measured."""
    loss: float | None  # held-out loss at the end; None when the run was stopped early
    steps_run: int  # steps every rank logged
    steps_planned: int
    rows_run: int  # training rows (sequences) those steps read
    wall_s: float  # launch to ended, as the caller waited for it
    train_s: float  # sum of the steps' own time (step_s)
    pruned_at: int | None = None  # rows at the report that pruned it
    # steps the pruner's decision left to run: those up to the report that pruned it (all
    # planned when none did); steps_run can be more, as the stop lands after the decision
    steps_needed: int | None = None
    curve: list = field(default_factory=list)  # [(rows, reported loss), ...]
    run_dir: str = ""
    memory: dict = field(default_factory=dict)  # rank 0's last step: bytes by category


def window_losses(step_losses: list[float], batch: int, report_rows: int) -> list[tuple]:
    """[(rows, mean loss of the steps that read those last report_rows rows), ...]: one point
    per report_rows rows, comparable across global batch sizes (each averages as many rows)."""
    if report_rows % batch:
        raise ValueError(f"report_rows={report_rows} must be a multiple of global_batch={batch}")
    per = report_rows // batch
    return [((k + 1) * report_rows, sum(step_losses[k * per:(k + 1) * per]) / per)
            for k in range(len(step_losses) // per)]


class StepFeed:
    """A live run's loss per step, read straight from its ranks' event logs (the same
    rank<r>.jsonl lines run.history("step") returns). The Run's monitor reads them every 0.1 s,
    12 steps of this model, which would let a doomed run go 12 steps past the report that
    dooms it; this reader is polled every POLL_S. Its own file handles: the monitor's are
    untouched."""

    def __init__(self, run):
        self.tails = [LogTail(rank_log_path(run.dir, r)) for r in range(run.world_size)]
        self.by_step: dict[int, dict[int, float]] = {}

    def losses(self) -> list[float]:
        """Mean loss over the ranks, for the steps every rank has logged, in order."""
        for rank, tail in enumerate(self.tails):
            for e in tail.read_new():
                if e["kind"] == "step" and e.get("loss") is not None:
                    self.by_step.setdefault(e["step"], {})[rank] = e["loss"]
        out = []
        while len(self.by_step.get(len(out), {})) == len(self.tails):
            got = self.by_step[len(out)]
            out.append(sum(got.values()) / len(got))
        return out

    def close(self):
        for t in self.tails:
            t.close()


TRIALS_FOLDER = "search-trials"  # under the runs root: where run_trial's runs go by default


def run_trial(cfg: RunConfig, trial: optuna.Trial | None = None, report_rows: int = 0,
              prune: bool = False) -> TrialRun:
    """Launch `cfg` and follow it live: every report_rows rows, report the window's mean loss to
    `trial`; with prune=True stop the run as soon as trial.should_prune() says so. Returns
    what the run measured; the held-out loss needs cfg.eval_every (its last "eval" event)."""
    t0 = time.perf_counter()
    if not cfg.runs_root:  # a study's many runs keep to a folder of their own, so the runs
        # root's retention (the newest 100) never trades the notebooks' runs for trials
        cfg = cfg.replace(runs_root=os.path.join(runs_root(), TRIALS_FOLDER))
    run = launch(cfg)
    feed = StepFeed(run)
    curve, pruned_at = [], None
    try:
        while pruned_at is None:
            finished = run.done  # read first: after it, the events are complete
            if trial is not None and report_rows:
                points = window_losses(feed.losses(), cfg.global_batch, report_rows)
                for rows, value in points[len(curve):]:
                    curve.append((rows, value))
                    trial.report(value, rows)
                    if prune and trial.should_prune():
                        pruned_at = rows
                        break
            if finished:
                break
            time.sleep(POLL_S)
        if pruned_at is not None:
            run.stop()
        else:
            run.wait(progress=False)  # it has finished: a progress line per trial is noise
    except BaseException:
        run.stop()
        raise
    finally:
        feed.close()
    wall = time.perf_counter() - t0
    steps = run.history("step", rank=0)
    evals = [e for e in run.history("eval", rank=0) if e["step"] == cfg.steps]
    loss = evals[0]["loss"]["task0"] if evals and pruned_at is None else None
    return trial_result(run, cfg, loss, run.steps_done(), wall, pruned_at=pruned_at,
                        steps_needed=(cfg.steps if pruned_at is None
                                      else pruned_at // cfg.global_batch),
                        curve=curve, memory=steps[-1]["memory"] if steps else {})


def trial_result(run, cfg: RunConfig, loss: float | None, steps_run: int, wall_s: float,
                 **kw) -> TrialRun:
    """A finished (or stopped) run's TrialRun: its rows and its steps' own time (rank 0)."""
    return TrialRun(loss=loss, steps_run=steps_run, steps_planned=cfg.steps,
                    rows_run=steps_run * cfg.global_batch, wall_s=wall_s,
                    train_s=sum(e["step_s"] for e in run.history("step", rank=0)),
                    run_dir=run.dir, **kw)


def record(trial: optuna.Trial, result: TrialRun, **extra) -> None:
    """Keep what the run measured with the trial, as its user attribute "run" (in the storage:
    a reloaded study has it). One attribute, one write: each is a transaction of its own."""
    trial.set_user_attr("run", {**asdict(result), **extra})


def measured(trial: optuna.trial.FrozenTrial) -> dict:
    """What a trial's run measured (record's dict), {} for a trial that never ran."""
    return trial.user_attrs.get("run", {})


def held_out_loss(run, steps: int) -> float:
    """The held-out loss of a finished Run after `steps` steps (its "eval" event)."""
    return next(e["loss"]["task0"] for e in run.history("eval", rank=0) if e["step"] == steps)


# -- reading studies ---------------------------------------------------------------------------
def completed(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]


def best_so_far(study: optuna.Study) -> list[float]:
    """After each trial (in order), the best loss of the completed trials so far (inf before
    the first one completes)."""
    out, best = [], math.inf
    for t in study.trials:
        if t.state == optuna.trial.TrialState.COMPLETE:
            best = min(best, t.value)
        out.append(best)
    return out


def trials_to_reach(study: optuna.Study, target: float) -> int | None:
    """How many trials the study spent before its best loss was <= target (None: never)."""
    for i, best in enumerate(best_so_far(study)):
        if best <= target:
            return i + 1
    return None


def near_best(studies, untrained_loss: float, fraction: float = 0.02) -> float:
    """A target loss: the best any of the studies found, plus `fraction` of the way back up to
    the untrained loss (ln V for our data). 'As good as the best found', without asking for its
    last few thousandths."""
    best = min(s.best_value for s in studies)
    return best + fraction * (untrained_loss - best)


def search_overhead_s(study: optuna.Study) -> float:
    """Mean seconds per trial spent outside the run: the sampler's proposal (a GP fit, a
    TPE density), the storage's writes and the polling loop. Trial duration minus its run's
    wall time."""
    gaps = [(t.datetime_complete - t.datetime_start).total_seconds() - measured(t)["wall_s"]
            for t in study.trials if t.datetime_complete and measured(t)]
    return sum(gaps) / len(gaps) if gaps else float("nan")


def launch_overheads(trials) -> dict:
    """Medians over `trials` (statistics.median_high: a trial's own figure, never an average of
    two) of each run's wall time, its steps' time, and what a trial costs besides its steps:
    launch, evaluation and teardown (wall - steps); "overheads_s" holds every trial's."""
    runs = [measured(t) for t in trials]
    return {"trials": len(runs),
            "wall_s": statistics.median_high(m["wall_s"] for m in runs),
            "train_s": statistics.median_high(m["train_s"] for m in runs),
            "overhead_s": statistics.median_high(m["wall_s"] - m["train_s"] for m in runs),
            "overheads_s": [m["wall_s"] - m["train_s"] for m in runs]}
