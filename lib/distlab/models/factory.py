"""Your own model and data in distlab's training loop, named by import path.

    RunConfig(strategy="zero2", world_size=2, model="my_pkg.nets:make_model",
              data="my_pkg.nets:make_data")

A spec is "module.path:function" (imported as Python imports it, so the module must be on
sys.path; spawned ranks get the launcher's) or "path/to/file.py:function" (a file, relative to
the working directory). The config travels to the ranks as the string; each rank imports it.

The two functions, each called with the RunConfig (or with no argument, if it takes none):

    make_model(cfg) -> nn.Module   forward(x, y) returns the mean loss over the rows of x, a
                                   0-dim tensor (as distlab's GPT does), or a (logits, loss)
                                   pair (nanoGPT's) or an output with .loss: the loop takes
                                   the loss from it
    make_data(cfg)  -> an object   global_batch(step, batch) -> (x, y): the step's `batch` rows,
                                   the same in every process (draw them from a generator seeded
                                   with the step); optional loss_floor and loss_at_start (floats,
                                   drawn on the loss plots)

`check(cfg)` builds both and runs one forward on the first rank's rows, so a typo, a wrong
return type or a shape error is reported before any rank starts, as the factory's own
exception, instead of as N identical failures from the ranks. launch() runs it in a process of
its own, with a time limit (distlab.caller.preflight.check_factory_apart).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import sys

import torch
from torch import nn

from distlab.data.dataset import MarkovData
from distlab.modules import name_matches

_SPEC = re.compile(r"^(?P<where>[^:]+):(?P<name>[A-Za-z_][A-Za-z0-9_]*)$")


def is_spec(value: str) -> bool:
    """True if `value` names a factory ("module:function"), not a built-in model."""
    return ":" in value


def parse(field: str, spec: str) -> tuple[str, str]:
    """(module path or file, function name); ValueError naming the expected form."""
    m = _SPEC.match(spec.strip())
    if not m:
        raise ValueError(f"{field}={spec!r} is not 'package.module:function' nor "
                         "'path/to/file.py:function'")
    return m["where"], m["name"]


def _import(field: str, where: str):
    if where.endswith(".py"):  # a file: loaded under a name of its own, once per process
        path = os.path.abspath(where)
        if not os.path.isfile(path):
            raise ValueError(f"{field}: no file {path}")
        name = "distlab_user_" + re.sub(r"\W", "_", path)
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # classes in it must be findable by name (pickling)
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
        return sys.modules[name]
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        raise ValueError(f"{field}: cannot import {where!r} ({e}); is its folder on sys.path "
                         "(the working directory, or pip install -e)?") from None


def load(field: str, spec: str):
    """The function `spec` names."""
    where, name = parse(field, spec)
    fn = getattr(_import(field, where), name, None)
    if not callable(fn):
        raise ValueError(f"{field}={spec!r}: {where} has no function {name!r}")
    return fn


def call(fn, cfg):
    """fn(cfg), or fn() for a factory that takes no argument."""
    takes = [p for p in inspect.signature(fn).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    return fn(cfg) if takes else fn()


def build_model(cfg) -> nn.Module:
    model = call(load("model", cfg.model), cfg)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={cfg.model!r} returned {type(model).__name__}, not an "
                         "nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"model={cfg.model!r}: the module has no trainable parameters")
    _check_target_parameter(cfg, model)
    if not getattr(model, "_distlab_loss_hook", False):  # a factory may return one model twice
        model.register_forward_hook(_the_loss)
        model._distlab_loss_hook = True
    return model


# forward parameters that are not targets, where models put them second (HF, torchtitan, ...)
_NOT_TARGETS = ("past_key_values", "attention_mask", "mask", "position_ids", "token_type_ids",
                "cache", "kv_cache", "start_pos", "input_pos", "freqs_cis", "inputs_embeds")


def _check_target_parameter(cfg, model: nn.Module) -> None:
    """The loop calls model(x, y). A forward whose second parameter is something else (HF's
    `past_key_values`) would take the targets for it and fail deep inside the model."""
    params = [p for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) >= 2 and params[1].name in _NOT_TARGETS:
        raise ValueError(
            f"model={cfg.model!r}: distlab calls forward(x, y) with the targets second, and "
            f"{type(model).__name__}.forward's second parameter is {params[1].name!r} (it "
            f"takes its targets by keyword, as Hugging Face models take labels=): have "
            f"make_model return a small nn.Module whose forward(x, y) calls it and returns the "
            f"mean loss (docs/library.md, 'Your model in the training loop')")


def _the_loss(module, args, output):
    """What the loop needs from forward(x, y): the mean loss. nanoGPT returns (logits, loss),
    Hugging Face an output with .loss; either is accepted and reduced to its loss."""
    if torch.is_tensor(output):
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, (tuple, list)):
        loss = next((t for t in output if torch.is_tensor(t) and t.dim() == 0
                     and t.is_floating_point()), None)
    return loss if loss is not None else output


class FactoryData:
    """The user's data, with what distlab's loop asks of a dataset: each rank's rows of the
    step's global batch (a contiguous block, MarkovData.rank_batch)."""

    def __init__(self, source, spec: str):
        if not callable(getattr(source, "global_batch", None)):
            raise ValueError(f"data={spec!r} returned {type(source).__name__}, which has no "
                             "global_batch(step, batch) method")
        self.source, self.spec = source, spec
        self.loss_floor = getattr(source, "loss_floor", None)
        self.loss_at_start = getattr(source, "loss_at_start", None)

    def global_batch(self, step: int, batch: int):
        out = self.source.global_batch(step, batch)
        if (not isinstance(out, (tuple, list)) or len(out) != 2
                or not all(torch.is_tensor(t) and len(t) == batch for t in out)):
            raise ValueError(f"data={self.spec!r}: global_batch(step, {batch}) must return "
                             f"(x, y), two tensors of {batch} rows")
        return tuple(out)

    rank_batch = MarkovData.rank_batch  # the same disjoint blocks of the global batch


