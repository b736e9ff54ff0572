"""fully_shard's flat units against its per-parameter shards (FSDP2's layout), and torch's
FSDP2, side by side on 4 ranks (distlab.studies.fsdp_layouts).

    .venv/bin/python benchmarks/fsdp_layouts.py [--world 4] [--steps 8] [--repeats 3]

Two GPTs, each trained with AdamW by the three ways in one launch: RunConfig's default (4
layers, width 128: every dim-0 divides by 4, so neither layout pads) and the same at width 126
(2 heads: each 126-row parameter is cut into chunks of 32 rows, 2 of them padding). Per way:
the all-gathers and reduce-scatters of a step and their bytes (counted at the dispatcher; the
formula of distlab.theory.fsdp_layouts beside them, with its padding entries), the bytes the
kernel saw each rank write per step, the seconds of the copy kernels (dispatcher-timed) and of
per_param's copying code (its own timers: the copies with their views, casts and the wrapping
of each gradient shard as a DTensor), the step and optimizer-step medians with their range
over repeats, the peak of bytes aten allocated in a step and ours' peak of gathered-parameter
bytes, and the largest loss gap between the ways (they train the same steps).

Runs go to a temporary DISTLAB_RUNS folder, removed at the end.
"""

from __future__ import annotations

import argparse

from _bench import scratch_runs

MODELS = {"RunConfig's GPT (width 128)": {},
          "the same at width 126": {"n_embd": 126, "n_head": 2}}


def show(name: str, result: dict) -> None:
    from distlab.studies.fsdp_layouts import HEADER, loss_gap, table_rows
    print(f"\n== {name}: {result['world']} ranks, {result['steps']} steps x {result['repeats']} "
          f"repeats after {result['warmup']} warmup steps, AdamW")
    rows = [HEADER] + table_rows(result)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    own = result["ways"]["per_param"]["own_copy_s"]["median"]
    step = result["ways"]["per_param"]["step_s"]["median"]
    print(f"per_param's copying code: {own / step:.1%} of its median step; largest loss gap "
          f"between the ways: {loss_gap(result):.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    with scratch_runs(__file__, "distlab-fsdp-layouts-"):
        from distlab.studies.fsdp_layouts import compare
        for name, model in MODELS.items():
            show(name, compare(args.world, args.steps, args.repeats, args.warmup,
                               lr=1e-3, **model))


if __name__ == "__main__":
    main()
