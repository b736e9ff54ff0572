"""How long a step should take: measured compute plus the communication the α-β
model says cannot be hidden.

    predicted step = forward + backward + optimizer + exposed communication

The terms, each measured or fitted on this machine:

* **compute**: the strategy's step run in one process as one of its ranks, with collectives
  that move nothing (distlab.studies.step_limit): the rank's own shapes, copies and optimizer
  (under ZeRO, 1/N of the parameters). Its split into forward, backward and optimizer, the
  windows collectives hide behind, is the plain model's (`Compute.of_step`).
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

Collectives are booked under the kind their code names (distlab.comm: "tp.all_reduce",
"pp_send_act", "cp.kv", ...); `FIT_KIND` maps each to the fitted kind whose α and β price it.
Receives cost nothing of their own (the matching send is priced); a kind that is in neither
table is refused, so a new collective cannot drop out of the prediction in silence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send")
FIT_KIND = {"all_reduce": "all_reduce", "tp.all_reduce": "all_reduce",
            "sp.grad_all_reduce": "all_reduce", "tp.grad_norm": "all_reduce",
            "barrier": "all_reduce",  # gloo's barrier is an all-reduce of a token: α
            "all_gather": "all_gather", "sp.all_gather": "all_gather",
            "reduce_scatter": "reduce_scatter", "sp.reduce_scatter": "reduce_scatter",
            "send": "send", "pp_send_act": "send", "pp_send_grad": "send", "pp_shapes": "send",
            "cp.kv": "send", "cp.dkv": "send"}
RECEIVES = ("recv", "pp_recv_act", "pp_recv_grad")


@dataclass(frozen=True)
class AlphaBeta:
    """One collective kind on this machine: α seconds per call, β bytes per second."""
    alpha: float
    beta: float

    def seconds(self, calls: float, nbytes: float) -> float:
        return calls * self.alpha + nbytes / self.beta


@dataclass(frozen=True)
class Compute:
    """One rank's compute in a step, seconds (one-process timings of the rank's shapes).
    attention: the part of forward + backward that ring attention's hops hide behind (cp)."""
    forward: float
    backward: float
    optimizer: float
    attention: float = 0.0

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.optimizer

    @classmethod
    def of_step(cls, step_s: float, plain: "Compute", optimizer_share: float = 1.0,
                attention: float = 0.0) -> "Compute":
        """The strategy's one-process step (`step_s`: its own shapes and code, collectives that
        move nothing) split as the plain model's forward/backward/optimizer timings are, the
        optimizer's first multiplied by `optimizer_share` (1/N where ZeRO steps 1/N of the
        parameters)."""
        parts = (plain.forward, plain.backward, plain.optimizer * optimizer_share)
        k = step_s / sum(parts)
        return cls(*(k * x for x in parts), attention=attention)


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
    # all-gathers prefetched a unit ahead in forward and in backward; forward's first starts
    # between steps (distlab's zero3 strategy), so only backward's first waits: it is issued
    # when forward ends. Reduce-scatters in backward as zero2's
    first = min(_per_call(t["all_gather"], n["all_gather"]), t["all_gather"])
    last_rs = _per_call(t["reduce_scatter"], n["reduce_scatter"])
    return {"first all-gather of backward": first,
            "all-gathers compute cannot cover":
                behind(t["all_gather"], first, c.forward + c.backward) - first,
            "last reduce-scatter": min(last_rs, t["reduce_scatter"]),
            "reduce-scatters backward cannot cover":
                behind(t["reduce_scatter"], last_rs, c.backward) - last_rs}


def _tp(c: Compute, t: dict, n: dict) -> dict:
    # Megatron's f and g: each all-reduce's result is the next layer's input (forward) or
    # gradient (backward), waited on where it is issued: nothing hides
    return {"tensor-parallel all-reduces, each waited on at once": sum(t.values())}


def _pp(c: Compute, t: dict, n: dict, world: int, microbatches: int) -> dict:
    # GPipe and 1F1B (Huang et al. 2019; Narayanan et al. 2021): the bottleneck stage's
    # forward + backward stretched by (m + p - 1) / m; on the fill and drain path one
    # micro-batch's activation crosses p - 1 boundaries forward and its gradient p - 1 back
    sends = [k for k in ("pp_send_act", "pp_send_grad") if n.get(k)]
    hop = sum(t[k] for k in sends) / sum(n[k] for k in sends) if sends else 0.0
    return {f"bubble: (p-1)/m of forward + backward (p {world}, m {microbatches})":
                (world - 1) / microbatches * (c.forward + c.backward),
            "activation and gradient hops on the fill and drain path": 2 * (world - 1) * hop,
            "barriers": t.get("barrier", 0.0)}


def _cp(c: Compute, t: dict, n: dict, world: int) -> dict:
    # ring attention (Liu et al. 2023): each round's K/V hop is issued before the round's block
    # is computed; the last round's dK/dV hop back to the owner has nothing after it
    hops = t.get("cp.kv", 0.0) + t.get("cp.dkv", 0.0)
    last = t.get("cp.dkv", 0.0) / world
    return {"last dK/dV hop of each layer": last,
            "hops ring attention's compute cannot cover": behind(hops, last, c.attention) - last,
            "gradient all-reduce after backward": t.get("all_reduce", 0.0)}


EXPOSED = {"single": lambda c, t, n: {}, "allreduce": _allreduce, "ddp": _ddp,
           "zero1": _zero1, "zero2": _zero2, "zero3": _zero3, "tp": _tp, "pp": _pp, "cp": _cp}
SHARDED_OPTIMIZER = ("zero1", "zero2", "zero3")


def predict(strategy: str, world: int, compute: Compute, booked: dict, fits: dict,
            microbatches: int = 1) -> StepPrediction:
    """The step `strategy` should take on `world` ranks.

    compute: the rank's compute (for pp: the slowest stage's), Compute.of_step from its
    one-process step. booked: kind -> {"calls", "bytes_sent"} of one step, as distlab.comm
    books them per rank. fits: fitted kind (KINDS) -> AlphaBeta. microbatches: pp's m."""
    if strategy not in EXPOSED:
        raise ValueError(f"strategy={strategy!r}: a prediction exists for {sorted(EXPOSED)}")
    if world < 1:
        raise ValueError(f"world={world!r} must be >= 1")
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches!r} must be >= 1")
    t, n = {}, {}
    for kind, b in booked.items():
        calls = int(b.get("calls", 0))
        if kind in RECEIVES or not calls:
            continue
        if kind not in FIT_KIND:
            raise ValueError(f"{strategy} books {kind!r}, which no fitted kind prices: add it "
                             "to FIT_KIND (or RECEIVES)")
        fitted = FIT_KIND[kind]
        if fitted not in fits:
            raise ValueError(f"{strategy} calls {fitted} ({kind}) but no α-β fit for it was "
                             "given")
        t[kind], n[kind] = fits[fitted].seconds(calls, b["bytes_sent"]), calls
    for k in ("all_reduce", "all_gather", "reduce_scatter"):
        t.setdefault(k, 0.0)
        n.setdefault(k, 0)
    rule = EXPOSED[strategy]
    if strategy == "pp":
        terms = rule(compute, t, n, world, microbatches)
    elif strategy == "cp":
        terms = rule(compute, t, n, world)
    else:
        terms = rule(compute, t, n)
    return StepPrediction(strategy, compute, {k: v for k, v in t.items() if n[k]},
                          sum(terms.values()), terms)
