"""Step time of distlab's ZeRO-3 (`zero3`) against torch's FSDP2 (`fsdp-torch`) and against DDP
(`ddp`), side by side; on a GPU also the bf16 speed-up and activation checkpointing's memory
saving.

    .venv/bin/python benchmarks/zero_overhead.py [--world 2] [--repeats 6] [--steps 20]

One launch of --world ranks trains the same run under each strategy in turn, --repeats times,
alternating the order (A B C, C B A, ...) so drift in the machine's load falls on all alike.
Each training is --steps steps of the default RunConfig's GPT (4 layers, n_embd 128, 0.82M
parameters) with SGD; the first --warmup steps of each are dropped (zero3 records its units'
order in the first forward; torch's DDP rebuilds buckets after iteration 0). The step time is
rank 0's step_s (ranks meet at every collective, so they agree to within a wait).

Prints each strategy's median step time, the ratios zero3 / fsdp-torch and zero3 / ddp (of the
medians, and per repeat), the bytes each moves per rank per step (Comm's count: fsdp-torch's
collectives are torch's own, not counted), and zero3's prefetch figures: all-gathers issued
ahead of need and the seconds compute was blocked waiting for parameters.

GPU section (when CUDA is present): `single` on one GPU, the same GPT made larger (--gpu-embd,
--gpu-layers), fp32 against bf16 autocast (step-time speed-up), and checkpointing "none"
against "full" (torch.cuda.max_memory_allocated per step, the loop's cuda_max_allocated). On a
machine without a GPU it prints "no GPU: skipped".

NCCL section (with 2 or more CUDA GPUs): torch's FSDP2 (`fsdp-torch`) against torch's DDP
(`ddp-torch`) over NCCL, one rank per GPU, the larger GPT in bf16, repeats alternating as
above; it prints "FSDP2 / DDP step time on NCCL: R x" (the ratio of the medians) with each
repeat's ratio: the "FSDP costs under 20% over DDP on NVLink" of the interview answers, which
04's row quotes from benchmarks/results once recorded. With fewer GPUs it says why it skipped.

Runs go to a temporary DISTLAB_RUNS folder, removed at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from _bench import scratch_runs

STRATEGIES = ("zero3", "fsdp-torch", "ddp")


def time_configs(rank, world, device, log, cfg_dicts: list, repeats: int, warmup: int):
    """Rank function: train each config `repeats` times, alternating the order; per config
    (by its name) the step events after warmup and each repeat's median."""
    from distlab.config import RunConfig
    from distlab.events import StepRecorder
    from distlab.rank.train import train

    out = {d["name"]: {"steps": [], "per_repeat": []} for d in cfg_dicts}
    for rep in range(repeats):
        for d in (cfg_dicts if rep % 2 == 0 else cfg_dicts[::-1]):
            rec = StepRecorder(log)
            train(RunConfig.from_dict(d), rank, world, device, rec)
            steps = [{"step_s": e["step_s"], "memory": e["memory"],
                      "bytes": sum(s["bytes_sent"] for s in e["comm"].values()),
                      "prefetch": e.get("zero", {}).get("prefetch")} for e in rec.steps[warmup:]]
            o = out[d["name"]]
            o["steps"] += steps
            o["per_repeat"].append(statistics.median(e["step_s"] for e in steps))
    return out


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def cpu_section(args, run_ranks, RunConfig, bench):
    base = RunConfig(strategy="zero3", world_size=args.world, steps=args.steps,
                     optimizer="sgd", lr=0.1, timeout_s=120)
    cfgs = [base.replace(strategy=s, name=s).to_dict() for s in STRATEGIES]
    print(f"{args.world} ranks, {args.repeats} repeats x {args.steps} steps (first "
          f"{args.warmup} dropped), GPT {base.n_layer} layers n_embd {base.n_embd}, global "
          f"batch {base.global_batch}, seq {base.seq_len}; cpu cores {os.cpu_count()}, load "
          f"average {os.getloadavg()[0]:.1f}\n")
    res = run_ranks(bench.time_configs, args.world, cfgs, args.repeats, args.warmup,
                    timeout_s=120)[0]
    med = {s: _median([e["step_s"] for e in res[s]["steps"]]) for s in STRATEGIES}
    print(f"{'strategy':<11} {'median ms':>9}  {'per-repeat medians, ms':<42} bytes/step/rank")
    for s in STRATEGIES:
        reps = " ".join(f"{1e3 * t:.1f}" for t in res[s]["per_repeat"])
        nbytes = _median([e["bytes"] for e in res[s]["steps"]])
        print(f"{s:<11} {1e3 * med[s]:>9.1f}  {reps:<42} "
              f"{nbytes:.0f}" + (" (torch's own collectives: not counted)"
                                 if s == "fsdp-torch" else ""))
    for other in ("fsdp-torch", "ddp"):
        per_rep = [a / b for a, b in zip(res["zero3"]["per_repeat"], res[other]["per_repeat"])]
        print(f"\nzero3 / {other} step time (ratio of medians): {med['zero3'] / med[other]:.2f}; "
              f"per repeat {' '.join(f'{r:.2f}' for r in per_rep)}")
    pf = [e["prefetch"] for e in res["zero3"]["steps"] if e["prefetch"]]
    if pf:
        print(f"\nzero3 prefetch per step: {pf[0]['gathers']} all-gathers, "
              f"{_median([p['prefetched'] for p in pf]):.0f} issued ahead of need; compute "
              f"blocked waiting for parameters {1e3 * _median([p['blocked_s'] for p in pf]):.1f}"
              f" ms per step (median), of {1e3 * med['zero3']:.1f} ms")
    mem = {s: res[s]["steps"][-1]["memory"] for s in STRATEGIES}
    print("\nmodel state per rank after a step, bytes (params / grads; SGD has no state):")
    for s in STRATEGIES:
        print(f"  {s:<11} {mem[s]['params']:>9} / {mem[s]['grads']:>9}")


