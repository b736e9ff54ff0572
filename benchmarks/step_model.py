"""How far each strategy's step is from what this machine allows.

    .venv/bin/python benchmarks/step_model.py [--worlds 2 4] [--steps 12] [--repeats 2]
    .venv/bin/python benchmarks/step_model.py --scale | --prefetch

For each world size N, distlab.studies.step_limit measures the parts and
distlab.theory.step_time.predict adds them up, for allreduce, ddp, zero1-3, tp, pp (1F1B, 4
micro-batches) and cp (ring attention):

1. **compute**: each strategy's step in one process as its rank, collectives made no-ops
   (torch's fake process group), with the threads a rank gets (cores // N);
2. **α and β per collective kind** (all_reduce, all_gather, reduce_scatter, ring send) on N
   ranks, 16 KiB to 4 MiB, least squares on the relative error;
3. **each strategy** trained --repeats times for --steps steps on N ranks (the first --warmup
   dropped): rank 0's step, the seconds it blocked in collectives, its CPU seconds.

Then prints, per strategy, the measured step against the prediction, the exposed
communication measured (blocked) against modelled, and where the gap goes: waits beyond the
α-β model, compute slower than alone, and the CPU the backend's threads burned; with the
verdict against 1.2x (the bar set here, at 2 ranks). zero3 adds the fraction of the step its
compute waited on parameter all-gathers (target: at most 3%) and who it waited for; ddp its
exposed all-reduce time beside its last bucket's.

With --scale instead: ddp's step and bytes per rank over ranks (1, 2, 4, 8 at n_embd 128) and
over width (n_embd 64 to 384 at 2 ranks), each against the prediction and against the serial
sum (compute + all the communication, nothing hidden), with each curve's worst deviation.
With --prefetch instead: zero3 at 2 ranks with its parameter all-gathers started 0, 1, 2 and
5 (all) units ahead of need (RunConfig.fsdp_prefetch), the fraction of the step blocked on
them against the 3% target, the gathered parameters' peak each depth costs, and how long a
step's threads waited for a core (Linux's run_delay), with the blocked fraction in the half of
the steps where gloo's threads waited least against the half where they waited most.
With --nodes instead (root: simulated nodes): ddp and zero3 on 2 simulated nodes of 1 rank
each, α and β fitted over their link at each --link-mbit rate (the slow tier), the same table.
Runs go to a temporary folder, removed at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from _bench import scratch_runs



def peer_wait_split(ranks_steps: list) -> tuple[float, float]:
    """Rank 0's time blocked on ZeRO-3's all-gathers, summed over its steps, split in two:
    until the last rank had issued the same gather (an all-gather cannot finish before every
    rank joins it: rank 0 waits for a slower rank, not for bytes), and after (the transfer,
    and gloo's thread waiting for a core). Ranks' records are matched by step and gather
    order; perf_counter is one clock for every process on the machine. Sums, so the two parts
    add up to the blocked time (less a few µs where the last issue was noted after rank 0's
    wait returned)."""
    peer = transfer = 0.0
    for steps in zip(*ranks_steps):
        timed = [s["prefetch"]["timed"] for s in steps]
        for gathers in zip(*timed):
            issued, needed, waited = gathers[0]
            last_issue = max(g[0] for g in gathers)
            peer += min(max(last_issue - needed, 0.0), waited - needed)
            transfer += max(waited - max(needed, last_issue), 0.0)
    return peer, transfer


def last_bucket_line(timelines: list, blocked: float, fits: dict, world: int) -> str:
    """DDP's exposed all-reduce time beside its last bucket's: the bucket issued last, its
    all-reduce's issue-to-done time as measured and by the α-β fit, and how long after
    backward ended it finished (medians over steps). The model says the exposed time is at
    least the last bucket's all-reduce."""
    last = [max(t["buckets"], key=lambda b: b["start"]) for t in timelines]
    took = statistics.median(b["done"] - b["start"] for b in last)
    after = statistics.median(max(b["done"] for b in t["buckets"]) - t["backward"][1]
                              for t in timelines)
    nbytes = statistics.median(b["bytes"] for b in last)
    # the fit is per booked byte: an all-reduce books 2(N-1)/N of its buffer
    modelled = fits["all_reduce"].seconds(1, nbytes * 2 * (world - 1) / world)
    return (f"{'':<10} ddp: exposed (blocked) {1e3 * blocked:.2f} ms; last bucket "
            f"({nbytes:,.0f} B) issued to done {1e3 * took:.2f} ms measured, "
            f"{1e3 * modelled:.2f} ms by α-β; all buckets done {1e3 * after:.2f} ms after "
            "backward ended")


def print_fits(fits, worst):
    for kind, f in fits.items():
        print(f"  {kind:<15} α {1e6 * f.alpha:7.1f} µs  β {f.beta / 1e9:6.3f} GB/s  "
              f"(worst point off the fit by {100 * worst[kind]:.0f}%)")
def scaling(args, RunConfig):
    """ddp's step and bytes per rank over ranks (at n_embd 128) and over width (at 2 ranks),
    each against the prediction and the serial sum; each curve's worst deviation."""
    from distlab.studies import step_limit

    curves = {"ranks (n_embd 128)": [(w, 128) for w in args.scale_worlds],
              "width (2 ranks)": [(2, e) for e in args.widths]}
    base = RunConfig(steps=args.steps, timeout_s=300)
    every = sorted({pt for pts in curves.values() for pt in pts})
    got = step_limit.growth_points(base, every, repeats=args.repeats, warmup=args.warmup,
                                    coll_reps=args.coll_reps, compute_reps=args.compute_reps)
    at = {(g["world"], g["n_embd"]): g for g in got}
    for name, points in curves.items():
        print(f"\n== scaling over {name}: ddp (single at 1 rank). predicted: compute + the "
              "exposed communication; serial: compute + all of it (nothing hidden)")
        worst, worst_serial = 0.0, 0.0
        for world, width in points:
            g = at[world, width]
            p, measured, serial = g["prediction"], g["measured_s"], g["serial_s"]
            worst = max(worst, abs(measured / p.total - 1))
            worst_serial = max(worst_serial, abs(measured / serial - 1))
            print(f"  {world} rank(s), n_embd {width:4d}: measured {1e3 * measured:8.2f} ms, "
                  f"predicted {1e3 * p.total:8.2f} ({measured / p.total:.2f}x), serial "
                  f"{1e3 * serial:8.2f} ({measured / serial:.2f}x); compute "
                  f"{1e3 * p.compute.total:.2f}, comm {1e3 * p.comm_total:.2f} of which exposed "
                  f"{1e3 * p.exposed:.2f}; bytes sent per rank per step {g['sent_bytes']:,.0f} "
                  f"(2(N-1)/N x 4 x params: {g['ring_bytes']:,.0f})")
        print(f"  worst deviation over {name}: predicted {100 * worst:.0f}%, serial "
              f"{100 * worst_serial:.0f}%")


def prefetch_sweep(args, run_ranks, RunConfig):
    """zero3 at 2 ranks with its all-gathers started 0, 1, 2 and all units ahead
    (RunConfig.fsdp_prefetch): the fraction of the step blocked on them, against the 3% target.
    If issuing later than the data could arrive were the cause, deeper prefetch would shrink
    it; the gathered parameters' peak is what each unit more costs."""
    from distlab.studies import step_limit

    base = RunConfig(strategy="zero3", world_size=2, steps=args.steps, timeout_s=300)
    depths = args.prefetch_depths
    cfgs = [base.replace(fsdp_prefetch=d, name=f"prefetch {d}") for d in depths]
    print(f"\n== zero3, 2 ranks, GPT {base.n_layer} layers n_embd {base.n_embd}: blocked on "
          f"parameter all-gathers by prefetch depth ({args.repeats} trainings each, order "
          "alternating; medians over steps)")
    steps = run_ranks(step_limit.train_and_time, 2, [c.to_dict() for c in cfgs], args.repeats,
                      args.warmup, timeout_s=900)[0]
    for d, cfg in zip(depths, cfgs):
        got = steps[cfg.name]
        step = statistics.median(e["step_s"] for e in got)
        blocked = statistics.median(e["prefetch"]["blocked_s"] for e in got)
        shares = [e["prefetch"]["blocked_s"] / e["step_s"] for e in got]
        peak = max(e["gathered_peak_bytes"] for e in got)
        q1, _, q3 = statistics.quantiles(shares, n=4)
        print(f"  prefetch {d}: step {1e3 * step:6.2f} ms, blocked {1e3 * blocked:5.2f} ms = "
              f"{100 * blocked / step:4.1f}% of the step (steps' quartiles {100 * q1:.1f}-"
              f"{100 * q3:.1f}%; target 3%: {'met' if blocked <= 0.03 * step else 'NOT met'}); "
              f"{statistics.median(e['prefetch']['prefetched'] for e in got):.0f} of "
              f"{got[0]['prefetch']['gathers']} issued ahead; gathered peak {peak:,} B")
        phases = {ph: statistics.median(e["prefetch"]["blocked_by_phase_s"].get(ph, 0.0)
                                        for e in got)
                  for ph in got[0]["prefetch"]["blocked_by_phase_s"]}
        print(f"{'':<14}blocked by phase (medians): " + ", ".join(
            f"{ph} {1e3 * v:.2f} ms" for ph, v in phases.items()))
        core_wait_line(got)


def core_wait_line(steps: list) -> None:
    """Rank 0's threads waiting for a core, per step (Linux's run_delay): the training
    thread's and the others' (gloo's, moving the gathers), and the blocked fraction in the
    half of the steps where the others waited least against the half where they waited most
    (distlab.studies.step_limit.blocked_by_core_wait)."""
    from distlab.studies.step_limit import blocked_by_core_wait
    split = blocked_by_core_wait(steps)
    if split is None:
        return
    print(f"{'':<14}waiting for a core a step (medians): training thread "
          f"{1e3 * split['main_wait_s']:.2f} ms, the other threads "
          f"{1e3 * split['others_wait_s']:.2f} ms; blocked: "
          f"{100 * split['blocked_least_waiting']:.1f}% of the step in the half of steps "
          f"where the others waited least, {100 * split['blocked_most_waiting']:.1f}% where "
          "they waited most")


def _model(cfg):
    from distlab.rank.build import build_model
    return build_model(cfg)


def one_world(args, world, RunConfig):
    from distlab.studies import step_limit

    base = RunConfig(steps=args.steps, timeout_s=180)
    got = step_limit.limit_rows(base, world, args.strategies, repeats=args.repeats,
                                warmup=args.warmup, coll_reps=args.coll_reps,
                                compute_reps=args.compute_reps)
    print_result(got, base, f"{world} ranks")
    return got


def on_nodes(args, RunConfig):
    """The same across 2 simulated nodes (1 rank each) joined by a link of --link-mbit: α and
    β fitted over that link, the strategies trained across it."""
    from distlab.caller.cluster import available
    from distlab.studies import step_limit

    why = available()
    if why is not None:
        print(f"simulated nodes are not available here ({why}): nothing measured")
        return
    base = RunConfig(steps=args.steps, timeout_s=300)
    for mbit in args.link_mbit:
        got = step_limit.node_rows(base, link_mbit=mbit,
                                   strategies=args.strategies or ("ddp", "zero3"),
                                   repeats=args.repeats, warmup=args.warmup,
                                   coll_reps=args.coll_reps, compute_reps=args.compute_reps)
        print_result(got, base, f"2 simulated nodes x 1 rank, a {mbit:g} Mbit/s link")


def print_result(got, base, title):
    world = got["world"]
    c = got["plain"]
    print(f"\n== {title}: GPT {base.n_layer} layers n_embd {base.n_embd}, global batch "
          f"{base.global_batch} x seq {base.seq_len}, AdamW; {got['cores']} cores, "
          f"{max(1, got['cores'] // world)} thread(s) per rank")
    print(f"plain model at one rank's rows ({base.global_batch // world}), one process: forward "
          f"{1e3 * c.forward:.2f} ms, backward {1e3 * c.backward:.2f} ms, optimizer "
          f"{1e3 * c.optimizer:.2f} ms (the split of every strategy's compute)")
    print_fits(got["fits"], got["fit_worst"])
    print("\nms per step (medians). compute: the strategy's step in one process, collectives "
          "no-ops; exposed: blocked\nin waits (measured) against the overlap rule's "
          "(modelled); waits+: blocked - modelled; slower: not blocked\n- compute; backend "
          "CPU: the process's CPU less the training thread's; cores: N x CPU / cores")
    print(f"{'strategy':<10} {'measured':>8} {'predicted':>9} {'ratio':>5} {'compute':>7}   "
          f"{'exposed: meas':>13} {'model':>6}   {'waits+':>6} {'slower':>6} {'backend CPU':>11}"
          f" {'cores':>6}   why")
    for row in got["rows"]:
        p = row["prediction"]
        print(f"{row['strategy']:<10} {1e3 * row['measured_s']:8.2f} {1e3 * p.total:9.2f} "
              f"{row['ratio']:5.2f} {1e3 * p.compute.total:7.2f}   "
              f"{1e3 * row['blocked_s']:13.2f} {1e3 * p.exposed:6.2f}   "
              f"{1e3 * row['waits_beyond_s']:6.2f} {1e3 * row['compute_slower_s']:6.2f} "
              f"{1e3 * row['backend_cpu_s']:11.2f} {1e3 * row['cores_bound_s']:6.2f}   "
              f"{row['why']}")
    print("modelled exposed communication, its terms (ms):")
    for row in got["rows"]:
        p = row["prediction"]
        print(f"  {row['strategy']}: " + (", ".join(f"{k} {1e3 * v:.2f}"
                                                   for k, v in p.terms.items()) or "none"))
    for row in got["rows"]:
        extra_lines(row, got["fits"], world)


def extra_lines(row, fits, world):
    """ddp's last bucket; zero3's blocked fraction, its causes and who it waited for."""
    steps, measured = row["steps"], row["measured_s"]
    lines = [e["timeline"] for e in steps if e.get("timeline") and e["timeline"].get("buckets")]
    if lines:
        print(last_bucket_line(lines, row["blocked_s"], fits, world))
    pf = [e["prefetch"] for e in steps if e["prefetch"]]
    if not pf:
        return
    waited = statistics.median(x["blocked_s"] for x in pf)
    print(f"{'':<10} zero3 compute blocked on parameter all-gathers: {1e3 * waited:.2f} ms per "
          f"step, {100 * waited / measured:.1f}% of the step (target: at most 3%: "
          f"{'met' if waited <= 0.03 * measured else 'NOT met'}); "
          f"{statistics.median(x['prefetched'] for x in pf):.0f} of {pf[0]['gathers']} issued "
          "ahead of need")
    first = statistics.median(x["blocked_unprefetched_s"] for x in pf)
    late = statistics.median(x["blocked_prefetched_s"] for x in pf)
    worst = statistics.median(x["blocked_prefetched_max_s"] for x in pf)
    print(f"{'':<10} of which: gathers issued only when needed (the step's first) "
          f"{1e3 * first:.2f} ms; prefetches that arrived late {1e3 * late:.2f} ms, the longest "
          f"wait {1e3 * worst:.2f} ms")
    if len(row["ranks_steps"]) < 2:  # across nodes only rank 0's steps come back
        return
    peer, transfer = peer_wait_split(row["ranks_steps"])
    print(f"{'':<10} the blocked time by when every rank had issued the same gather, over "
          f"{len(pf)} steps: before (rank 0 waited for a slower rank to join) "
          f"{100 * peer / (peer + transfer):.0f}%, after (the gather itself, on cores the ranks "
          f"compute on) {100 * transfer / (peer + transfer):.0f}%")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--strategies", nargs="+", default=None,
                   help="default: allreduce ddp zero1 zero2 zero3 tp pp cp")
    p.add_argument("--steps", type=int, default=12, help="steps per training (default 12)")
    p.add_argument("--warmup", type=int, default=3, help="steps dropped per training")
    p.add_argument("--repeats", type=int, default=2, help="trainings per strategy (default 2)")
    p.add_argument("--compute-reps", type=int, default=15, help="one-process timings")
    p.add_argument("--coll-reps", type=int, default=7, help="timings per collective size")
    p.add_argument("--scale", action="store_true",
                   help="instead: ddp's step over ranks and over width against the prediction")
    p.add_argument("--scale-worlds", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 384])
    p.add_argument("--nodes", action="store_true",
                   help="instead: ddp and zero3 across 2 simulated nodes (root), per link rate")
    p.add_argument("--link-mbit", type=float, nargs="+", default=[100.0, 400.0])
    p.add_argument("--prefetch", action="store_true",
                   help="instead: zero3's blocked fraction by prefetch depth, at 2 ranks")
    p.add_argument("--prefetch-depths", type=int, nargs="+", default=[0, 1, 2, 5])
    args = p.parse_args(argv)
    with scratch_runs(__file__, "distlab-step-model-"):
        from distlab import RunConfig, run_ranks

        print(f"load average {os.getloadavg()[0]:.1f} at the start (the figures want an idle "
              "machine)")
        if args.scale:
            scaling(args, RunConfig)
            return 0
        if args.nodes:
            on_nodes(args, RunConfig)
            return 0
        if args.prefetch:
            prefetch_sweep(args, run_ranks, RunConfig)
            return 0
        from distlab.studies.step_limit import STRATEGIES
        args.strategies = tuple(args.strategies or STRATEGIES)
        for world in args.worlds:
            one_world(args, world, RunConfig)
        return 0


if __name__ == "__main__":
    sys.exit(main())
