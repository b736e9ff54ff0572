"""The routing of today's MoE models under expert parallelism: the figures issue 45 asks for.

    .venv/bin/python benchmarks/expert_routing.py [--seeds 3] [--steps 200] [--quick]

(i)   dropless equal to one process: the GPT with DeepSeek's routing in every block (dropless,
      top-2 of 8 experts of width 16, one shared expert, the auxiliary-loss-free bias at 1e-3,
      no auxiliary loss) trained 12 SGD steps under `ep` on 2 ranks against `single` with
      moe_groups=2: the largest |difference| of any parameter (the bias included) and the
      choices dropped. Target: at most 1e-5, and 0 dropped.
(ii)  balance: per seed, `ep` runs of --steps AdamW steps, dropless, top-1 of 4, with no
      balancing, Switch's loss at 1e-3, 1e-2, 1e-1 and the bias at 1e-3 and 1e-2
      (distlab.lab.expert_routing): MaxVio over the second half of the run and the language
      model's loss (the cross-entropy alone) over the last quarter. Target: the bias at 1e-3 at
      or below Switch's MaxVio at its best coefficient in every seed; the LM-loss difference is
      printed, with no target.
(iii) a user's MoE: the Mixtral-shaped block of tests/test_expert_parallel.py (its own router
      and SwiGLU experts) under expert_parallel on 2 ranks, 4 SGD steps, against its own
      forward in one process. Target: at most 1e-5.
(iv)  the experts on uneven batches, one process, forward and backward of a dropless top-2
      MoE (4096 tokens, width 256, experts of width 512, 8 and 32 experts, a skewed router):
      one F.grouped_mm product per layer against a loop over the experts; median, min and max
      of 9 repeats after 2 warm-ups. No target: which is faster here is the figure (the
      library's default, grouped="loop", follows it).

Exit status 0 when (i) and (iii) meet their targets (and (ii) is printed either way); runs go
to a temporary DISTLAB_RUNS folder, removed at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from _bench import scratch_runs

# (iii) uses the test's block: the user's code, written once
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

TARGET_DIFF = 1e-5


def deepseek_equal(steps: int) -> tuple[float, float]:
    from distlab import RunConfig
    from distlab.lab.experts import dropped_fraction
    from distlab.lab.runs import launch_together, worst_param_diff
    base = RunConfig(steps=steps, optimizer="sgd", lr=0.1, global_batch=8, seq_len=16,
                     n_layer=2, n_embd=32, n_head=2, mlp_ratio=2, n_experts=8, top_k=2,
                     expert_hidden=16, n_shared_experts=1, capacity_factor=0.0,
                     aux_loss_coef=0.0, expert_bias_rate=1e-3, timeout_s=120)
    single = launch_together({"s": base.replace(moe_groups=2)}, name="bench-ds-single")["s"]
    ep = launch_together({"e": base.replace(strategy="ep", world_size=2)}, name="bench-ds-ep")["e"]
    diff = max(worst_param_diff(s, single.states[0]) for s in ep.states)
    return diff, dropped_fraction(ep)


def balance(seeds: int, steps: int) -> bool:
    from distlab import RunConfig
    from distlab.lab.expert_routing import balance_rows, run_balance
    base = RunConfig(steps=steps, optimizer="adamw", lr=3e-3, global_batch=8, seq_len=16,
                     n_layer=2, n_embd=32, n_head=2, mlp_ratio=2, n_experts=4, timeout_s=120,
                     strategy="ep", world_size=2)
    met = True
    print(f"(ii) balance, {steps} steps per run; MaxVio (second half) / LM loss (last quarter)")
    for seed in range(seeds):
        rows = {r["name"]: r for r in balance_rows(run_balance(base.replace(seed=seed)))}
        print(f"  seed {seed}: " + "; ".join(f"{n} {r['max_vio']:.3f} / {r['lm_loss']:.4f}"
                                             for n, r in rows.items()))
        best = min((n for n in rows if n.startswith("Switch")),
                   key=lambda n: rows[n]["max_vio"])
        ok = rows["bias 0.001"]["max_vio"] <= rows[best]["max_vio"]
        met &= ok
        print(f"    bias 1e-3 MaxVio {rows['bias 0.001']['max_vio']:.3f} vs Switch's best "
              f"({best}) {rows[best]['max_vio']:.3f}: {'at or below' if ok else 'ABOVE'}; "
              f"LM loss {best} minus bias: "
              f"{rows[best]['lm_loss'] - rows['bias 0.001']['lm_loss']:+.4f}")
    print(f"    target (every seed): {'met' if met else 'NOT met'}")
    return met


def _mixtral_rank(rank, world, device, log):
    from test_expert_parallel import mixtral_ep

    from distlab.comm import Comm
    return mixtral_ep(Comm())


def mixtral(bench) -> float:
    from test_expert_parallel import max_diff, mixtral_single

    from distlab import run_ranks
    ranks = run_ranks(bench._mixtral_rank, 2, timeout_s=120)
    ref = mixtral_single()
    return max(max_diff(r["state"], ref["state"]) for r in ranks)


def grouped_vs_loop(quick: bool) -> None:
    import statistics

    import torch
    import torch.nn.functional as F

    from distlab.models.moe import MoE
    if not hasattr(F, "grouped_mm"):
        print(f"(iv) torch {torch.__version__} has no F.grouped_mm: not timed")
        return
    tokens, d, h = (1024, 128, 256) if quick else (4096, 256, 512)
    print(f"(iv) forward + backward, {tokens} tokens, width {d}, experts of {h}, top-2 "
          "dropless (ms: median, min-max of 9)")
    for E in (8, 32):
        times = {}
        for how in ("loop", "grouped_mm"):
            torch.manual_seed(0)
            moe = MoE(d, h, E, top_k=2, capacity_factor=0, grouped=how)
            with torch.no_grad():
                moe.router.weight[0] += 0.5  # skewed: uneven batches
            x = torch.randn(tokens, d, requires_grad=True)
            samples = []
            for i in range(11):
                t0 = time.perf_counter()
                moe(x).square().mean().backward()
                if i >= 2:
                    samples.append(1e3 * (time.perf_counter() - t0))
            times[how] = samples
        counts = moe.last_stats["kept_per_expert"]
        line = ", ".join(f"{how} {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"
                         for how, v in times.items())
        ratio = statistics.median(times["grouped_mm"]) / statistics.median(times["loop"])
        print(f"  E={E} (rows per expert {min(counts)}-{max(counts)}): {line}; grouped / loop "
              f"{ratio:.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="1 seed, 40 steps, smaller (iv)")
    a = ap.parse_args()
    seeds, steps = (1, 40) if a.quick else (a.seeds, a.steps)
    with scratch_runs(__file__, "distlab-bench-routing-") as bench:
        diff, dropped = deepseek_equal(12)
        ok_i = diff <= TARGET_DIFF and dropped == 0
        print(f"(i) DeepSeek's routing under ep vs one process, 12 steps: {diff:.1e} "
              f"(target {TARGET_DIFF:g}), {100 * dropped:.1f}% dropped: "
              f"{'met' if ok_i else 'NOT met'}")
        balance(seeds, steps)
        m = mixtral(bench)
        ok_iii = m <= TARGET_DIFF
        print(f"(iii) a Mixtral-shaped block of your own under ep vs its forward in one "
              f"process: {m:.1e} (target {TARGET_DIFF:g}): {'met' if ok_iii else 'NOT met'}")
        grouped_vs_loop(a.quick)
    return 0 if ok_i and ok_iii else 1


if __name__ == "__main__":
    sys.exit(main())
