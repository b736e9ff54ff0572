"""What a GPU adds, measured on the GPU: step time by precision, FLOP/s and MFU, CUDA memory,
and which backend can carry several ranks on one GPU.

Nothing here is run without CUDA except on request (`device="cpu"`, to exercise the code):
every figure these functions return comes from the machine they ran on.

    time_training(cfg, device, ...)   step times, tokens/s, FLOP/s, torch's peak CUDA bytes
    amp_timings(cfg, device, ...)     fp32 with TF32 off and on, and bf16 autocast, in turn
    pick_gpt(free_bytes)              a GPT that fills most of a GPU's free memory
    probe_collectives(backend)        two ranks on one GPU: which collectives work

The FLOPs per token and the datasheet peaks are distlab.theory.flops's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue as queue_mod
import shutil
import statistics
import tempfile
import time
from datetime import timedelta

import torch

from distlab.theory.flops import datasheet_peak, train_flops_per_token

# -- timing a training step ------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_training(cfg, device, steps: int = 10, warmup: int = 3) -> dict:
    """Train `cfg`'s GPT with the library's model, optimizer and autocast (distlab.rank.train) on
    `device` for warmup + steps steps of random tokens made on the device (the data costs no
    time), and return what was measured: median step seconds, tokens/s, model FLOP/s, and on
    CUDA torch's peak allocated bytes over the timed steps."""
    from distlab.rank.build import build_model, build_optimizer
    from distlab.rank.precision import autocast
    device = torch.device(device)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg).to(device)
    opt = build_optimizer(cfg, model.parameters())
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    rows = cfg.global_batch
    times = []
    try:
        for i in range(warmup + steps):
            idx = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len + 1), device=device,
                                generator=gen)
            if i == warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            t0 = time.perf_counter()
            with autocast(cfg, device):
                loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        final_loss = loss.item()
    finally:
        del model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    step_s = statistics.median(times)
    tokens = rows * cfg.seq_len
    flops = train_flops_per_token(cfg) * tokens / step_s
    return {"precision": cfg.precision, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "flops_per_s": flops, "peak_bytes": peak, "tokens_per_step": tokens,
            "loss": final_loss, "steps": steps, "step_samples": times}


@contextlib.contextmanager
def tf32(enabled: bool):
    """TF32 for fp32 matmuls and convolutions on or off inside the block (torch's two
    switches), restored after. TF32 keeps fp32's range with a 10-bit mantissa, so "fp32" on an
    Ampere-or-later GPU means two speeds; the AMP speed-up depends on which."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


# the three ways amp_timings times: name -> (precision, TF32 on)
AMP_SETTINGS = {"fp32, TF32 off": ("fp32", False), "fp32, TF32 on": ("fp32", True),
                "bf16 autocast": ("bf16", False)}


def amp_timings(cfg, device, steps: int = 8, warmup: int = 2) -> dict:
    """time_training for each of AMP_SETTINGS in turn (same model, seed and tokens), TF32 set
    for each and restored after: {name: result}."""
    out = {}
    for name, (precision, on) in AMP_SETTINGS.items():
        with tf32(on):
            out[name] = time_training(cfg.replace(precision=precision), device, steps=steps,
                                      warmup=warmup)
    return out


def mfu(result: dict, device) -> tuple[float | None, str]:
    """(MFU, where the peak comes from) for a time_training result; (None, why) where no
    datasheet peak is known."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, "n/a (no datasheet peak for this CPU)"
    name = torch.cuda.get_device_name(device)
    peak = datasheet_peak(name, result["precision"])
    if peak is None:
        return None, f"n/a (no datasheet peak for {name})"
    return result["flops_per_s"] / peak[0], f"{name}: {peak[0] / 1e12:g} TFLOP/s, {peak[1]}"


def gpt_bytes_fp32(cfg) -> int:
    """distlab.theory.estimate's fp32 model states (params, grads, AdamW) and activations for cfg."""
    from distlab.theory.estimate import gpt_activation_bytes, run_model_state_bytes
    states = run_model_state_bytes(cfg.replace(precision="fp32"))
    return sum(states.values()) + gpt_activation_bytes(cfg.replace(precision="fp32"))


def pick_gpt(free_bytes: int, fraction: float = 0.55, n_embd: int = 2048, n_head: int = 16,
             seq_len: int = 1024, vocab_size: int = 32768):
    """The largest GPT (layers first, then rows per step) of width n_embd whose fp32 estimate
    (gpt_bytes_fp32) fits in `fraction` of free_bytes; the rest is the slack for the
    allocator, cuBLAS workspaces and kernels' temporaries. None if not even 1 layer x 1 row
    fits."""
    from distlab.config import RunConfig
    base = RunConfig(strategy="single", n_embd=n_embd, n_head=n_head, seq_len=seq_len,
                     vocab_size=vocab_size, global_batch=1, n_layer=1, steps=1,
                     successors=3)
    for layers in (24, 16, 12, 8, 4, 2, 1):
        for rows in (16, 8, 4, 2, 1):
            cfg = base.replace(n_layer=layers, global_batch=rows)
            if gpt_bytes_fp32(cfg) <= fraction * free_bytes:
                return cfg
    return None


# -- several ranks on one GPU: which backend carries which collective --------------------------
PROBE_OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "send/recv")


