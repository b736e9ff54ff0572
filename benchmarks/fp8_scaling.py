"""FP8 scaling on the workbook GPT's tensors (issue 46, items 1-2): what each scheme does to the
values beside an outlier channel, and delayed against dynamic scaling.

    .venv/bin/python benchmarks/fp8_scaling.py [--sizes 1 10 100 1e3 1e4 1e5 1e6]

One process, no launch (distlab.studies.fp8_scaling; the arithmetic is distlab.fp8):

(i)   the formats, from torch.finfo: e4m3 and e5m2 beside fp16 and bf16;
(ii)  the outlier sweep: every nn.Linear input of a 2-block, 256-wide GPT after 5 AdamW steps,
      4 channels multiplied by each size; per scheme (tensorwise, rowwise, 1x128, 128x128),
      e4m3: the relative error of the other values, the fractions flushed to zero and left
      subnormal; then the smallest size at which 1x128 tiles beat one scale per tensor by 10x,
      or the statement that no size swept reaches it. The weights' error per scheme beside;
(iii) delayed (history 16) against dynamic tensorwise scaling on blocks.0.mlp.fc's input over
      30 AdamW steps at lr 3e-2, then with step 20's activations x 10.

No target is asserted: the figures are the finding (the issue's: "the size from which
block-wise beats tensorwise by 10x, or the statement that it never does below 10^4x").
"""

from __future__ import annotations

import argparse

import torch


def main() -> int:
    from distlab import fp8
    from distlab.studies.fp8_scaling import (activation_stream, crossover, delayed_vs_dynamic,
                                             gpt_tensors, outlier_sweep, weight_errors)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1, 10, 100, 1e3, 1e4, 1e5, 1e6])
    a = ap.parse_args()
    print("(i) formats: max, smallest normal, smallest subnormal, eps")
    for name, dt in (("e4m3", fp8.E4M3), ("e5m2", fp8.E5M2), ("fp16", torch.float16),
                     ("bf16", torch.bfloat16)):
        f = fp8.format_facts(dt)
        print(f"  {name}: {f['max']:g}, {f['smallest_normal']:.3g}, "
              f"{f['smallest_subnormal']:.3g}, {f['eps']:g}")
    tensors = gpt_tensors()
    rows = outlier_sweep(tensors, sizes=a.sizes)
    print("(ii) outlier sweep, e4m3, the values beside 4 outlier channels: relative error / "
          "flushed / subnormal")
    for size in a.sizes:
        print(f"  x{size:g}: " + "; ".join(
            f"{r['scheme']} {r['rel_error']:.4f} / {100 * r['flushed']:.2f}% / "
            f"{100 * r['subnormal']:.1f}%" for r in rows if r["size"] == size))
    size = crossover(rows)
    by = {(r["size"], r["scheme"]): r["rel_error"] for r in rows}
    best = max(by[s, "tensorwise"] / by[s, "block1x128"] for s in a.sizes)
    print(f"  1x128 tiles 10x better than one scale per tensor: "
          + (f"from x{size:g}" if size else f"at no size swept (up to x{max(a.sizes):g}; the "
             f"largest ratio {best:.1f}x): FP8 is a floating format, an outlier's scale shifts "
             "the others' exponents and costs precision only once they reach the subnormals"))
    print("  weights, no outliers: " + ", ".join(f"{s} {e:.4f}"
                                                 for s, e in weight_errors(tensors).items()))
    stream = activation_stream()
    for spikes in ({}, {20: 10.0}):
        d = delayed_vs_dynamic(stream, spikes=spikes)
        worst = max(d, key=lambda r: r["delayed_saturated"])
        print(f"(iii) delayed vs dynamic{' with step 20 x10' if spikes else ''}: mean error "
              f"{sum(r['delayed_error'] for r in d) / len(d):.4f} vs "
              f"{sum(r['dynamic_error'] for r in d) / len(d):.4f}; worst step saturated "
              f"{100 * worst['delayed_saturated']:.3f}% (step {worst['step']}, error "
              f"{worst['delayed_error']:.4f}) vs dynamic "
              f"{100 * max(r['dynamic_saturated'] for r in d):.3f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
