"""bf16 against fp32 on a GPU: step time, tokens/s, model FLOP/s, MFU and peak memory.

    .venv/bin/python benchmarks/gpu.py [--steps 10] [--warmup 3]
        [--n-layer L --n-embd H --n-head A --seq-len S --batch B]
    .venv/bin/python benchmarks/gpu.py --device cpu --tiny      # the code path, on a CPU

One process, no launch: the library's GPT, AdamW and autocast (distlab.rank.train), trained on
random tokens made on the device, in fp32 with TF32 off, fp32 with TF32 on, then bf16
autocast, one model at a time (distlab.studies.gpu.amp_timings). The model fills the GPU: the largest GPT of width 2048 (16
heads, 1024-token rows, vocabulary 32768) whose fp32 estimate (distlab.theory.estimate: model
states and activations) fits in 55% of the free memory torch.cuda.mem_get_info() reports
(distlab.studies.gpu.pick_gpt); the flags override it.

Per precision it prints the median step time, tokens/s, achieved model FLOP/s (6N + 12·L·h·s
per token: Kaplan et al. 2020 for 6N, PaLM's Appendix B and nanoGPT's estimate_mfu for the
attention term; distlab.studies.gpu), MFU against the datasheet's dense peak (H100 SXM and H200: bf16
989 TFLOP/s, fp32 67, from NVIDIA's H100 and H200 datasheets), and
torch.cuda.max_memory_allocated over the timed steps. Then the targets:

    bf16 / fp32 step-time speed-up   at least 2x (H100/H200: tensor cores against FP32 cores)
    bf16 MFU                         at least 40%

Exit status 0 when both are met (or there is no GPU to measure: one line says so), 1 when
one is missed. With --device cpu there are no targets and no datasheet peak (MFU "n/a").
"""

from __future__ import annotations

import argparse
import sys

import torch

from distlab import RunConfig
from distlab.studies import gpu as G
from distlab.theory import flops as F
from distlab.theory.estimate import gpt_params_of

TARGET_SPEEDUP = 2.0
TARGET_MFU = 0.40
GiB = 2**30


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide GPT (code path)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--n-layer", type=int)
    ap.add_argument("--n-embd", type=int)
    ap.add_argument("--n-head", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--batch", type=int)
    args = ap.parse_args()

    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA GPU here (torch.cuda.is_available() is False): "
              "nothing measured")
        return 0
    device = torch.device(args.device)
    if args.tiny:
        cfg = RunConfig(n_layer=2, n_embd=64, n_head=2, seq_len=32, global_batch=8,
                        vocab_size=256)
        chosen = "--tiny"
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        cfg = G.pick_gpt(free)
        if cfg is None:
            print(f"no GPT of width 2048 fits in {free / GiB:.1f} GiB free: give --n-embd etc.")
            return 1
        chosen = f"fills 55% of {free / GiB:.1f} GiB free (of {total / GiB:.1f} GiB)"
    else:
        cfg = RunConfig(n_layer=4, n_embd=256, n_head=4, seq_len=128, global_batch=8,
                        vocab_size=4096)
        chosen = "a CPU-sized default"
    given = {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head,
             "seq_len": args.seq_len, "global_batch": args.batch}
    given = {k: v for k, v in given.items() if v is not None}
    if given:
        cfg = cfg.replace(**given)
        chosen = "from the flags"

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    psi = gpt_params_of(cfg)
    tf32 = ("; TF32 off for the fp32 and bf16 rows, on for the fp32 TF32 row"
            if device.type == "cuda" else "")
    print(f"{name}, torch {torch.__version__}{tf32}")
    print(f"GPT {cfg.n_layer} layers x {cfg.n_embd} wide, {cfg.n_head} heads, "
          f"{cfg.global_batch} rows x {cfg.seq_len} tokens, vocabulary {cfg.vocab_size}, "
          f"{psi:,} parameters ({chosen}); AdamW; {args.steps} timed steps after "
          f"{args.warmup} warm-up")
    print(f"model FLOPs per token 6N + 12·L·h·s = {F.train_flops_per_token(cfg):.3e} "
          f"(N = {F.matmul_params(cfg):,} multiplying parameters)")

    # fp32 with TF32 off (the targets' baseline), fp32 with TF32 on, bf16 autocast
    timed = G.amp_timings(cfg, device, steps=args.steps, warmup=args.warmup)
    rows = {"fp32": timed["fp32, TF32 off"], "fp32 TF32": timed["fp32, TF32 on"],
            "bf16": timed["bf16 autocast"]}

    print(f"\n{'precision':9} {'step ms':>9} {'tokens/s':>11} {'TFLOP/s':>8} {'MFU':>7} "
          f"{'peak GiB':>9}  loss   step ms min / max")
    sources = set()
    for precision, r in rows.items():
        u, source = G.mfu(r, device)
        sources.add(source)
        peak = f"{r['peak_bytes'] / GiB:9.2f}" if r["peak_bytes"] is not None else f"{'n/a':>9}"
        print(f"{precision:9} {r['step_s'] * 1e3:9.1f} {r['tokens_per_s']:11,.0f} "
              f"{r['flops_per_s'] / 1e12:8.2f} {f'{u:.1%}' if u is not None else 'n/a':>7} "
              f"{peak}  {r['loss']:.3f}  {min(r['step_samples']) * 1e3:.1f} / "
              f"{max(r['step_samples']) * 1e3:.1f}")
    for source in sorted(sources):
        print(f"MFU peak: {source}")

    speedup = rows["fp32"]["step_s"] / rows["bf16"]["step_s"]
    print(f"bf16 / fp32 with TF32 on: {rows['fp32 TF32']['step_s'] / rows['bf16']['step_s']:.2f}x"
          " (the targets below are against TF32 off)")
    bf16_mfu, _ = G.mfu(rows["bf16"], device)
    if device.type != "cuda":
        print(f"\nbf16 / fp32 speed-up {speedup:.2f}x on the CPU (no target: the targets are "
              f"for a GPU; MFU n/a (no datasheet peak for this CPU))")
        return 0
    ok_speed = speedup >= TARGET_SPEEDUP
    ok_mfu = bf16_mfu is not None and bf16_mfu >= TARGET_MFU
    print(f"\nbf16 / fp32 step-time speed-up: {speedup:.2f}x (target: at least "
          f"{TARGET_SPEEDUP:g}x on an H100 or H200): {'met' if ok_speed else 'NOT met'}")
    print(f"bf16 MFU: {f'{bf16_mfu:.1%}' if bf16_mfu is not None else 'n/a'} (target: at "
          f"least {TARGET_MFU:.0%}): {'met' if ok_mfu else 'NOT met'}")
    return 0 if ok_speed and ok_mfu else 1


if __name__ == "__main__":
    sys.exit(main())
