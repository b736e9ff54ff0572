"""FP8's scaling measured on the workbook GPT's own tensors, in the notebook's process
(benchmarks/fp8_scaling.py prints it; distlab.fp8 is the arithmetic).

The tensors: a GPT (2 blocks, width 256, 4 heads, 64-token rows) trained a few AdamW steps on
the workbook's data; every nn.Linear's input (the activations a FP8 matmul would cast) and
weight at the last step, captured by forward hooks.

Outliers: LLM activations carry a few channels far larger than the rest (Dettmers et al. 2022,
"LLM.int8()": magnitudes up to 20x the others from 6.7B parameters on, and more beyond). Here
`n_outliers` channels (columns) of each activation matrix are multiplied by a size from 1 to
10^4 (and beyond, to find where tensorwise scaling breaks); every scheme's error is then
measured on the OTHER values, the ones an outlier's scale hurts.

Delayed against dynamic scaling: the same layer's input over training steps (AdamW at a high
learning rate); delayed scaling casts each step with the largest amax of the steps before it
(distlab.fp8.DelayedScaling), dynamic with its own; and the same stream with one step's
activations multiplied (a spike), which the history has not seen.
"""

from __future__ import annotations

import torch
from torch import nn

from distlab import fp8
from distlab.config import RunConfig
from distlab.data.dataset import make_data
from distlab.models import GPT, GPTConfig

GPT_CFG = RunConfig(n_layer=2, n_embd=256, n_head=4, seq_len=64, global_batch=8,
                    optimizer="adamw", lr=3e-3)


def _train(cfg: RunConfig, steps: int, lr: float, watch) -> GPT:
    """`steps` AdamW steps of cfg's GPT in this process (fp32); watch(model) registers the
    forward hooks that keep what the caller wants and returns them (removed at the end)."""
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig.from_run(cfg))
    data = make_data(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    hooks = watch(model)
    for step in range(steps):
        x, y = data.global_batch(step, cfg.global_batch)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    for h in hooks:
        h.remove()
    return model


def _rows(inp) -> torch.Tensor:
    """A Linear's input as (tokens, features)."""
    return inp[0].detach().reshape(-1, inp[0].shape[-1]).clone()


def gpt_tensors(cfg: RunConfig = GPT_CFG, steps: int = 5) -> dict[str, torch.Tensor]:
    """{"<linear>.input": (tokens, in) activations, "<linear>.weight": (out, in)} of every
    nn.Linear at the last of `steps` training steps (one process, fp32)."""
    seen: dict[str, torch.Tensor] = {}

    def watch(model):
        return [m.register_forward_hook(
                    lambda m, inp, out, name=name: seen.__setitem__(f"{name}.input", _rows(inp)))
                for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    model = _train(cfg, steps, cfg.lr, watch)
    seen.update({f"{name}.weight": m.weight.detach().clone()
                 for name, m in model.named_modules() if isinstance(m, nn.Linear)})
    return seen


def with_outliers(x: torch.Tensor, size: float, n_outliers: int = 4, seed: int = 0):
    """(x with n_outliers columns multiplied by size, the mask of the other columns)."""
    g = torch.Generator().manual_seed(seed)
    cols = torch.randperm(x.shape[-1], generator=g)[:n_outliers]
    out = x.clone()
    out[:, cols] *= size
    keep = torch.ones(x.shape[-1], dtype=torch.bool)
    keep[cols] = False
    return out, keep


def outlier_sweep(tensors: dict, sizes=(1, 10, 100, 1e3, 1e4), schemes=fp8.SCHEMES,
                  n_outliers: int = 4) -> list[dict]:
    """Per outlier size and scheme, over every activation matrix: the mean relative error of
    the non-outlier values, and the fractions of them flushed to zero and left subnormal."""
    acts = [t for k, t in tensors.items() if k.endswith(".input")]
    rows = []
    for size in sizes:
        for scheme in schemes:
            stats = [fp8.error_stats(x, scheme, where=keep)
                     for x, keep in (with_outliers(a, size, n_outliers) for a in acts)]
            rows.append({"size": size, "scheme": scheme,
                         **{k: sum(s[k] for s in stats) / len(stats)
                            for k in ("rel_error", "flushed", "subnormal")}})
    return rows


def crossover(rows: list[dict], fine: str = "block1x128", factor: float = 10.0):
    """The smallest outlier size at which `fine` scaling's error is `factor` times smaller than
    tensorwise's, or None if no size swept reaches it."""
    by = {(r["size"], r["scheme"]): r["rel_error"] for r in rows}
    for size in sorted({r["size"] for r in rows}):
        if by[size, "tensorwise"] >= factor * by[size, fine]:
            return size
    return None


def weight_errors(tensors: dict, schemes=fp8.SCHEMES) -> dict[str, float]:
    """Per scheme, the mean relative error over the GPT's weight matrices (no outliers)."""
    ws = [t for k, t in tensors.items() if k.endswith(".weight")]
    return {s: sum(fp8.error_stats(w, s)["rel_error"] for w in ws) / len(ws) for s in schemes}


def activation_stream(cfg: RunConfig = GPT_CFG, steps: int = 30, layer: str = "blocks.0.mlp.fc",
                      lr: float = 3e-2) -> list[torch.Tensor]:
    """`layer`'s input at every training step (one process, AdamW at `lr`: a high rate, so
    the activations move over the run)."""
    stream: list[torch.Tensor] = []

    def watch(model):
        module = dict(model.named_modules())[layer]
        return [module.register_forward_hook(lambda m, inp, out: stream.append(_rows(inp)))]
    _train(cfg, steps, lr, watch)
    return stream


def delayed_vs_dynamic(stream: list[torch.Tensor], history: int = 16,
                       spikes: dict | None = None) -> list[dict]:
    """Per step: the amax, and for delayed (tensorwise, history) and dynamic scaling the
    relative error and the fraction saturated. `spikes` {step: factor}: that step's tensor
    multiplied by factor (a batch whose activations jump, as a loss spike's do)."""
    delayed = fp8.DelayedScaling(history)
    rows = []
    for step, x in enumerate(stream):
        x = x * (spikes or {}).get(step, 1.0)
        late = fp8.error_stats(x, "tensorwise", amax=delayed.amax(x))
        now = fp8.error_stats(x, "tensorwise")
        delayed.observe(x)
        rows.append({"step": step, "amax": float(x.abs().max()),
                     "delayed_error": late["rel_error"], "delayed_saturated": late["saturated"],
                     "dynamic_error": now["rel_error"], "dynamic_saturated": now["saturated"]})
    return rows
