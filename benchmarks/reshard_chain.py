"""A checkpoint resumed across strategies and world sizes, leg after leg (issue 47, item 2).

    .venv/bin/python benchmarks/reshard_chain.py [--optimizer sgd]

Chain 1, endless data: zero3 at 4 ranks -> ddp at 2 -> tp2 -> pp2 -> zero3 at 8 -> 3d at 8
(tp2 x pp2 x dp2) -> mesh at 4 (pp2 x dp_shard2, fully_shard) -> ddp at 4, two steps each, each
leg resuming the checkpoint the leg before it saved last, against one uninterrupted zero3 run at
4 ranks (AdamW, so the moments must carry over too).
Chain 2, a finite dataset read by the distributed sampler: ddp at 4 -> 2 -> 8 -> 4 ranks over
two passes, the sample ids each step read against the uninterrupted run's at 4.

Printed per leg: the step it resumed at (no step lost or repeated: the steps done its checkpoint
says), its losses' largest difference from the uninterrupted run's, and for chain 2 whether each
step read exactly the uninterrupted run's sample ids; then the largest parameter difference at
the end. Targets: every leg resumes where the last ended, every sample id equal, losses within
1e-4 (strategies sum gradients in other orders, and AdamW's m/sqrt(v) amplifies that rounding
where v is tiny: measured 1e-5 on 4 -> 2 ranks in tests/test_checkpoint.py; a tensor loaded
into the wrong place moves the loss by 1e-2 or more). Exit status 0 when all are met; the runs
and checkpoints go to a temporary folder, removed at the end.
"""

from __future__ import annotations

import os
import sys

from _bench import scratch_runs

LOSS_TOL = 1e-4
STEPS_PER_LEG = 2
CHAIN = [("zero3", 4, {}), ("ddp", 2, {}), ("tp", 2, {"tp": 2}), ("pp", 2, {"pp": 2}),
         ("zero3", 8, {}), ("3d", 8, {"tp": 2, "pp": 2}), ("mesh", 4, {"pp": 2}), ("ddp", 4, {})]
FINITE_CHAIN = [4, 2, 8, 4]  # ddp's world sizes; 48 rows: 6 global batches of 8 a pass


def base(optimizer: str):
    from distlab import RunConfig
    return RunConfig(strategy="zero3", world_size=4, n_layer=2, n_embd=32, n_head=2, seq_len=16,
                     global_batch=8, optimizer=optimizer, lr=1e-2 if optimizer == "adamw" else 0.1,
                     timeout_s=120, checkpoint_every=STEPS_PER_LEG, keep_last=1)


def per_step(run, key="loss"):
    """{step: the mean over the ranks that logged it} (loss), or {step: sorted sample ids}."""
    out: dict = {}
    for e in run.history("step"):
        if key == "rows":
            out.setdefault(e["step"], []).extend(e["rows"])
        elif e.get("loss") is not None:
            out.setdefault(e["step"], []).append(e["loss"])
    return {s: sorted(v) if key == "rows" else sum(v) / len(v) for s, v in out.items()}


def chain(legs, cfg, root: str, key: str) -> tuple[bool, dict]:
    """Run the uninterrupted config and the legs; print a line per leg and the largest
    parameter difference at the end (read from both last checkpoints). (targets met, that
    difference)."""
    from distlab import launch
    from distlab.checkpoint import latest_checkpoint, load_full
    steps = STEPS_PER_LEG * len(legs)
    ref = launch(cfg.replace(steps=steps, checkpoint_dir=os.path.join(root, "ref"))).wait()
    want = per_step(ref, key)
    ok, resume = True, ""
    for i, (strategy, world, extra) in enumerate(legs):
        leg_dir = os.path.join(root, f"leg{i}")
        run = launch(cfg.replace(strategy=strategy, world_size=world, resume_from=resume,
                                 steps=STEPS_PER_LEG * (i + 1), checkpoint_dir=leg_dir,
                                 **{"tp": 1, "pp": 1, **extra})).wait()
        got = per_step(run, key)
        start = run.history("resume")[0]["steps_done"] if resume else 0
        lost_or_repeated = sorted(got) != list(range(STEPS_PER_LEG * i, STEPS_PER_LEG * (i + 1)))
        if key == "rows":
            same = all(got[s] == want[s] for s in got)
            figure = f"sample ids {'equal' if same else 'DIFFER'} at steps {sorted(got)}"
        else:
            worst = max(abs(got[s] - want[s]) for s in got)
            same = worst <= LOSS_TOL
            figure = f"loss diff {worst:.1e}"
        ok &= same and not lost_or_repeated and start == STEPS_PER_LEG * i
        print(f"  leg {i}: {strategy:>5} at {world} ranks{' ' + str(extra) if extra else '':<10} "
              f"resumed at step {start}: {figure}")
        resume = latest_checkpoint(leg_dir)
    a = load_full(resume)["model"]
    b = load_full(latest_checkpoint(os.path.join(root, "ref")))["model"]
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in b)
    print(f"  parameters at step {steps}: largest difference from the uninterrupted run "
          f"{worst:.1e}")
    return ok, worst


def main() -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                    help="sgd: no amplification of rounding, so the parameters agree closer")
    optimizer = ap.parse_args().optimizer
    root = os.environ["DISTLAB_RUNS"]
    print(f"chain 1: {' -> '.join(f'{s}@{w}' for s, w, _ in CHAIN)}, against zero3@4 "
          f"throughout (endless data, {optimizer})")
    ok1, _ = chain(CHAIN, base(optimizer), os.path.join(root, "c1"), "loss")
    print(f"chain 2: ddp@{' -> ddp@'.join(map(str, FINITE_CHAIN))}, a finite dataset (48 rows, "
          "2 passes), against ddp@4 throughout")
    finite = base(optimizer).replace(strategy="ddp", dataset_size=48, epochs=2)
    ok2, _ = chain([("ddp", w, {}) for w in FINITE_CHAIN], finite, os.path.join(root, "c2"),
                   "rows")
    ok = ok1 and ok2
    print(f"every leg resumed where the last ended, sample ids equal, losses within {LOSS_TOL}: "
          f"{'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    with scratch_runs(__file__, "distlab-bench-reshard-") as bench:
        sys.exit(bench.main())