def build_data(cfg) -> FactoryData:
    return FactoryData(call(load("data", cfg.data), cfg), cfg.data)


def check(cfg) -> None:
    """Build the model and data of `cfg` here and run one forward on rank 0's rows: ValueError
    (or the factory's own exception) before any process starts."""
    model, data = build_model(cfg), build_data(cfg)
    if cfg.strategy == "tp":
        _check_tp_plan(cfg, model)
    x, y = data.rank_batch(0, cfg.global_batch, 0, cfg.dp_degree)
    with torch.no_grad():
        loss = model(x[:max(1, cfg.micro_batch)], y[:max(1, cfg.micro_batch)])
    if not (torch.is_tensor(loss) and loss.dim() == 0 and loss.is_floating_point()):
        got = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
        raise ValueError(f"model={cfg.model!r}: forward(x, y) must return the mean loss, a "
                         f"0-dim float tensor (or a (logits, loss) pair, or an output with "
                         f".loss); got {got}: compute the loss from the targets y in forward "
                         f"and return it")


def _check_tp_plan(cfg, model) -> None:
    """strategy="tp" splits your model by the plan it carries: `model.tp_plan`, a dict of
    module-name patterns to distlab.ColwiseParallel() / RowwiseParallel() / SequenceParallel(),
    what distlab.parallelize_module takes. Each pattern must name a module."""
    plan = getattr(model, "tp_plan", None)
    if not isinstance(plan, dict) or not plan:
        raise ValueError(f"model={cfg.model!r} under strategy='tp': the model needs a tp_plan "
                         "attribute, {'module name pattern': distlab.ColwiseParallel() or "
                         "RowwiseParallel() or SequenceParallel()}, as distlab.parallelize_module "
                         "takes it")
    names = [n for n, _ in model.named_modules() if n]
    for pattern in plan:
        if not any(name_matches(n, pattern) for n in names):
            raise ValueError(f"model={cfg.model!r}: tp_plan key {pattern!r} names no module "
                             f"(its modules: {', '.join(names[:12])}"
                             f"{', ...' if len(names) > 12 else ''})")
