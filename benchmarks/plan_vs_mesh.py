"""The planner's top layouts, trained on the mesh: measured step time against predicted, and
whether the planner's order holds (distlab.studies.plan_check).

    .venv/bin/python benchmarks/plan_vs_mesh.py [--gpus 8] [--top 5] [--repeats 3]

A 4-layer, 64-wide GPT (4 heads, 64-token rows, global batch 16), SGD, fp32. The planner
ranks every dp x tp x pp x cp layout of --gpus ranks on this machine as measured (one rank's
FLOP/s on one thread, the loopback all-reduce's α-β); the --top fastest are trained --repeats
times, order alternating. Runs go to a temporary folder, removed at the end.
"""

from __future__ import annotations

import argparse

from _bench import scratch_runs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    from distlab import RunConfig
    from distlab.studies.plan_check import planned_vs_measured
    base = RunConfig(optimizer="sgd", lr=0.1, global_batch=16, seq_len=64, n_layer=4, n_embd=64,
                     n_head=4, steps=args.steps, timeout_s=120)
    with scratch_runs(__file__, "plan_vs_mesh-"):
        res = planned_vs_measured(base, gpus=args.gpus, top=args.top, repeats=args.repeats,
                                  warmup=2)
    link = res["link"]
    print(f"{res['cores']} cores, {args.gpus} ranks; one rank: {res['flops_per_rank'] / 1e9:.2f}"
          f" GFLOP/s on one thread; all-reduce α {link['alpha_call_s'] * 1e6:.0f} µs a call, "
          f"β {link['beta_Bps'] / 1e6:.0f} MB/s (fit's worst miss {link['fit_worst']:.0%})")
    print(f"{'#':>2} {'layout':<34} {'predicted ms':>12} {'measured ms':>12} "
          f"{'repeats ms':>22}  predicted parts ms")
    for r in res["rows"]:
        parts = " ".join(f"{k} {v * 1e3:.1f}" for k, v in r["predicted_parts"].items() if v)
        spread = ", ".join(f"{s * 1e3:.1f}" for s in r["spread_s"])
        print(f"{r['rank']:>2} {r['layout']:<34} {r['predicted_s'] * 1e3:>12.1f} "
              f"{r['measured_s'] * 1e3:>12.1f} {spread:>22}  {parts}")
    o = res["order"]
    print(f"planner's order holds: {'yes' if o['holds'] else 'no'} ({o['kept']} of {o['pairs']} "
          f"pairs kept, pairs predicted within 5% left out; {o['decided']} decided beyond the "
          "repeats' spread)")


if __name__ == "__main__":
    main()
