"""fully_shard's flat units beside its per-parameter shards, and torch's FSDP2: what each moves,
copies, holds and takes per step, on the same GPT, batches and AdamW.

    flat       distlab.fully_shard(model): the ZeRO paper's padded flat units (FSDP1's)
    per_param  distlab.fully_shard(model, layout="per_param"): FSDP2's DTensor dim-0 shards
    FSDP2      torch.distributed.fsdp.fully_shard on the same units (a unit of several modules
               as one list), then on the root

Each is a torch AdamW built over model.parameters() after sharding (FSDP2's habit), no
between-steps prefetch (FSDP2 leaves that to its user). One launch builds all three on every
rank; the repeats run them in turn, alternating the order (A B C, C B A, ...; after `warmup`
steps each), so drift in the machine's load falls on all three alike. Per way:

* **collectives per step, and their bytes**: counted at the dispatcher (a TorchDispatchMode
  sees every c10d op, ours and FSDP2's alike) in one extra step per repeat: all-gathers and
  reduce-scatters, and (N-1)/N of each one's full buffer (the ring's bytes, padding included:
  distlab.comm's convention), beside distlab.theory.fsdp_layouts' formula;
* **bytes written**: the kernel's per-process write counter (distlab.wire) across each timed
  step: what gloo put on the wire, headers included (FSDP2's too);
* **copy-in / copy-out seconds**: the same extra step times the ops that copy into and out of
  the collectives' buffers (aten's _foreach_copy_, split_with_sizes_copy and _chunk_cat, and
  FSDP2's fsdp:: ops that wrap them); per_param's own timers also add them up in every timed
  step (PerParamShard.copy_s, with the wrapping of gradient shards as DTensors);
* **peak memory**: distlab.memory.PeakMemoryTracker over one more step: the peak of bytes aten
  allocated. It misses storages resized in place, which is how all three hold gathered
  parameters (FSDP2's all-gather output is a fresh allocation and is counted); so for ours the
  layout's own count of gathered-parameter bytes at their peak is given beside it;
* **step and optimizer seconds**: each timed step between two barriers (rank 0's clock), the
  optimizer's step() alone; per repeat the median over its steps, then the median and the
  range over repeats.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from distlab import wire
from distlab.config import RunConfig
from distlab.data.dataset import make_data
from distlab.memory import PeakMemoryTracker
from distlab.models import GPT, GPTConfig
from distlab.parallel.zero.fsdp import find_units, fully_shard
from distlab.theory import fsdp_layouts

WAYS = ("flat", "per_param", "FSDP2")
COPY_OPS = ("aten::_foreach_copy_", "aten::split_with_sizes_copy", "aten::_chunk_cat",
            "fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy", "fsdp::chunk_cat")
GATHER_OPS = ("c10d::_allgather_base_", "c10d::allgather_into_tensor_coalesced_")
SCATTER_OPS = ("c10d::_reduce_scatter_base_", "c10d::reduce_scatter_tensor_coalesced_")


class Dispatched(TorchDispatchMode):
    """Counts the collectives and times the copy ops that pass the dispatcher while active."""

    def __init__(self, world: int):
        super().__init__()
        self.world = world
        self.gathers = self.scatters = 0
        self.gather_bytes = self.scatter_bytes = 0.0
        self.copy_s = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        if name in COPY_OPS:
            self.copy_s += time.perf_counter() - t0
        elif name in GATHER_OPS or name in SCATTER_OPS:
            # the larger buffer: all-gather's output, reduce-scatter's input (padding included)
            full = max(t.numel() * t.element_size() for t in args[:2] if torch.is_tensor(t))
            share = (self.world - 1) / self.world * full
            if name in GATHER_OPS:
                self.gathers, self.gather_bytes = self.gathers + 1, self.gather_bytes + share
            else:
                self.scatters, self.scatter_bytes = self.scatters + 1, self.scatter_bytes + share
        return out


def gpt(cfg: RunConfig) -> torch.nn.Module:
    torch.manual_seed(cfg.seed)
    return GPT(GPTConfig.from_run(cfg))


def unit_shapes(model: torch.nn.Module) -> list[list[tuple]]:
    """The parameters' shapes of each unit of find_units' cut (what fully_shard shards)."""
    return [[tuple(p.shape) for p in dict.fromkeys(q for m in modules for q in m.parameters())]
            for _, modules in find_units(model)]


def build(way: str, cfg: RunConfig, world: int):
    """The model sharded `way`, and AdamW over its parameters."""
    model = gpt(cfg)
    if way == "FSDP2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for _, modules in find_units(model):
            torch_fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh)
        torch_fully_shard(model, mesh=mesh)
    else:
        fully_shard(model, layout=way)
    return model, torch.optim.AdamW(model.parameters(), lr=cfg.lr)


def _step(model, opt, x, y) -> tuple[float, float]:
    """One training step: (its loss, the optimizer step's seconds)."""
    loss = model(x, y)
    loss.backward()
    t0 = time.perf_counter()
    opt.step()
    opt_s = time.perf_counter() - t0
    opt.zero_grad()
    return loss.item(), opt_s


def layouts_rank(rank, world, device, log, cfg_dict: dict, steps: int, repeats: int,
                 warmup: int) -> dict:
    """Rank function: every way built, then `repeats` rounds of each way's steps (see the
    module docstring); this rank's figures per way."""
    cfg = RunConfig.from_dict(cfg_dict)
    data = make_data(cfg)
    built = {w: build(w, cfg, world) for w in WAYS}
    out = {w: {"step_s": [], "opt_s": [], "written": [], "own_copy_s": [], "losses": [],
               "dispatched": [], "peak": [], "gathered_peak": []} for w in WAYS}
    batch = dict.fromkeys(WAYS, 0)  # each way reads the same sequence of batches

    def next_batch(w):
        x, y = data.rank_batch(batch[w], cfg.global_batch, rank, world)
        batch[w] += 1
        return x, y

    for rep in range(repeats):
        for w in (WAYS if rep % 2 == 0 else WAYS[::-1]):
            model, opt = built[w]
            fsdp = getattr(model, "_distlab_fsdp", None)
            for _ in range(warmup if rep == 0 else 0):
                _step(model, opt, *next_batch(w))
            r = out[w]
            for s in range(steps):
                x, y = next_batch(w)
                dist.barrier()
                before, t0 = wire.sent(), time.perf_counter()
                loss, opt_s = _step(model, opt, x, y)
                dist.barrier()
                r["step_s"].append(time.perf_counter() - t0)
                r["written"].append(wire.sent() - before)
                r["opt_s"].append(opt_s)
                r["losses"].append(loss)
                if hasattr(fsdp, "take_copy_seconds"):
                    r["own_copy_s"].append(sum(fsdp.take_copy_seconds().values()))
            with Dispatched(world) as counted:
                _step(model, opt, *next_batch(w))
            r["dispatched"].append({k: getattr(counted, k) for k in (
                "gathers", "scatters", "gather_bytes", "scatter_bytes", "copy_s")})
            r["peak"].append(_peak_step(model, opt, *next_batch(w)))
            r["gathered_peak"].append(fsdp.peak["params"] if fsdp is not None else None)
            if hasattr(fsdp, "take_copy_seconds"):
                fsdp.take_copy_seconds()  # the untimed steps' copies are not the timed ones'
    return out


def _peak_step(model, opt, x, y) -> int:
    """One step under PeakMemoryTracker: the peak of bytes aten allocated in it (ours also
    restart their count of gathered-parameter bytes, fsdp.peak)."""
    fsdp = getattr(model, "_distlab_fsdp", None)
    if fsdp is not None:
        fsdp.peak = dict(fsdp.live)
    tracker = PeakMemoryTracker()
    tracker.adopt([*model.parameters(), *model.buffers()])
    tracker.step_begin(x, y)
    _step(model, opt, x, y)
    return tracker.step_end()


def _median_and_range(values: list[float], repeats: int) -> dict:
    """Per repeat the median of its values, then their median, min and max."""
    k = len(values) // repeats
    per = [statistics.median(values[i * k:(i + 1) * k]) for i in range(repeats)]
    return {"median": statistics.median(per), "min": min(per), "max": max(per)}


def compare(world: int = 4, steps: int = 6, repeats: int = 3, warmup: int = 2,
            timeout_s: float = 300, **model) -> dict:
    """Run the three ways on `world` ranks (one launch) and summarise them. `model`: RunConfig
    fields of the GPT (n_layer, n_embd, n_head, vocab_size, seq_len, global_batch, lr, ...).
    Returns {"config", "world", "units", "formula": per layout, "ways": per way}."""
    from distlab.caller.launch import run_ranks
    cfg = RunConfig(**model)
    ranks = run_ranks(layouts_rank, world, cfg.to_dict(), steps, repeats, warmup,
                      timeout_s=timeout_s, threads=1)
    units = unit_shapes(gpt(cfg))
    formula = {layout: {"padded": fsdp_layouts.padded(units, world, layout),
                        "padding": fsdp_layouts.padding(units, world, layout),
                        **fsdp_layouts.step_bytes(units, world, layout)}
               for layout in fsdp_layouts.LAYOUTS}
    ways = {}
    for w in WAYS:
        r0 = ranks[0][w]
        counted = r0["dispatched"]
        ways[w] = {
            "all_gathers": counted[-1]["gathers"], "reduce_scatters": counted[-1]["scatters"],
            "gather_bytes": counted[-1]["gather_bytes"],
            "scatter_bytes": counted[-1]["scatter_bytes"],
            "same_every_repeat": all(c["gathers"] == counted[0]["gathers"]
                                     and c["gather_bytes"] == counted[0]["gather_bytes"]
                                     for c in counted),
            "written": statistics.median(r0["written"]),
            "copy_s": _median_and_range([c["copy_s"] for c in counted], repeats),
            "own_copy_s": (_median_and_range(r0["own_copy_s"], repeats) if r0["own_copy_s"]
                           else None),
            "step_s": _median_and_range(r0["step_s"], repeats),
            "opt_s": _median_and_range(r0["opt_s"], repeats),
            "peak": max(max(r[w]["peak"]) for r in ranks),
            "gathered_peak": (max(max(r[w]["gathered_peak"]) for r in ranks)
                              if r0["gathered_peak"][0] is not None else None),
            "losses": r0["losses"]}
    return {"config": model, "world": world, "units": units, "formula": formula, "ways": ways,
            "steps": steps, "repeats": repeats, "warmup": warmup}


# -- the figures as a table ------------------------------------------------------------------
HEADER = ["way", "all-gathers / reduce-scatters per step", "all-gather KB per step (counted)",
          "formula KB (padding entries)", "written KB per step (kernel)",
          "copy kernels ms per step", "per_param's copying code ms per step",
          "step ms: median [range over repeats]", "optimizer step ms", "aten peak KB",
          "gathered-parameter peak KB"]


def _ms(d: dict | None) -> str:
    """Seconds' median [min-max] in ms."""
    if d is None:
        return "-"
    return f"{d['median'] * 1e3:.2f} [{d['min'] * 1e3:.2f}-{d['max'] * 1e3:.2f}]"


def table_rows(result: dict) -> list[list[str]]:
    """One row per way (HEADER's columns); FSDP2's formula is the per_param layout's (the same
    dim-0 chunks)."""
    rows = []
    for w, r in result["ways"].items():
        f = result["formula"]["flat" if w == "flat" else "per_param"]
        rows.append([w, f"{r['all_gathers']} / {r['reduce_scatters']}",
                     f"{r['gather_bytes'] / 1e3:.1f}",
                     f"{f['all_gather'] / 1e3:.1f} ({f['padding']:,})",
                     f"{r['written'] / 1e3:.1f}", _ms(r["copy_s"]), _ms(r["own_copy_s"]),
                     _ms(r["step_s"]), _ms(r["opt_s"]), f"{r['peak'] / 1e3:.1f}",
                     "-" if r["gathered_peak"] is None else f"{r['gathered_peak'] / 1e3:.1f}"])
    return rows


def loss_gap(result: dict) -> float:
    """The largest gap between the ways' losses, step by step (they train the same steps)."""
    losses = [r["losses"] for r in result["ways"].values()]
    return max(abs(a - b) for run in losses[1:] for a, b in zip(run, losses[0]))
