"""FLOPs counted by PyTorch, set beside the formula, and this machine's matmul peak.

    count_step_flops(cfg)   one training step's FLOPs as torch.utils.flop_counter counts them,
                            by operator, beside 6·N·tokens and the attention term
    matmul_peak(...)        the FLOP/s this machine reaches on one large square matmul

**What the counter sees.** `FlopCounterMode` counts the matmul-like ATen operators (mm, addmm,
bmm, convolutions, the fused attention kernels it has formulas for) as they run, forward and
backward. It does not count elementwise work (LayerNorm, GELU, softmax, the optimizer), which
the formula leaves out too. One gap measured here (torch 2.13): it has no formula for the CPU
build's fused attention kernel (`_scaled_dot_product_flash_attention_for_cpu`), so on a CPU the
attention matmuls vanish from the count. `count_step_flops` therefore runs the step with
PyTorch's math attention (`SDPBackend.MATH`: the same result, computed as two bmm), which the
counter sees; the step's value is unchanged.

**The formula** (distlab.theory.flops.train_flops_per_token): 6N per token for the N parameters that
multiply (Kaplan et al. 2020, Section 2.1) plus 12·L·h·s for attention's two s×s matmuls
(Chowdhery et al. 2022, PaLM, Appendix B). The math kernel computes the full s×s score matrix
and masks it afterwards, as the formula assumes, so the two should agree exactly.

**The peak.** MFU needs a peak. A GPU has a datasheet figure (distlab.theory.flops.datasheet_peak); a
CPU's depends on its vector units, clock and threads, so we measure it: the median FLOP/s of a
large fp32 matmul, the best case for this machine's BLAS. MFU against it says how much of what
the machine can do the training step got.
"""

from __future__ import annotations

import statistics
import time

import torch

from distlab.theory.flops import matmul_params, train_flops_per_token


def count_step_flops(cfg) -> dict:
    """Run one forward and backward of `cfg`'s GPT on `cfg.global_batch` rows of random tokens
    under FlopCounterMode and return the counts beside the formulas (all in FLOPs):

        counted            everything the counter saw
        by_op              {"aten.mm": ..., "aten.addmm": ..., "aten.bmm": ...}
        attention          the bmm part: attention's two s×s matmuls and their gradients
        formula            (6N + 12·L·h·s) · tokens
        formula_6n         6N · tokens
        formula_attention  12·L·h·s · tokens
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from distlab.rank.build import build_model

    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    idx = torch.randint(0, cfg.vocab_size, (cfg.global_batch, cfg.seq_len + 1), generator=gen)
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):  # the CPU flash kernel is not counted (above)
        model(idx[:, :-1], idx[:, 1:]).backward()
    by_op = {str(op): int(n) for op, n in counter.get_flop_counts()["Global"].items()}
    tokens = cfg.global_batch * cfg.seq_len
    attention_per_token = 12 * cfg.n_layer * cfg.n_embd * cfg.seq_len
    return {"counted": int(counter.get_total_flops()), "by_op": by_op,
            "attention": by_op.get("aten.bmm", 0), "tokens": tokens,
            "formula": train_flops_per_token(cfg) * tokens,
            "formula_6n": 6 * matmul_params(cfg) * tokens,
            "formula_attention": attention_per_token * tokens}


def matmul_peak(n: int = 1024, repeats: int = 10, threads: int | None = None,
                dtype: torch.dtype = torch.float32) -> dict:
    """This machine's FLOP/s on an n×n by n×n matmul (2n³ FLOPs), median of `repeats` after a
    warm-up, with `threads` intra-op threads (default: torch's current setting)."""
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        torch.mm(a, b)  # warm-up: BLAS picks its kernel, pages are touched
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - t0)
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(old)
    seconds = statistics.median(times)
    return {"flops_per_s": 2 * n**3 / seconds, "n": n, "threads": used, "seconds": seconds,
            "dtype": str(dtype).replace("torch.", "")}