def gpu_section(args, run_ranks, RunConfig, bench):
    import torch
    if not torch.cuda.is_available():
        print("\nGPU section (bf16 speed-up, checkpointing memory): no GPU: skipped")
        return
    base = RunConfig(world_size=1, steps=args.steps, optimizer="adamw", global_batch=16,
                     seq_len=256, n_embd=args.gpu_embd, n_layer=args.gpu_layers,
                     n_head=args.gpu_embd // 64, device="cuda", timeout_s=300)
    runs = {"fp32": base, "bf16": base.replace(precision="bf16"),
            "fp32 checkpointing": base.replace(checkpointing="full")}
    cfgs = [c.replace(name=n).to_dict() for n, c in runs.items()]
    print(f"\nGPU section: single on {torch.cuda.get_device_name(0)}, GPT {base.n_layer} "
          f"layers n_embd {base.n_embd}, batch {base.global_batch} x seq {base.seq_len}")
    res = run_ranks(bench.time_configs, 1, cfgs, args.repeats, args.warmup, device="cuda",
                    timeout_s=300)[0]
    t = {n: _median([e["step_s"] for e in res[n]["steps"]]) for n in runs}
    peak = {n: max(e["memory"]["cuda_max_allocated"] for e in res[n]["steps"]) for n in runs}
    for n in runs:
        print(f"  {n:<20} median step {1e3 * t[n]:8.1f} ms   max_memory_allocated "
              f"{peak[n] / 2**20:8.1f} MiB")
    print(f"  bf16 speed-up over fp32: {t['fp32'] / t['bf16']:.2f}x")
    print(f"  checkpointing: peak memory {peak['fp32 checkpointing'] / peak['fp32']:.2f} of "
          f"fp32's ({(peak['fp32'] - peak['fp32 checkpointing']) / 2**20:.1f} MiB saved), "
          f"step time x{t['fp32 checkpointing'] / t['fp32']:.2f}")


def nccl_section(args, run_ranks, RunConfig, bench):
    import torch
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        print(f"\nNCCL section (FSDP2 against DDP): needs 2 or more CUDA GPUs, found {n}: "
              "skipped")
        return
    base = RunConfig(world_size=n, steps=args.steps, optimizer="adamw", global_batch=8 * n,
                     seq_len=256, n_embd=args.gpu_embd, n_layer=args.gpu_layers,
                     n_head=args.gpu_embd // 64, precision="bf16", device="cuda",
                     backend="nccl", timeout_s=300)
    names = ("fsdp-torch", "ddp-torch")
    cfgs = [base.replace(strategy=s, name=s).to_dict() for s in names]
    print(f"\nNCCL section: {n} x {torch.cuda.get_device_name(0)}, GPT {base.n_layer} layers "
          f"n_embd {base.n_embd}, bf16, batch {base.global_batch} x seq {base.seq_len}")
    res = run_ranks(bench.time_configs, n, cfgs, args.repeats, args.warmup, device="cuda",
                    backend="nccl", timeout_s=300)[0]
    med = {s: _median([e["step_s"] for e in res[s]["steps"]]) for s in names}
    per_rep = [a / b for a, b in zip(res["fsdp-torch"]["per_repeat"],
                                     res["ddp-torch"]["per_repeat"])]
    for s in names:
        print(f"  {s:<11} median step {1e3 * med[s]:8.1f} ms")
    print(f"FSDP2 / DDP step time on NCCL: {med['fsdp-torch'] / med['ddp-torch']:.2f}x; per "
          f"repeat {' '.join(f'{r:.2f}' for r in per_rep)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--repeats", type=int, default=6, help="trainings per strategy (default 6)")
    p.add_argument("--steps", type=int, default=20, help="steps per training (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="steps dropped per training")
    p.add_argument("--gpu-embd", type=int, default=1024, help="GPU section: n_embd")
    p.add_argument("--gpu-layers", type=int, default=8, help="GPU section: layers")
    args = p.parse_args(argv)

    with scratch_runs(__file__, "distlab-zero-bench-") as bench:
        from distlab import RunConfig, run_ranks

        cpu_section(args, run_ranks, RunConfig, bench)
        gpu_section(args, run_ranks, RunConfig, bench)
        nccl_section(args, run_ranks, RunConfig, bench)
        return 0


if __name__ == "__main__":
    sys.exit(main())
