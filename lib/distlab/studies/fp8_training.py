"""FP8 training against bf16 and fp32 on the same data: the workbook GPT's configs in each
precision (distlab.lab.fp8.run_precisions trains them in one launch) and the loss gap each FP8
scaling leaves (distlab.rank.fp8_linear is what trains in FP8).

The final loss is the mean of the last quarter of the steps (one step's loss moves with its
batch); the gap is (fp8 - bf16) / bf16 of those means, the issue's target being within 2%.
"""

from __future__ import annotations

from distlab.config import RunConfig
from distlab.rank.fp8_linear import FP8_SCALINGS

# the GPT whose matmuls FP8 reads: 256 wide (two 128-value tiles per row, a 128 x 128 block
# grid over each weight), 2 blocks, 64-token rows
BASE = RunConfig(n_layer=2, n_embd=256, n_head=4, seq_len=64, global_batch=8, steps=120,
                 optimizer="adamw", lr=1e-3, strategy="ddp", world_size=2, timeout_s=120,
                 threads_per_rank=1)


def precisions(base: RunConfig = BASE, scalings=FP8_SCALINGS) -> dict[str, RunConfig]:
    """{name: config}: fp32, bf16 and fp8 with each scaling, the same data and seed."""
    out = {"fp32": base.replace(precision="fp32"), "bf16": base.replace(precision="bf16")}
    out.update({f"fp8 {s}": base.replace(precision="fp8", fp8_scaling=s) for s in scalings})
    return out


def gathers(base: RunConfig = BASE, steps: int = 2) -> dict[str, RunConfig]:
    """zero3 on base's ranks with the FP8 Linears' weights all-gathered in fp32, bf16 (FSDP's
    param_dtype) and e4m3 (fp8_all_gather): {"zero3 <dtype> gather": config}."""
    z = base.replace(strategy="zero3", precision="fp8", fp8_scaling="tensorwise", steps=steps)
    return {"zero3 fp32 gather": z, "zero3 bf16 gather": z.replace(param_dtype="bf16"),
            "zero3 fp8 gather": z.replace(fp8_all_gather=True)}


def gather_rows(bytes_per_step: dict[str, tuple[float, float]]) -> list[dict]:
    """Per gather dtype, from (the FP8 Linears' all-gather bytes, the amaxes' bytes) per step
    on one rank: the total and its ratio to the bf16 gather's."""
    bf16 = sum(bytes_per_step["zero3 bf16 gather"])
    return [{"gather": name, "weights": w, "scales": a, "ratio_to_bf16": (w + a) / bf16}
            for name, (w, a) in bytes_per_step.items()]


def final_loss(losses: list[float]) -> float:
    """The mean of the last quarter of the per-step losses."""
    tail = losses[-max(1, len(losses) // 4):]
    return sum(tail) / len(tail)


def gap_rows(losses: dict[str, list[float]]) -> list[dict]:
    """Per precision: its final loss and its gap to bf16's (fraction), from per-step losses."""
    ref = final_loss(losses["bf16"])
    return [{"precision": name, "final_loss": final_loss(ls),
             "gap_to_bf16": (final_loss(ls) - ref) / ref} for name, ls in losses.items()]

