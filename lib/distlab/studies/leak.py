"""Memory that grows every step: keeping tensors that hold their autograd graph.

The textbook leak is `history.append(loss)` where `loss.item()` was meant: the kept tensor
holds its graph, and a graph holds what its forward saved for backward. Whether that is a
step's activations depends on one thing: **whether backward has run on that graph with
retain_graph=False** (the default). Backward frees every saved tensor as it goes (that is why
a second backward through the same graph fails), so a loss kept *after* its backward keeps
only itself (a 4-byte scalar) and the graph's nodes (small objects on the host, no tensor
storage). The activations stay alive when the kept graph was never backwarded, or was with
retain_graph=True:

    keep="item"          history.append(loss.item())               the fix: a Python float
    keep="detach"        history.append(loss.detach())             a 4-byte tensor per step
    keep="tensor"        loss.backward(); history.append(loss)     4 bytes + the graph's nodes
    keep="retain_graph"  loss.backward(retain_graph=True);         one step's activations
                         history.append(loss)                      per step
    keep="eval_tensor"   an evaluation loss computed without       one forward's activations
                         torch.no_grad(), kept as a tensor         per step

    rows = leak_run("retain_graph", steps=8)  # per step: live bytes, activations, graph nodes
    growth_per_step(rows)                     # bytes added per step once the run is steady

**What is measured, and why it is exact.** `live` is PeakMemoryTracker.current at the end of
each step (after zero_grad): the bytes of every storage an aten op allocated and that is still
alive, taken off by a weakref callback the moment a storage is freed; parameters are adopted
at the start. Everything a step allocates here goes through aten ops, so the count is exact to
the byte, and a kept storage shows as bytes that never come off. `activations` is the
ActivationMeter's count for the forward whose graph is kept (each saved storage once; the batch
is saved by the embedding and the loss, so it is in it): for a graph kept with its saved
tensors the growth per step is activations + 4 (the loss scalar), exactly. `graph_nodes`
counts the autograd nodes reachable from what the history holds: the host-side part of the
leak, which the tracker (tensor storages only) does not see.
"""

from __future__ import annotations

import torch

from distlab.data.dataset import MarkovData
from distlab.memory import ActivationMeter, PeakMemoryTracker
from distlab.models.gpt import GPT, GPTConfig

KEEPS = ("item", "detach", "tensor", "retain_graph", "eval_tensor")


def graph_nodes(history) -> int:
    """Autograd nodes reachable from the tensors in `history` (each node once)."""
    seen, stack = {}, [t.grad_fn for t in history if torch.is_tensor(t) and t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node  # held, so no id is reused while we walk
        stack.extend(n for n, _ in node.next_functions)
    return len(seen)


def leak_run(keep: str, steps: int = 8, model_cfg: GPTConfig | None = None, rows: int = 8,
             lr: float = 0.3, seed: int = 0) -> list[dict]:
    """Train distlab's GPT (plain SGD, this process) for `steps` steps, keeping the loss as
    `keep` says (module doc). Per step: live bytes at its end, the activation bytes of the
    forward whose result is kept, and the graph nodes the history holds."""
    if keep not in KEEPS:
        raise ValueError(f"keep={keep!r}: one of {KEEPS}")
    c = model_cfg or GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_embd=32, n_head=2)
    torch.manual_seed(seed)
    model = GPT(c)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    data = MarkovData(c.vocab_size, c.block_size, seed=seed)
    tracker = PeakMemoryTracker()
    tracker.adopt([*model.parameters(), *model.buffers()])
    meter = ActivationMeter(model)
    history, out = [], []
    for step in range(steps):
        x, y = data.global_batch(step, rows)
        tracker.step_begin(x, y)
        with meter.measure():
            loss = model(x, y)
        kept_activations = meter.bytes
        loss.backward(retain_graph=keep == "retain_graph")
        opt.step()
        opt.zero_grad(set_to_none=True)
        if keep == "eval_tensor":  # the training loss is logged right; the eval loss is not
            ex, ey = data.eval_batch(step, rows)
            tracker.adopt([ex, ey])
            with meter.measure():
                history.append(model(ex, ey))  # no torch.no_grad(): the graph is built
            kept_activations = meter.bytes
            history.append(loss.item())
        elif keep == "item":
            history.append(loss.item())
        elif keep == "detach":
            history.append(loss.detach())
        else:  # "tensor", "retain_graph": the loss itself, with its graph
            history.append(loss)
        del x, y, loss
        tracker.step_end()
        out.append({"step": step, "live": tracker.current, "activations": kept_activations,
                    "graph_nodes": graph_nodes(history)})
    return out


def growth_per_step(rows: list[dict]) -> float:
    """Mean bytes added to `live` per step: (last − first) / (steps − 1). Each difference is
    what one step kept; with nothing kept it is 0 (plain SGD allocates no lasting state)."""
    live = [r["live"] for r in rows]
    if len(live) < 2:
        raise ValueError("need at least 2 steps")
    return (live[-1] - live[0]) / (len(live) - 1)
