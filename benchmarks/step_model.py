"""How far each data-parallel strategy's step is from what this machine allows (issue 28).

    .venv/bin/python benchmarks/step_model.py [--worlds 2 4] [--steps 12] [--repeats 2]

For each world size N:

1. **Compute**, in this process on an idle machine: forward, backward and AdamW's step of the
   default RunConfig's GPT at one rank's batch (global_batch / N rows), with the threads a rank
   gets (cores // N); medians of --compute-reps timings.
2. **α and β per collective kind** (all_reduce, all_gather, reduce_scatter) on N ranks: each
   kind timed at 16 KiB to 4 MiB, t = α + B/β fitted by least squares on the relative error
   (B: the bytes one call sends per rank, the ring's count).
3. **Each strategy** (allreduce, ddp, zero1, zero2, zero3) trained --repeats times for
   --steps steps on N ranks (the first --warmup dropped): rank 0's step time and the seconds
   its collectives blocked it (distlab.comm books a blocking call's whole duration and an
   async one's wait), medians.

With --scale instead: ddp's step and bytes per rank over ranks (1, 2, 4 at n_embd 128) and over
width (n_embd 64 to 384 at 2 ranks), each against the prediction and against the serial sum
(compute + all the communication, nothing hidden), with each curve's worst deviation.

Then prints, per strategy, the measured step against distlab.theory.step_time.predict's
(compute + the communication its overlap rule leaves exposed), and the exposed communication
measured against modelled. zero3's line adds the fraction of the step its compute waited on
parameter all-gathers (target: at most 3%). Runs go to a temporary folder, removed at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _bench import scratch_runs

STRATEGIES = ("allreduce", "ddp", "zero1", "zero2", "zero3")
SIZES = (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)  # bytes per rank's tensor


def time_compute(cfg, world: int, reps: int) -> dict:
    """Forward, backward and optimizer seconds of one rank's shapes, in this process."""
    import torch

    from distlab.rank.build import build_model, build_optimizer

    torch.manual_seed(0)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    model = build_model(cfg)
    opt = build_optimizer(cfg, model.parameters())
    rows = cfg.global_batch // world
    x = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len))
    y = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len))
    out = {"forward": [], "backward": [], "optimizer": []}
    for i in range(reps + 3):  # the first three warm up the allocator and the threads
        t0 = time.perf_counter()
        loss = model(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if i >= 3:
            out["forward"].append(t1 - t0)
            out["backward"].append(t2 - t1)
            out["optimizer"].append(t3 - t2)
    return {k: statistics.median(v) for k, v in out.items()}


def time_compute_together(rank, world, device, log, cfg_dict: dict, reps: int) -> dict:
    """Rank function: the same one-rank compute, timed on every rank at once and with no
    collective: what computing costs while the other ranks compute too (shared cores,
    caches and memory bandwidth), rank 0's figures."""
    from distlab.config import RunConfig

    return time_compute(RunConfig.from_dict(cfg_dict), world, reps)


def time_collectives(rank, world, device, log, sizes: list, repeats: int) -> dict:
    """Rank function: per kind, (bytes booked per call, median seconds) at each size."""
    import torch
    import torch.distributed as dist

    from distlab.comm import Comm

    comm = Comm()
    out = {"all_reduce": [], "all_gather": [], "reduce_scatter": []}
    for size in sizes:
        n = size // 4
        full = torch.ones(n * world)
        part = torch.ones(n)
        calls = {"all_reduce": lambda: comm.all_reduce(part),
                 "all_gather": lambda: comm.all_gather(full, part),
                 "reduce_scatter": lambda: comm.reduce_scatter(part, full)}
        for kind, call in calls.items():
            secs = []
            comm.take_step_stats()
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                call()
                secs.append(time.perf_counter() - t0)
            booked = comm.take_step_stats()[0][kind]
            out[kind].append((booked["bytes_sent"] / booked["calls"], statistics.median(secs)))
    return out


def time_strategies(rank, world, device, log, cfg_dicts: list, repeats: int, warmup: int):
    """Rank function: each config trained `repeats` times (order alternating); per config its
    steps after warmup: step_s, the collectives' booked calls/bytes and blocked seconds."""
    from distlab.config import RunConfig
    from distlab.events import StepRecorder
    from distlab.rank.train import train

    out = {d["name"]: [] for d in cfg_dicts}
    for rep in range(repeats):
        for d in (cfg_dicts if rep % 2 == 0 else cfg_dicts[::-1]):
            rec = StepRecorder(log)
            train(RunConfig.from_dict(d), rank, world, device, rec)
            out[d["name"]] += [{"step_s": e["step_s"], "comm": e["comm"],
                                "prefetch": e.get("zero", {}).get("prefetch"),
                                "timeline": e.get("ddp")}
                               for e in rec.steps[warmup:]]
    return out


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


def median_booked(steps: list) -> dict:
    """kind -> {"calls", "bytes_sent"} of a step (the median step's; they do not vary)."""
    kinds = {k for e in steps for k in e["comm"]}
    return {k: {"calls": statistics.median(e["comm"].get(k, {}).get("calls", 0) for e in steps),
                "bytes_sent": statistics.median(e["comm"].get(k, {}).get("bytes_sent", 0)
                                                for e in steps)} for k in kinds}


def fit_world(args, world, run_ranks, bench) -> dict:
    """α and β per collective kind on `world` ranks, printed with the fit's worst point."""
    from distlab.comm import fit_alpha_beta
    from distlab.theory.step_time import AlphaBeta

    timed = run_ranks(bench.time_collectives, world, list(SIZES), args.coll_reps,
                      timeout_s=120)[0]
    fits = {}
    for kind, points in timed.items():
        a, b = fit_alpha_beta([p[0] for p in points], [p[1] for p in points],
                              [1] * len(points), relative=True)
        fits[kind] = AlphaBeta(max(a, 0.0), b)
        worst = max(abs(fits[kind].seconds(1, B) / t - 1) for B, t in points)
        print(f"  {kind:<15} α {1e6 * fits[kind].alpha:7.1f} µs  β {b / 1e9:6.3f} GB/s  "
              f"(worst point off the fit by {100 * worst:.0f}%)")
    return fits


def scaling(args, run_ranks, RunConfig, bench):
    """Issue 28 item 3: ddp's step and bytes per rank over ranks (at the default width) and
    over width (at 2 ranks), each against the prediction; the worst deviation of each curve."""
    from distlab.theory.step_time import Compute, predict

    def point(world, n_embd):
        strategy = "single" if world == 1 else "ddp"
        cfg = RunConfig(strategy=strategy, world_size=world, steps=args.steps, n_embd=n_embd,
                        timeout_s=300)
        c = Compute(**time_compute(cfg, world, args.compute_reps))
        steps = run_ranks(bench.time_strategies, world, [cfg.replace(name="x").to_dict()],
                          args.repeats, args.warmup, timeout_s=600)[0]["x"]
        measured = statistics.median(e["step_s"] for e in steps)
        booked = median_booked(steps)
        p = predict(strategy, world, c, booked, fits.get(world, {}))
        sent = sum(v["bytes_sent"] for v in booked.values())
        n_params = sum(v.numel() for v in _model(cfg).parameters())
        formula = 2 * (world - 1) / world * 4 * n_params
        return measured, p, sent, formula

    fits = {}
    curves = {"ranks (n_embd 128)": [(w, 128) for w in args.scale_worlds],
              "width (2 ranks)": [(2, e) for e in args.widths]}
    for name, points in curves.items():
        print(f"\n== scaling over {name}: ddp (single at 1 rank). predicted: compute + the "
              "exposed communication; serial: compute + all of it (nothing hidden)")
        worst, worst_serial = 0.0, 0.0
        for world, width in points:
            if world > 1 and world not in fits:
                print(f"  α-β on {world} ranks:")
                fits[world] = fit_world(args, world, run_ranks, bench)
            measured, p, sent, formula = point(world, width)
            serial = p.compute.total + p.comm_total
            worst = max(worst, abs(measured / p.total - 1))
            worst_serial = max(worst_serial, abs(measured / serial - 1))
            print(f"  {world} rank(s), n_embd {width:4d}: measured {1e3 * measured:8.2f} ms, "
                  f"predicted {1e3 * p.total:8.2f} ({measured / p.total:.2f}x), serial "
                  f"{1e3 * serial:8.2f} ({measured / serial:.2f}x); compute "
                  f"{1e3 * p.compute.total:.2f}, comm {1e3 * p.comm_total:.2f} of which exposed "
                  f"{1e3 * p.exposed:.2f}; bytes sent per rank per step {sent:,.0f} "
                  f"(2(N-1)/N x 4 x params: {formula:,.0f})")
        print(f"  worst deviation over {name}: predicted {100 * worst:.0f}%, serial "
              f"{100 * worst_serial:.0f}%")


def _model(cfg):
    from distlab.rank.build import build_model
    return build_model(cfg)


def one_world(args, world, run_ranks, RunConfig, bench):
    from distlab.theory.step_time import Compute, predict

    base = RunConfig(strategy="ddp", world_size=world, steps=args.steps, timeout_s=180)
    c = Compute(**time_compute(base, world, args.compute_reps))
    print(f"\n== {world} ranks: GPT {base.n_layer} layers n_embd {base.n_embd}, global batch "
          f"{base.global_batch} x seq {base.seq_len}, AdamW; cores {os.cpu_count()}, "
          f"{max(1, (os.cpu_count() or 1) // world)} thread(s) per rank")
    print(f"compute per rank (one process, {base.global_batch // world} rows): forward "
          f"{1e3 * c.forward:.2f} ms, backward {1e3 * c.backward:.2f} ms, optimizer "
          f"{1e3 * c.optimizer:.2f} ms")

    shared = Compute(**run_ranks(bench.time_compute_together, world, base.to_dict(),
                                 args.compute_reps, timeout_s=300)[0])
    print(f"the same with all {world} ranks computing at once (no collective): forward "
          f"{1e3 * shared.forward:.2f} ms, backward {1e3 * shared.backward:.2f} ms, optimizer "
          f"{1e3 * shared.optimizer:.2f} ms ({shared.total / c.total:.2f}x alone)")

    fits = fit_world(args, world, run_ranks, bench)

    cfgs = [base.replace(strategy=s, name=s).to_dict() for s in STRATEGIES]
    per_rank = run_ranks(bench.time_strategies, world, cfgs, args.repeats, args.warmup,
                         timeout_s=600)
    res = per_rank[0]
    print("\nms per step (medians). predicted: compute alone + modelled exposed communication;"
          " shared: the same with\nthe compute measured while every rank computes. not "
          "blocked: the step's time outside collective waits,\nagainst the compute alone; "
          "extra: not blocked - compute alone, beside all the step's communication as\n"
          "modelled (on a CPU the collectives that hide behind compute run on the same "
          "cores: hidden is not free).")
    print(f"{'strategy':<10} {'measured':>8} {'predicted':>9} {'ratio':>5} {'shared':>7} "
          f"{'ratio':>5}   {'exposed: measured':>17} {'modelled':>8}   {'not blocked':>11} "
          f"{'/ compute':>9}   {'extra':>6} {'all comm':>8}")
    rows, terms_lines = {}, []
    for s in res:
        steps = res[s]
        measured = statistics.median(e["step_s"] for e in steps)
        blocked = statistics.median(sum(v["seconds"] for v in e["comm"].values()) for e in steps)
        booked = median_booked(steps)
        p = predict(s, world, c, booked, fits)
        q = predict(s, world, shared, booked, fits)
        rows[s] = (measured, p, q, blocked)
        print(f"{s:<10} {1e3 * measured:8.2f} {1e3 * p.total:9.2f} {measured / p.total:5.2f} "
              f"{1e3 * q.total:7.2f} {measured / q.total:5.2f}   {1e3 * blocked:17.2f} "
              f"{1e3 * p.exposed:8.2f}   {1e3 * (measured - blocked):11.2f} "
              f"{(measured - blocked) / p.compute.total:9.2f}   "
              f"{1e3 * (measured - blocked - p.compute.total):6.2f} {1e3 * p.comm_total:8.2f}")
        terms_lines.append(f"  {s}: " + (", ".join(f"{k} {1e3 * v:.2f}"
                                                   for k, v in p.terms.items()) or "none"))
        lines = [e["timeline"] for e in steps if e.get("timeline") and e["timeline"].get("buckets")]
        if lines:
            print(last_bucket_line(lines, blocked, fits, world))
        pf = [e["prefetch"] for e in steps if e["prefetch"]]
        if pf:
            waited = statistics.median(x["blocked_s"] for x in pf)
            print(f"{'':<10} zero3 compute blocked on parameter all-gathers: "
                  f"{1e3 * waited:.2f} ms per step, {100 * waited / measured:.1f}% of the step "
                  f"(target: at most 3%: {'met' if waited <= 0.03 * measured else 'NOT met'}); "
                  f"{statistics.median(x['prefetched'] for x in pf):.0f} of {pf[0]['gathers']} "
                  "issued ahead of need")
            first = statistics.median(x["blocked_unprefetched_s"] for x in pf)
            late = statistics.median(x["blocked_prefetched_s"] for x in pf)
            worst = statistics.median(x["blocked_prefetched_max_s"] for x in pf)
            print(f"{'':<10} of which: gathers issued only when needed (the step's first) "
                  f"{1e3 * first:.2f} ms; prefetches that arrived late {1e3 * late:.2f} ms, "
                  f"the longest wait {1e3 * worst:.2f} ms (a prefetch issued a unit ahead is "
                  "late when gloo's thread waits for one of the cores the ranks compute on)")
            peer, transfer = peer_wait_split([r["zero3"] for r in per_rank])
            print(f"{'':<10} the blocked time by when every rank had issued the same gather, "
                  f"over {len(pf)} steps: before (rank 0 waited for a slower rank to join) "
                  f"{100 * peer / (peer + transfer):.0f}%, after (the gather itself, on cores "
                  f"the ranks compute on) {100 * transfer / (peer + transfer):.0f}%")
    print("modelled exposed communication, its terms (ms):\n" + "\n".join(terms_lines))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=12, help="steps per training (default 12)")
    p.add_argument("--warmup", type=int, default=3, help="steps dropped per training")
    p.add_argument("--repeats", type=int, default=2, help="trainings per strategy (default 2)")
    p.add_argument("--compute-reps", type=int, default=15, help="one-process timings")
    p.add_argument("--coll-reps", type=int, default=7, help="timings per collective size")
    p.add_argument("--scale", action="store_true",
                   help="instead: ddp's step over ranks and over width against the prediction")
    p.add_argument("--scale-worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 384])
    args = p.parse_args(argv)
    with scratch_runs(__file__, "distlab-step-model-") as bench:
        from distlab import RunConfig, run_ranks

        print(f"load average {os.getloadavg()[0]:.1f} at the start (the figures want an idle "
              "machine)")
        if args.scale:
            scaling(args, run_ranks, RunConfig, bench)
            return 0
        for world in args.worlds:
            one_world(args, world, run_ranks, RunConfig, bench)
        return 0


if __name__ == "__main__":
    sys.exit(main())
