"""Which communication hides, read two ways for 13_search_and_time: the overlap conditions of
distlab.theory.overlap (compute per byte against a link), and the waits measured on the ranks
of the step-limit study (distlab.studies.step_limit: per step, the seconds blocked in
communication).

    conditions(base, world, flops, links)  per link, DP's, TP's and PP's Overlap for the
                                           configs the study ran
    exposed_shares(result, strategy)       per step, the seconds blocked over the modelled
                                           seconds of the strategy's communication
    overlap_claim(conds, shares, bar)      the claims row: does the condition say "hides"
                                           exactly where the ranks hid most of it?
"""

from __future__ import annotations

from distlab.lab.common import claim
from distlab.lab.timed import fmt_spread, within
from distlab.studies.step_limit import strategy_config
from distlab.theory.estimate import gpt_params_of
from distlab.theory.overlap import Overlap, dp_overlap, pp_overlap, tp_overlap

MEASURED = {"DP": "ddp", "TP": "tp"}  # the study's strategies whose waits are their transfers
HIDES_BAR = 0.5  # "hides": at most half of the modelled communication seen as a wait


def conditions(base, world: int, flops: float, links: dict[str, float]) -> dict:
    """{link name: [DP, TP, PP Overlap]} for `base` as the study runs it on `world` ranks
    (strategy_config), at `flops` FLOP/s and each link's bytes/s; fp32 values (4 bytes)."""
    dp, tp, pp = (strategy_config(base, s, world) for s in ("ddp", "tp", "pp"))
    tokens = dp.global_batch // world * dp.seq_len
    out = {}
    for name, beta in links.items():
        out[name] = [
            dp_overlap(gpt_params_of(dp), tokens, world, flops, beta),
            tp_overlap(tp.global_batch, tp.seq_len, tp.n_embd, world, flops, beta),
            pp_overlap(pp.global_batch // pp.microbatches, pp.seq_len, pp.n_embd,
                       pp.n_layer // world, flops, beta)]
    return out


def exposed_shares(result: dict, strategy: str) -> list[float]:
    """Each of rank 0's steps: seconds blocked in communication over the α-β model's seconds
    for all of the step's communication (hidden or not): near 0 where it hid, near 1 (or
    above, under contention) where every transfer was waited on."""
    row = next(r for r in result["rows"] if r["strategy"] == strategy)
    return [e["blocked_s"] / row["prediction"].comm_total for e in row["steps"]]


def condition_rows(conds: dict[str, list[Overlap]]) -> list[list]:
    return [[link, o.parallelism, f"{o.compute_s * 1e3:.3g}", f"{o.comm_s * 1e3:.3g}",
             f"{o.ratio:.3g}", f"{o.quantity}: {o.have:,.0f} (needs {o.need:,.3g})",
             "hides" if o.hides else "exposed"]
            for link, os_ in conds.items() for o in os_]


CONDITION_HEADER = ["link", "parallelism", "compute that could cover it (ms)",
                    "communication (ms)", "compute / communication", "the condition",
                    "verdict (modelled)"]


def overlap_claim(conds: list[Overlap], shares: dict[str, list[float]],
                  bar: float = HIDES_BAR) -> dict:
    """"Compute per byte against the link tells which communication hides": per parallelism
    measured (DP, TP), the condition's verdict against the ranks' (hid: the exposed share's
    middle half wholly under `bar`; waited: wholly over it). Yes when every one agrees, no
    when one disagrees, undecided when a measured verdict is."""
    by = {o.parallelism: o for o in conds}
    seen = {p: within(s, hi=bar) for p, s in shares.items()}
    agree = [None if seen[p] is None else seen[p] == by[p].hides for p in shares]
    holds = False if False in agree else None if None in agree else True
    return claim(
        "compute per byte against the link tells which communication hides (DP, TP)",
        "the Ultra-Scale Playbook's method (Tazi et al. 2025); distlab.theory.overlap",
        "; ".join(f"{p}: condition {by[p].ratio:.3g}× ({'hides' if by[p].hides else 'exposed'}),"
                  f" seen waiting {fmt_spread(s, 1, '', 2)} of its modelled communication "
                  f"({'hid' if seen[p] else 'waited' if seen[p] is False else 'undecided'}; "
                  f"'hid' at most {bar:g})" for p, s in shares.items()),
        holds, basis="timed")
