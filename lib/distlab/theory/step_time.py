"""How long a data-parallel step should take: measured compute plus the communication the α-β
model says cannot be hidden.

    predicted step = forward + backward + optimizer + exposed communication

The terms, each measured or fitted on this machine:

* **compute**: forward, backward and the optimizer's step, timed in one process on the shapes
  one rank computes (its share of the global batch). Under ZeRO each rank steps 1/N of the
  parameters; an elementwise optimizer's time grows with the elements it updates, so the
  one-process optimizer time is divided by N.
* **each collective**: t = α + B/β per call (Hockney's model), α and β fitted per kind
  (all_reduce, all_gather, reduce_scatter) from timed calls on this machine's ranks, B the
  bytes one call sends per rank by the ring's count (what distlab.comm books). The model is
  linear in B, so a step's total for a kind is calls·α + bytes/β whatever the calls' sizes.
* **what overlaps** (`EXPOSED`): a collective issued while compute is left to do can hide
  behind it; one the next computation needs at once cannot. Each strategy's rule names the
  compute that can hide its collectives and the one call that never hides.

Compute and communication share this machine's cores (gloo's threads run the collectives), so
"hidden" here means "issued while compute runs", not free: where the measured step exceeds the
prediction, that contention is the first suspect, and the benchmark prints both figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class AlphaBeta:
    """One collective kind on this machine: α seconds per call, β bytes per second."""
    alpha: float
    beta: float

    def seconds(self, calls: float, nbytes: float) -> float:
        return calls * self.alpha + nbytes / self.beta


@dataclass(frozen=True)
class Compute:
    """One rank's compute in a step, seconds (one-process timings of the rank's shapes)."""
    forward: float
    backward: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.optimizer


@dataclass
class StepPrediction:
    strategy: str
    compute: Compute
    comm: dict  # kind -> modelled seconds of all the step's calls of that kind
    exposed: float  # modelled seconds the step waits on communication
    terms: dict = field(default_factory=dict)  # the exposed figure's parts, by name

    @property
    def total(self) -> float:
        return self.compute.total + self.exposed

    @property
    def comm_total(self) -> float:
        return sum(self.comm.values())


def behind(total: float, unhidden: float, compute: float) -> float:
    """Exposed seconds of collectives taking `total`, issued while `compute` seconds of work
    remain, of which one call (`unhidden` seconds) always waits: unhidden + what the compute
    cannot cover."""
    unhidden = min(unhidden, total)
    return unhidden + max(0.0, total - unhidden - compute)


def _per_call(seconds: float, calls: int) -> float:
    return seconds / calls if calls else 0.0


def _allreduce(c: Compute, t: dict, n: dict) -> dict:
    # one blocking all-reduce per gradient after backward: nothing left to hide behind
    return {"all-reduce after backward": t["all_reduce"]}


def _ddp(c: Compute, t: dict, n: dict) -> dict:
    # buckets all-reduced as backward fills them (Li et al. 2020): the last waits
    last = _per_call(t["all_reduce"], n["all_reduce"])
    return {"last bucket (≈ mean bucket)": min(last, t["all_reduce"]),
            "buckets backward cannot cover": behind(t["all_reduce"], last, c.backward) - last}


def _zero1(c: Compute, t: dict, n: dict) -> dict:
    # reduce-scatters after backward, all-gathers after the step: both blocking
    return {"reduce-scatter after backward": t["reduce_scatter"],
            "all-gather after the step": t["all_gather"]}


def _zero2(c: Compute, t: dict, n: dict) -> dict:
    # reduce-scatters in backward, one unit behind; all-gathers after the step, blocking
    last = _per_call(t["reduce_scatter"], n["reduce_scatter"])
    return {"last reduce-scatter": min(last, t["reduce_scatter"]),
            "reduce-scatters backward cannot cover":
                behind(t["reduce_scatter"], last, c.backward) - last,
            "all-gather after the step": t["all_gather"]}


def _zero3(c: Compute, t: dict, n: dict) -> dict:
    # all-gathers prefetched a unit ahead in forward and in backward: the first of each pass
    # waits; reduce-scatters in backward as zero2's
    first = _per_call(t["all_gather"], n["all_gather"])
    first_two = min(2 * first, t["all_gather"])
    last_rs = _per_call(t["reduce_scatter"], n["reduce_scatter"])
    return {"first all-gather of forward and of backward": first_two,
            "all-gathers compute cannot cover":
                behind(t["all_gather"], first_two, c.forward + c.backward) - first_two,
            "last reduce-scatter": min(last_rs, t["reduce_scatter"]),
            "reduce-scatters backward cannot cover":
                behind(t["reduce_scatter"], last_rs, c.backward) - last_rs}


EXPOSED = {"single": lambda c, t, n: {}, "allreduce": _allreduce, "ddp": _ddp,
           "zero1": _zero1, "zero2": _zero2, "zero3": _zero3}
SHARDED_OPTIMIZER = ("zero1", "zero2", "zero3")


def predict(strategy: str, world: int, compute: Compute, booked: dict,
            fits: dict) -> StepPrediction:
    """The step `strategy` should take on `world` ranks.

    compute: one process's forward, backward and optimizer seconds at one rank's batch (the
    optimizer over all parameters; divided by `world` here where ZeRO shards it). booked:
    kind -> {"calls", "bytes_sent"} of one step, as distlab.comm books them per rank. fits:
    kind -> AlphaBeta."""
    if strategy not in EXPOSED:
        raise ValueError(f"strategy={strategy!r}: a prediction exists for {sorted(EXPOSED)}")
    if world < 1:
        raise ValueError(f"world={world!r} must be >= 1")
    if strategy in SHARDED_OPTIMIZER:
        compute = Compute(compute.forward, compute.backward, compute.optimizer / world)
    calls = {k: int(booked.get(k, {}).get("calls", 0)) for k in KINDS}
    comm = {}
    for k in KINDS:
        if calls[k]:
            if k not in fits:
                raise ValueError(f"{strategy} calls {k} but no α-β fit for it was given")
            comm[k] = fits[k].seconds(calls[k], booked[k]["bytes_sent"])
        else:
            comm[k] = 0.0
    terms = EXPOSED[strategy](compute, comm, calls)
    return StepPrediction(strategy, compute, {k: v for k, v in comm.items() if calls[k]},
                          sum(terms.values()), terms)
