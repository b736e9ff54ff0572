"""The planner's ranking, trained: its top layouts for a small GPT on this machine, each run on
the mesh, measured against the step time it predicted.

The planner (distlab.theory.plan) needs a cluster: this machine, measured.

* **compute**: the whole global batch's step (forward, backward, optimizer) in this process
  on one thread, as one rank computes: F = 6·N·tokens / seconds (the planner's count, N its
  parameters), the FLOP/s a rank achieves
  (the planner's peak x MFU). With more ranks than cores each rank gets cores/ranks of one, so
  a "GPU" here does F·min(1, cores/ranks).
* **the link**: all-reduce timed on the ranks (distlab.studies.step_limit.time_collectives, 16
  KiB to 4 MiB), fitted t = α_call + B/β; the ring's 2(n-1) messages per call give the
  planner's per-message α = α_call / (2(n-1)).

Then plan(...) ranks every layout of `gpus` ranks (fp32 values: value_bytes = 4), the top
layouts (the best row of each) are trained `repeats` times each on the mesh (theory.plan_runs.run_config), order
alternating between repeats, and each row sets the median step (rank 0's, after `warmup`
steps) and its spread over repeats beside the prediction. The planner's order holds between
two layouts when the measured medians keep it; a pair is decided only when the repeats'
ranges do not overlap.
"""

from __future__ import annotations

import os
import statistics

from distlab.studies.step_limit import SIZES, fit, time_collectives, time_plain_compute, \
    train_and_time


def collectives_and_steps(rank, world, device, log, sizes, coll_reps, cfg_dicts, repeats,
                          warmup):
    """Rank function: the all-reduce's timings, then each config's steps (one launch)."""
    out = {"collectives": time_collectives(sizes, coll_reps)}
    if cfg_dicts:
        out["steps"] = train_and_time(rank, world, device, log, cfg_dicts, repeats, warmup)
    return out


def rank_flops(base, reps: int = 5) -> dict:
    """The FLOP/s one rank achieves: the global batch's step in this process, one thread."""
    import torch

    from distlab.theory.plan import training_flops
    from distlab.theory.plan_runs import model_of
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t = time_plain_compute(base, 1, reps)
    finally:
        torch.set_num_threads(threads)
    seconds = t["forward"] + t["backward"] + t["optimizer"]
    tokens = base.global_batch * base.seq_len
    # the planner's own count (6·N·tokens, N its parameters): what its compute divides by
    return {"seconds": seconds,
            "flops": training_flops(model_of(base).active_params, tokens) / seconds}


def cluster_here(base, gpus: int, alpha_call: float, beta: float, flops: float):
    """This machine as the planner's Cluster: `gpus` ranks in one node, the fitted loopback
    link, each rank's share of the cores."""
    from distlab.comm import Link
    from distlab.theory.plan import Cluster
    cores = os.cpu_count() or 1
    link = Link("gloo loopback (fitted)", alpha_call / max(2 * (gpus - 1), 1), beta,
                "all_reduce timed here, 16 KiB to 4 MiB")
    return Cluster(gpus=gpus, gpus_per_node=gpus, memory=1e15, intra=link, inter=link,
                   peak_flops=flops * min(1.0, cores / gpus))


def top_rows(base, cluster, top: int, cps=(1, 2)) -> list:
    """The planner's `top` fastest layouts (dp, tp, pp, cp) for base's GPT on `cluster`, each
    with its best ZeRO stage, micro-batch and recomputation (fp32 on the wire). One row per
    layout: rows of one layout that differ in ZeRO stage alone tie (stages 0-2 move the same
    bytes in the planner's model), and ties say nothing about order."""
    from distlab.theory.plan import plan
    from distlab.theory.plan_runs import model_of
    rows = plan(model_of(base), cluster, base.global_batch, mfu=1.0, cps=cps,
                sequence_parallel=False, value_bytes=4, zero23_with_pp=True)
    best = {}
    for r in rows:  # fastest first: the first of each layout is its best
        best.setdefault((r.dp, r.tp, r.pp, r.cp, r.ep), r)
    return list(best.values())[:top]


def planned_vs_measured(base, gpus: int = 8, top: int = 5, repeats: int = 2, warmup: int = 2,
                        coll_reps: int = 5, cps=(1, 2), sizes=SIZES) -> dict:
    """Calibrate, plan, train the top rows; the rows and the verdict (module docstring).
    sizes: the all-reduce sizes the link is fitted on (fewer: a quicker, rougher fit)."""
    from distlab.caller.launch import run_ranks
    from distlab.theory.plan_runs import label, run_config

    compute = rank_flops(base)
    # one launch to fit the link (the plan needs it), one to train what it ranks
    timed = run_ranks(collectives_and_steps, gpus, sizes, coll_reps, [], 0, 0,
                      timeout_s=120, wall_timeout_s=600)[0]["collectives"]
    fits, worst = fit({"all_reduce": timed["all_reduce"]})
    ab = fits["all_reduce"]
    cluster = cluster_here(base, gpus, ab.alpha, ab.beta, compute["flops"])
    rows = top_rows(base, cluster, top, cps)
    cfgs = [run_config(r, base).replace(name=f"plan{i}") for i, r in enumerate(rows)]
    steps = run_ranks(collectives_and_steps, gpus, SIZES[:1], 1, [c.to_dict() for c in cfgs],
                      repeats, warmup, timeout_s=120, wall_timeout_s=900)[0]["steps"]
    out = []
    for i, (r, c) in enumerate(zip(rows, cfgs)):
        per = len(steps[c.name]) // repeats  # each repeat's steps, in order
        medians = [statistics.median(e["step_s"] for e in steps[c.name][k * per:(k + 1) * per])
                   for k in range(repeats)]
        out.append({"rank": i + 1, "layout": label(r), "predicted_s": r.step_s,
                    "predicted_parts": {"compute": r.compute_s, "bubble": r.bubble_s,
                                        "dp": r.dp_comm_s, "tp": r.tp_comm_s,
                                        "pp": r.pp_comm_s, "cp": r.cp_comm_s},
                    "measured_s": statistics.median(medians), "spread_s": medians})
    return {"rows": out, "order": order_verdict(out), "flops_per_rank": compute["flops"],
            "link": {"alpha_call_s": ab.alpha, "beta_Bps": ab.beta,
                     "fit_worst": worst["all_reduce"]}, "cores": os.cpu_count()}


def order_verdict(rows: list, tie: float = 0.05) -> dict:
    """Whether the measured medians keep the planner's order, pair by pair: "holds" only when
    every pair does; "decided" counts the pairs whose repeats' ranges do not overlap. Pairs
    the planner predicts within `tie` of each other are left out: its docstring says near-ties
    within a few % are not meaningful."""
    pairs = kept = decided = 0
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            a, b = rows[i], rows[j]
            if b["predicted_s"] <= a["predicted_s"] * (1 + tie):
                continue
            pairs += 1
            kept += a["measured_s"] <= b["measured_s"]
            decided += max(a["spread_s"]) < min(b["spread_s"]) or \
                max(b["spread_s"]) < min(a["spread_s"])
    return {"pairs": pairs, "kept": kept, "decided": decided, "holds": pairs > 0 and kept == pairs}
