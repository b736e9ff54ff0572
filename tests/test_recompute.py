"""Activation checkpointing (distlab.rank.recompute): same loss and gradients, fewer bytes kept.

Tolerance: none. Recomputation reruns the same CPU kernels on the same inputs (our GPT has no
dropout, so no random state is involved), so the recomputed activations, and every gradient
computed from them, are bitwise equal to the ones a plain forward saves; selective
checkpointing serves the matmul outputs from its cache, which are the very tensors. A
tolerance would only hide a recomputation that differs (a wrong region, a missed input).

Bytes: ActivationMeter's count falls from none to selective to full, and equals
distlab.theory.estimate.gpt_activation_bytes in every mode; the peak tracker's per-step peak (which
includes the recomputation's transient tensors in backward) falls too.
The launched run (2 ranks) shows RunConfig.checkpointing applied inside train() for
`allreduce` and `ddp` (and `zero3`), with track_peak on for allreduce.
"""

import copy

import pytest
import torch

from distlab import Run, RunConfig, run_ranks
from distlab.rank.recompute import apply_checkpointing, checkpointing_of
from distlab.data.dataset import make_data
from distlab.theory.estimate import gpt_activation_bytes, run_model_state_bytes
from distlab.memory import ActivationMeter, PeakMemoryTracker
from distlab.models import GPT, GPTConfig
from distlab.rank.train import train_with_state
from distlab.rank.build import build_model

MODES = ("none", "selective", "full")
CFG = RunConfig(global_batch=8, seq_len=16, n_layer=2, n_embd=32, n_head=2, optimizer="sgd",
                lr=0.1, steps=4, timeout_s=60)


def _one_step(cfg):
    """Loss, gradients, activation bytes and peak of one forward/backward in this process."""
    torch.manual_seed(0)
    model = build_model(cfg)
    x, y = make_data(cfg).rank_batch(0, cfg.global_batch, 0, 1)
    meter, tracker = ActivationMeter(model), PeakMemoryTracker()
    tracker.adopt(model.parameters())
    tracker.step_begin(x, y)
    with meter.measure():
        loss = model(x, y)
    loss.backward()
    peak = tracker.step_end()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, meter.bytes, peak


@pytest.fixture(scope="module")
def single_process():
    return {m: _one_step(CFG.replace(checkpointing=m)) for m in MODES}


def test_loss_and_gradients_unchanged(single_process):
    loss0, grads0, _, _ = single_process["none"]
    for mode in ("selective", "full"):
        loss, grads, _, _ = single_process[mode]
        assert torch.equal(loss, loss0), mode
        assert grads.keys() == grads0.keys()
        for name, g in grads.items():
            assert torch.equal(g, grads0[name]), f"{mode}: {name}"


def test_activation_bytes_fall_and_match_the_estimate(single_process):
    act = {m: single_process[m][2] for m in MODES}
    assert act["none"] > act["selective"] > act["full"]
    for m in MODES:
        assert act[m] == gpt_activation_bytes(CFG, checkpointing=m), m
    # per layer, in s·b·h floats: 16 -> 10 -> 1 (r = 4; see distlab.rank.recompute)
    sbh4 = 4 * CFG.seq_len * CFG.micro_batch * CFG.n_embd
    per_layer = {m: gpt_activation_bytes(CFG, checkpointing=m, breakdown=True)[1]["per_layer"]
                 for m in MODES}
    assert per_layer["selective"] == 10 * sbh4 and per_layer["full"] == sbh4
    peak = {m: single_process[m][3] for m in MODES}
    assert peak["none"] > peak["selective"] > peak["full"]


