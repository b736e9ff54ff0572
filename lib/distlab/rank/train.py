"""The one training loop. Every strategy plugs into it; none copies it.

    model, optimizer = built once (distlab.rank.build), wrapped by the strategy (parallel/)
    start = steps done in the checkpoint resumed from (distlab.checkpoint), else 0
    for step in range(start, steps):
        faults.before_step                   a fault on purpose (distlab.rank.faults)
        x, y  = this rank's part of the step's global batch (bugs.rows: a bug on purpose)
        loss  = model(x, y)                  (under autocast for bf16/fp16; meter.forward counts
                                             the activations it saves)
        (loss * scale).backward()            (dynamic loss scaling: fp16)
        faults.before_reduce                 a straggler on purpose
        strategy.reduce_gradients(model)     (DP: average gradients across ranks)
        unscale, check inf/NaN, clip, then strategy.optimizer_step(optimizer) or skip it
                                             (distlab.rank.precision.finish_step)
        log one "step" event: loss, tokens, and what the StepMeter measured (time, bytes per
                              collective, memory by category), loss scale and skipped, and
                              with diagnostics=True what the Probe measured (distlab.debug.probe)
        save a checkpoint if one is due; leave if the job got a preemption notice
        strategy.between_steps(model)        if a step follows (ZeRO-3: its first all-gathers)
"""

from __future__ import annotations

import contextlib
import gc
import os

import torch
import torch.distributed as dist

from distlab import wire
from distlab.checkpoint.checkpointer import Checkpointer
from distlab.comm import Comm
from distlab.config import RunConfig
from distlab.data.dataset import make_data
from distlab.debug.bugs import Bugs
from distlab.debug.nan import nan_detector
from distlab.debug.probe import Probe
from distlab.finetune.forgetting import FineTuning
from distlab.models import factory
from distlab.parallel import make_strategy
from distlab.rank.build import build_model, build_optimizer
from distlab.rank.faults import Faults
from distlab.models.moe import MoE, update_expert_bias
from distlab.rank.precision import apply_fp32_modules, autocast, finish_step, make_loss_scaler
from distlab.rank.step_meter import StepMeter


def collect_earlier_runs() -> None:
    """Free what an earlier run in this process left in reference cycles.

    An earlier run (train_with_state's configs, one after another in a rank) can hold its
    model in reference cycles (wrappers' hooks and units) until the collector runs; on a GPU
    that memory would be counted in this run's (an H200, 2026-11-26: ZeRO-Offload's saving
    hidden by the previous run's 97.7 MiB). A full collection walks every object Python
    tracks, torch's millions included: 150 ms a call on this CPU, most of a short config's
    cost. So the first call freezes what is alive then (the imports; no run has started in
    this process) and later calls walk only what was made since."""
    if gc.get_freeze_count():
        gc.collect()
    else:
        gc.freeze()