def _probe_rank(rank: int, world: int, backend: str, store_path: str, gpu: int, timeout_s: float,
                results) -> None:
    import torch.distributed as dist
    try:
        torch.cuda.set_device(gpu)
        dev = torch.device("cuda", gpu)
        timeout = timedelta(seconds=timeout_s)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        results.put((rank, "init", f"{type(e).__name__}: {e}"))
        os._exit(0)
    results.put((rank, "init", "ok"))
    n = 8
    for op in PROBE_OPS:
        try:
            if op == "all_reduce":
                t = torch.full((n,), float(rank + 1), device=dev)
                dist.all_reduce(t)
                ok = torch.all(t == sum(range(1, world + 1))).item()
            elif op == "broadcast":
                t = torch.full((n,), float(rank + 1), device=dev)
                dist.broadcast(t, src=0)
                ok = torch.all(t == 1.0).item()
            elif op == "all_gather":
                t = torch.full((n,), float(rank), device=dev)
                out = torch.empty(world * n, device=dev)
                dist.all_gather_into_tensor(out, t)
                ok = torch.equal(out.cpu(), torch.arange(world).repeat_interleave(n).float())
            elif op == "reduce_scatter":
                t = torch.ones(world * n, device=dev)
                out = torch.empty(n, device=dev)
                dist.reduce_scatter_tensor(out, t)
                ok = torch.all(out == world).item()
            else:  # send/recv: rank 0 to rank 1
                t = torch.full((n,), 7.0, device=dev) if rank == 0 else torch.zeros(n, device=dev)
                if rank == 0:
                    dist.send(t, dst=1)
                elif rank == 1:
                    dist.recv(t, src=0)
                ok = rank > 1 or torch.all(t == 7.0).item()
            torch.cuda.synchronize(dev)
            results.put((rank, op, "ok" if ok else "wrong result"))
        except Exception as e:  # noqa: BLE001 - reported, not raised
            results.put((rank, op, f"{type(e).__name__}: {e}".strip()[:400]))
            if isinstance(e, getattr(dist, "DistBackendError", ())):
                break  # the communicator is broken: later ops would only hang
    os._exit(0)  # no teardown: a broken NCCL communicator can hang in destroy


def probe_collectives(backend: str, world: int = 2, gpu: int = 0,
                      timeout_s: float = 30.0) -> dict:
    """Start `world` processes on CUDA device `gpu` with `backend` and try each of PROBE_OPS
    on CUDA tensors. Returns {"init": ..., op: ...}, each "ok", "wrong result", the error torch
    raised (from rank 0, or the first rank that reported one), or "not reached (...)" when a
    rank died or the probe timed out. Needs CUDA."""
    import torch.multiprocessing as mp
    if not torch.cuda.is_available():
        raise RuntimeError("probe_collectives needs a CUDA GPU")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # A FileStore: no listening socket (a TCPStore server listens on every interface)
    folder = tempfile.mkdtemp(prefix="distlab-probe-")
    procs = [ctx.Process(target=_probe_rank, daemon=True,
                         args=(r, world, backend, os.path.join(folder, "store"), gpu,
                               timeout_s, results))
             for r in range(world)]
    for p in procs:
        p.start()
    seen: dict[str, dict[int, str]] = {}
    deadline = time.monotonic() + timeout_s * (len(PROBE_OPS) + 2)
    expected = world * (len(PROBE_OPS) + 1)
    while sum(len(v) for v in seen.values()) < expected and time.monotonic() < deadline:
        try:
            rank, op, res = results.get(timeout=1.0)
            seen.setdefault(op, {})[rank] = res
        except queue_mod.Empty:
            if not any(p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    out = {}
    for op in ("init",) + PROBE_OPS:
        got = seen.get(op, {})
        if len(got) < world:
            out[op] = (f"not reached (ranks reported {sorted(got)}; exit codes {codes})"
                       if not any(v != "ok" for v in got.values()) else
                       next(v for v in got.values() if v != "ok"))
        else:
            bad = [got[r] for r in sorted(got) if got[r] != "ok"]
            out[op] = bad[0] if bad else "ok"
    shutil.rmtree(folder, ignore_errors=True)
    return out


@dataclasses.dataclass
class Placement:
    """Which backend runs several ranks on one GPU, and what the probes found."""
    backend: str | None
    probes: dict

    def works(self, op: str) -> bool:
        return self.backend is not None and self.probes[self.backend].get(op) == "ok"


def shared_gpu_backend(world: int = 2) -> Placement:
    """Try NCCL with `world` ranks on GPU 0; if torch refuses (NCCL does: "Duplicate GPU
    detected"), gloo with CUDA tensors. backend: the first whose init and all-reduce work."""
    probes, chosen = {}, None
    for backend in ("nccl", "gloo"):
        probes[backend] = probe_collectives(backend, world)
        if chosen is None and probes[backend]["init"] == "ok" and \
                probes[backend]["all_reduce"] == "ok":
            chosen = backend
    return Placement(chosen, probes)


def where_am_i(rank: int, world: int, device: torch.device, log) -> dict:
    """A rank function for distlab.run_ranks: the device and backend the launcher gave it."""
    import torch.distributed as dist
    return {"device": str(device), "backend": dist.get_backend()}