def test_selective_recomputes_no_matmul():
    """Selective keeps every matmul output: backward runs only the backward matmuls (2 per
    Linear with a weight gradient and an input gradient), exactly as without checkpointing;
    full reruns the blocks' forward matmuls too."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.matmuls = self.sdpa = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            self.matmuls += name in ("aten.mm.default", "aten.addmm.default")
            self.sdpa += name.startswith("aten._scaled_dot_product") and "backward" not in name
            return func(*args, **(kwargs or {}))

    counts = {}
    for mode in MODES:
        torch.manual_seed(0)
        model = build_model(CFG.replace(checkpointing=mode))
        x, y = make_data(CFG).rank_batch(0, CFG.global_batch, 0, 1)
        loss = model(x, y)
        with Count() as c:
            loss.backward()
        counts[mode] = (c.matmuls, c.sdpa)
    assert counts["selective"][0] == counts["none"][0]
    assert counts["full"][0] > counts["none"][0]
    # the attention core is recomputed once per layer in both modes
    assert counts["none"][1] == 0 and counts["selective"][1] == counts["full"][1] == CFG.n_layer


def test_applied_by_name_from_outside():
    model = GPT(GPTConfig(n_layer=3, n_embd=32, n_head=2, block_size=16))
    keys = list(model.state_dict())
    assert apply_checkpointing(model, "full") == ["blocks.0", "blocks.1", "blocks.2"]
    assert checkpointing_of(model) == {f"blocks.{i}": "full" for i in range(3)}
    assert list(model.state_dict()) == keys  # names and state_dict keys unchanged
    apply_checkpointing(model, "selective")  # switching modes re-wraps nothing
    assert set(checkpointing_of(model).values()) == {"selective"}
    # a deep copy (dp's replicas) stays checkpointed, bound to the copy's own blocks
    twin = copy.deepcopy(model)
    assert twin.blocks[0].forward.__self__ is twin.blocks[0]
    assert twin.blocks[0]._distlab_inner_forward.__self__ is twin.blocks[0]
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():  # evaluation: no checkpoint, same output
        assert torch.equal(model(x), twin(x))
    apply_checkpointing(model, "none")
    assert checkpointing_of(model) == {} and "forward" not in vars(model.blocks[0])
    with pytest.raises(ValueError, match="no module"):
        apply_checkpointing(torch.nn.Linear(2, 2), "full")
    with pytest.raises(ValueError, match="checkpointing"):
        RunConfig(model="bnnet", checkpointing="full")


# -- one launch: RunConfig.checkpointing inside train() ---------------------------------------
LAUNCHED = {
    "allreduce none": CFG.replace(strategy="allreduce", world_size=2, track_peak=True),
    "allreduce selective": CFG.replace(strategy="allreduce", world_size=2, track_peak=True,
                                       checkpointing="selective"),
    "allreduce full": CFG.replace(strategy="allreduce", world_size=2, track_peak=True,
                                  checkpointing="full"),
    "ddp full adamw": CFG.replace(strategy="ddp", world_size=2, checkpointing="full",
                                  optimizer="adamw", lr=3e-3),
    # ZeRO-3 re-gathers the parameters a checkpointed block recomputes with; the meter must
    # still tell its freed-and-refilled parameter buffers from activations
    "zero3 selective": CFG.replace(strategy="zero3", world_size=2, checkpointing="selective"),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("checkpointing-runs"))
    out = run_ranks(train_with_state, 2, [c.to_dict() for c in LAUNCHED.values()],
                    run_dir=run_dir, timeout_s=60)
    # train_with_state trains the configs in turn; each restarts at step 0
    names, per_cfg, i = list(LAUNCHED), {n: {0: [], 1: []} for n in LAUNCHED}, {0: 0, 1: 0}
    for e in Run.load(run_dir).history("step"):
        r = e["rank"]
        if e["step"] == 0 and per_cfg[names[i[r]]][r]:
            i[r] += 1
        per_cfg[names[i[r]]][r].append(e)
    return {n: (out[0][k], out[1][k], per_cfg[n]) for k, n in enumerate(names)}


def test_launched_run_applies_cfg_checkpointing(launched):
    for name, cfg in LAUNCHED.items():
        _, _, events = launched[name]
        for rank in (0, 1):
            assert len(events[rank]) == cfg.steps
            for e in events[rank]:
                mem = e["memory"]
                assert mem["activations"] == gpt_activation_bytes(cfg), (name, rank)
                states = run_model_state_bytes(cfg)
                assert {k: mem[k] for k in states} == states, (name, rank)
                assert ("peak" in mem) == cfg.track_peak
                if cfg.track_peak:
                    # live together: params and saved activations at the end of forward;
                    # params, grads and optimizer state at the optimizer step
                    assert mem["peak"] >= mem["params"] + max(mem["activations"],
                                                              mem["grads"] + mem["optim"])
                    assert mem["allocated"] <= mem["peak"]
    act = {m: launched[f"allreduce {m}"][2][0][-1]["memory"]["activations"] for m in MODES}
    assert act["none"] > act["selective"] > act["full"]
    peak = {m: launched[f"allreduce {m}"][2][0][-1]["memory"]["peak"] for m in MODES}
    assert peak["none"] > peak["full"]


def test_launched_losses_and_parameters_unchanged(launched):
    ref0, ref1, _ = launched["allreduce none"]
    for mode in ("selective", "full"):
        r0, r1, _ = launched[f"allreduce {mode}"]
        assert r0["losses"] == ref0["losses"], mode  # bitwise: see the module docstring
        for name, t in ref0["state"].items():
            assert torch.equal(r0["state"][name], t), f"{mode} {name}"
            assert torch.equal(r1["state"][name], ref1["state"][name]), f"{mode} {name}"
    ddp0, ddp1, _ = launched["ddp full adamw"]
    for name, t in ddp0["state"].items():  # the ranks agree, checkpointed blocks and all
        assert torch.equal(t, ddp1["state"][name]), name