def train(cfg: RunConfig, rank: int, world: int, device: torch.device, log,
          keep: dict | None = None) -> dict:
    """Train `cfg` on this rank. Needs an initialised process group (launch() makes one).
    If `keep` is a dict, the trained model is left in keep["model"].

    Every collaborator is an object, whether its feature is on or off: off, it does what
    correct code without the feature does (NoLossScaling scales by 1, NoCheckpoints restores
    step 0, NoNanCheck checks nothing, Bugs with bug="none" changes nothing), so the loop
    below has no branch on a feature's being on."""
    if cfg.processes != world:  # the batch split and the mesh were checked for world_size
        raise ValueError(f"RunConfig(strategy={cfg.strategy!r}, world_size={cfg.world_size}) "
                         f"runs in {cfg.processes} processes but this launch has {world}: set "
                         f"world_size to match (launch(cfg) starts cfg.processes)")
    collect_earlier_runs()
    torch.manual_seed(cfg.seed)  # same init on every rank; strategies also broadcast it
    comm = Comm()
    model = build_model(cfg).to(device)
    bugs = Bugs(cfg, rank, world)  # a training bug on purpose (RunConfig.bug; "none": correct)
    bugs.initialise(model)
    if cfg.fp32_modules:  # fp32 islands under autocast, by name (before wrapping adds prefixes)
        apply_fp32_modules(model, cfg.fp32_modules)
    detector = nan_detector(cfg, model, log)  # names the first module to make inf/NaN
    finetune = FineTuning(cfg, model, device)  # eval on both tasks, replay, EWC, save_final
    strategy = make_strategy(cfg, comm)
    strategy.log = log
    wire.LEDGER.books_all = strategy.books_all_traffic
    if keep is not None:
        keep["strategy"] = strategy
    model = strategy.wrap(model)
    optimizer = strategy.build_optimizer(model, lambda params: build_optimizer(cfg, params))
    scaler = make_loss_scaler(cfg, comm)
    data = finetune.data(factory.build_data(cfg) if cfg.data else make_data(cfg))
    meter = StepMeter(cfg, model, comm, device)  # time, bytes and memory of each step
    faults = Faults(cfg, rank, log)  # a failing rank, a straggler, a delay per step: on purpose
    probe = Probe(cfg)  # per-layer gradients and updates, batch fingerprints (diagnostics)
    comm.take_step_stats()  # setup traffic (the initial broadcast) is not a step's
    log.write("start", n_params=sum(p.numel() for p in model.parameters()),
              loss_floor=data.loss_floor, loss_at_start=data.loss_at_start,
              unigram_entropy=getattr(data, "unigram_entropy", None),
              device=str(device), backend=dist.get_backend(), world_size=world,
              threads=torch.get_num_threads(), pid=os.getpid(),
              role="server" if strategy.is_server() else "worker",
              peak_memory=meter.peak_label)
    # training checkpoints: resume_from loads here, checkpoint_every saves after steps
    ckpt = Checkpointer.for_run(cfg, rank, world, device, strategy, model, optimizer, scaler, log)
    start = ckpt.restore()
    if strategy.is_server():  # a parameter server: it applies updates, it does not train
        strategy.serve(model, optimizer)
        if keep is not None:
            keep.update(model=model, losses=[], comm=[])
        return {"final_loss": None}

    losses, comm_per_step = [], []
    moes = [m for m in model.modules() if isinstance(m, MoE)]  # this rank's (a stage's)
    finetune.evaluate(model, start, log, comm)  # before the first step (0, or a resumed one)
    for step in range(start, cfg.steps):
        faults.before_step(step, model)
        detector.step = step
        meter.start()
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr_at(step)
        batch = bugs.rows(strategy.batch(data, step), data, step)
        if batch is None:  # this rank has no rows left (a finite dataset)
            if strategy.out_of_data(model, step):
                continue
            break
        x_all, y_all = batch
        meter.saw_batch(x_all, y_all)
        # a pipeline schedule owns the step's forward/backward (strategy.forward_backward)
        owned = strategy.forward_backward(
            model, x_all.to(device), y_all.to(device),
            scaler.scale)
        loss_sum = 0.0 if owned is NotImplemented else owned
        micro_batches = ([] if owned is not NotImplemented else
                         list(zip(x_all.chunk(cfg.grad_accum), y_all.chunk(cfg.grad_accum))))
        for micro, (x, y) in enumerate(micro_batches):
            # a short last batch of a finite dataset may split into fewer micro-batches
            last = micro == len(micro_batches) - 1
            x, y = x.to(device), y.to(device)
            with (contextlib.nullcontext() if last else strategy.no_sync(model)):
                with meter.forward(), autocast(cfg, device):
                    # each micro-batch's mean loss, scaled so the accumulated gradient is the
                    # gradient of the mean over all of this rank's rows
                    loss = model(x, y) / bugs.loss_divisor  # cfg.grad_accum, unless a bug
                scaler.scale(loss).backward()
                detector.check_gradients(model)
            loss_sum += loss.item()
        faults.before_reduce()
        strategy.reduce_gradients(model)
        finetune.after_reduce()  # EWC's penalty gradient, the same on every rank
        probe.before_update(model, x_all)
        precision = finish_step(strategy, model, optimizer, scaler, cfg.grad_clip)
        update_expert_bias(moes, strategy.routing_comms())  # auxiliary-loss-free balance
        measured = meter.end(strategy, model, optimizer)  # step_s, comm, memory
        diagnosed = probe.after_update(model)
        if bugs.zero_grad:  # forgetting this is a bug (bug="no_zero_grad")
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum)
        comm_per_step.append(measured["comm"])
        reader = getattr(strategy, "reader", None)  # a finite dataset's: its sample ids
        log.write("step", step=step, loss=loss_sum, tokens=y_all.numel(), lr=cfg.lr_at(step),
                  **({"rows": reader.rows(step)} if reader is not None else {}),
                  **measured, **precision, **strategy.step_info(), **diagnosed)
        finetune.evaluate(model, step + 1, log, comm)
        if ckpt.after_step(step):
            break  # preempted: every rank saved, now they leave together
        faults.after_step()
        if step + 1 < cfg.steps:
            meter.between()  # what between_steps books is the next step's
            strategy.between_steps(model)
    finetune.finish(strategy, model, comm)
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
        state = {k: v.detach().cpu().clone()
                 for k, v in keep["strategy"].full_state_dict(keep["model"]).items()}
        out.append({"losses": keep["losses"], "comm": keep["comm"], "state": state})
    return out
