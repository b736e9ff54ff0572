"""The one training loop. Every strategy plugs into it; none copies it.

    for step in range(steps):
        x, y  = this rank's part of the step's global batch
        loss  = model(x, y)                  (under autocast for bf16/fp16)
        strategy.reduce_gradients(model)     (DP: average gradients across ranks)
        strategy.optimizer_step(optimizer)
        log one "step" event: loss, tokens, time, memory by category, bytes per collective
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import torch
import torch.distributed as dist

from .comm import Comm
from .config import RunConfig
from .data import make_data
from .memory import ActivationMeter, model_state_bytes
from .models import GPT, GPTConfig
from .parallel import make_strategy

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def build_optimizer(cfg: RunConfig, params):
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def autocast(cfg: RunConfig, device: torch.device):
    if cfg.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=_AUTOCAST_DTYPES[cfg.precision])


def inject_fault(cfg: RunConfig, rank: int, step: int, log):
    """The fault drills: one rank misbehaves at one step, as real ranks do."""
    if cfg.fault == "none" or rank != cfg.fault_rank or step != cfg.fault_step:
        return
    log.write("fault", fault=cfg.fault, step=step)
    if cfg.fault == "raise":
        raise RuntimeError(f"injected fault: rank {rank} raised at step {step}")
    if cfg.fault == "stall":  # alive but never joins another collective, like a hung rank
        while True:
            time.sleep(1.0)
    if cfg.fault == "kill":  # dies without a word, like an OOM-killed or preempted process
        os.kill(os.getpid(), signal.SIGKILL)


def build_model(cfg: RunConfig) -> torch.nn.Module:
    if cfg.model == "bnnet":
        from .models.bnnet import build_bnnet
        return build_bnnet(cfg)
    return GPT(GPTConfig.from_run(cfg))


def train(cfg: RunConfig, rank: int, world: int, device: torch.device, log,
          keep: dict | None = None) -> dict:
    """Train `cfg` on this rank. Needs an initialised process group (launch() makes one).
    If `keep` is a dict, the trained model is left in keep["model"]."""
    torch.manual_seed(cfg.seed)  # same init on every rank; strategies also broadcast it
    comm = Comm()
    model = build_model(cfg).to(device)
    strategy = make_strategy(cfg, comm)
    strategy.log = log
    model = strategy.wrap(model)
    optimizer = strategy.build_optimizer(model, lambda params: build_optimizer(cfg, params))
    data = make_data(cfg)
    meter = ActivationMeter(model)
    comm.take_step_stats()  # setup traffic (the initial broadcast) is not a step's
    on_cuda = device.type == "cuda"
    log.write("start", n_params=sum(p.numel() for p in model.parameters()),
              loss_floor=data.loss_floor, loss_at_start=data.loss_at_start,
              device=str(device), backend=dist.get_backend(), world_size=world,
              threads=torch.get_num_threads(), pid=os.getpid(),
              role="server" if strategy.is_server() else "worker")
    if strategy.is_server():  # a parameter server: it applies updates, it does not train
        strategy.serve(model, optimizer)
        if keep is not None:
            keep.update(model=model, losses=[], comm=[])
        return {"final_loss": None}

    losses, comm_per_step = [], []
    for step in range(cfg.steps):
        inject_fault(cfg, rank, step, log)
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr_at(step)
        batch = strategy.batch(data, step)
        if batch is None:  # this rank has no rows left (a finite dataset)
            if strategy.out_of_data(model, step):
                continue
            break
        x_all, y_all = batch
        loss_sum = 0.0
        micro_batches = list(zip(x_all.chunk(cfg.grad_accum), y_all.chunk(cfg.grad_accum)))
        for micro, (x, y) in enumerate(micro_batches):
            # a short last batch of a finite dataset may split into fewer micro-batches
            last = micro == len(micro_batches) - 1
            x, y = x.to(device), y.to(device)
            with (contextlib.nullcontext() if last else strategy.no_sync(model)):
                with meter.measure(), autocast(cfg, device):
                    # each micro-batch's mean loss, scaled so the accumulated gradient is the
                    # gradient of the mean over all of this rank's rows
                    loss = model(x, y) / cfg.grad_accum
                loss.backward()
            loss_sum += loss.item()
        if rank == cfg.straggler_rank:
            time.sleep(cfg.straggler_delay_s)  # a slow rank: everyone else waits at the sync
        strategy.reduce_gradients(model)
        strategy.optimizer_step(optimizer)
        if on_cuda:
            torch.cuda.synchronize(device)
        step_s = time.perf_counter() - t0
        comm_stats, comm_buffer = comm.take_step_stats()
        memory = {**model_state_bytes(model, optimizer), "activations": meter.bytes,
                  "comm_buffers": comm_buffer}
        if on_cuda:
            memory["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device)
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum)
        comm_per_step.append(comm_stats)
        log.write("step", step=step, loss=loss_sum, tokens=y_all.numel(), step_s=step_s,
                  lr=cfg.lr_at(step), memory=memory, comm=comm_stats, **strategy.step_info())
        if cfg.step_delay_s:
            time.sleep(cfg.step_delay_s)
    if keep is not None:
        keep.update(model=model, losses=losses, comm=comm_per_step)
    return {"final_loss": losses[-1] if losses else None}


def train_rank(rank: int, world: int, device: torch.device, log, cfg_dict: dict) -> dict:
    """Entry point the launcher calls in each rank (configs travel as plain dicts)."""
    return train(RunConfig.from_dict(cfg_dict), rank, world, device, log)


def train_with_state(rank: int, world: int, device: torch.device, log, cfg_dicts: list):
    """Train each config in turn in one launch (launches cost seconds; tests and notebooks
    compare several at once) and return, per config, this rank's per-step losses, per-step
    collective stats and final parameters: what the equivalence checks compare against
    `single`, parameter by parameter."""
    out = []
    for d in cfg_dicts:
        keep = {}
        train(RunConfig.from_dict(d), rank, world, device, log, keep=keep)
        state = {k: v.detach().cpu().clone() for k, v in keep["model"].state_dict().items()}
        out.append({"losses": keep["losses"], "comm": keep["comm"], "state": state})
    return out
