"""00: the bytes the allocator hands out for a run's model and its gradients.

The runs' memory dict counts numel × element_size of each tensor, so "4 bytes per fp32
parameter" set against it would be an identity. Here the bytes are read where they are
allocated instead: distlab.memory.PeakMemoryTracker records every storage aten ops make, with
its nbytes, and drops it when it is freed. Built and stepped in this process, from the run's
config and seed:

    params   live bytes after the model is built, less its buffers
    grads    live bytes added by one forward and backward, once the loss (and with it the graph
             and its activations) is freed: what backward left behind
    optim    live bytes added by the optimizer's first step: its state

A copy kept by mistake (a second fp32 copy of a weight, activations a hook holds), a model built
in another dtype, or gradients in another dtype than the weights change these figures; the
identity would not see them.
"""

from __future__ import annotations

import torch

from distlab.memory import PeakMemoryTracker


def allocated_bytes(cfg) -> dict:
    """{'params', 'grads', 'optim', 'n_params', 'n_tensors'}: bytes the allocator holds for
    cfg's model (built from cfg.seed, one process), for its gradients after one backward on 2
    random rows, and for cfg's optimizer's state after its first step."""
    from distlab.rank.build import build_model, build_optimizer

    torch.manual_seed(cfg.seed)
    tracker = PeakMemoryTracker()
    with tracker:
        model = build_model(cfg)
    storages = {b.untyped_storage()._cdata: b.untyped_storage().nbytes() for b in model.buffers()}
    params = tracker.current - sum(storages.values())
    x = torch.randint(cfg.vocab_size, (2, cfg.seq_len))
    y = torch.randint(cfg.vocab_size, (2, cfg.seq_len))
    before = tracker.current
    with tracker:
        loss = model(x, y)
        loss.backward()
    del loss  # the graph, and the activations it saved, go with it
    grads = tracker.current - before
    opt = build_optimizer(cfg, model.parameters())
    with tracker:
        opt.step()
    return {"params": params, "grads": grads, "optim": tracker.current - before - grads,
            "n_params": sum(p.numel() for p in model.parameters()),
            "n_tensors": len(list(model.parameters()))}


def memory_rows(alloc: dict) -> list[dict]:
    """The claims rows on what the allocator held (allocated_bytes' dict)."""
    from distlab.lab.common import claim
    n, params, grads, optim = (alloc[k] for k in ("n_params", "params", "grads", "optim"))
    counters = 4 * alloc["n_tensors"]  # AdamW's step: one fp32 scalar per parameter tensor
    return [
        claim("fp32 parameters take 4 bytes each", "IEEE 754 binary32",
              f"allocated while the run's model was built: {params:,} B for {n:,} parameters "
              f"= {params / n:g} B each", params == 4 * n),
        claim("gradients take as many bytes as the parameters", "one gradient per parameter",
              f"left allocated by one backward: {grads:,} B, parameters {params:,} B",
              grads == params),
        claim("AdamW keeps two moments per parameter", "Loshchilov & Hutter 2019",
              f"allocated by its first step: {optim:,} B; 2 × {params:,} + {counters} B of step "
              f"counters (4 B for each of {alloc['n_tensors']} tensors) = "
              f"{2 * params + counters:,}", optim == 2 * params + counters),
    ]
