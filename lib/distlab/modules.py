"""Finding things by name: a module in a model by its dotted name (or a pattern of names), and
the tensors inside a module's nested inputs or outputs. Strategies, plans and debugging tools
all address a model this way (torchtitan's habit: parallelism applied from outside, by name).
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn


def find_module(model: nn.Module, name: str) -> tuple[str, nn.Module]:
    """The module called `name` (also under a wrapper's prefix, e.g. "module.head")."""
    modules = dict(model.named_modules())
    if name in modules:
        return name, modules[name]
    hits = [n for n in modules if n.endswith("." + name)]
    if len(hits) == 1:
        return hits[0], modules[hits[0]]
    top = [n for n, _ in model.named_children()]
    raise ValueError(f"no module named {name!r} in {type(model).__name__}"
                     + (f" (ambiguous: {hits})" if hits else "")
                     + f"; its top-level modules are: {', '.join(top)} (nest with dots, e.g. "
                     "'blocks.0.mlp')")


def name_matches(name: str, pattern: str) -> bool:
    """Whether dotted module name `name` matches `pattern`, one fnmatch pattern per dotted
    part ("blocks.*.attn.[qkv]" matches "blocks.3.attn.q", not "blocks.3.attn.q.lora")."""
    parts, pats = name.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, p) for a, p in zip(parts, pats))


def tensors_in(x):
    """The tensors in a module's inputs or outputs (nested tuples, lists and dicts)."""
    if torch.is_tensor(x):
        yield x
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from tensors_in(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from tensors_in(v)
