"""Mixed precision (distlab.rank.precision) and NaN detection (distlab.debug.nan).

* The loss scaler written here follows torch.amp.GradScaler exactly: same scale after every
  step, same skipped steps, bitwise the same parameters (both multiply float32 gradients by the
  same float32 1/S and run the same optimizer on them, so there is no rounding to tolerate).
* The demonstrations' numbers (bf16 rounding away an update, fp16 underflow with and without a
  scale of 2^16) are the ones their docstrings state.
* fp32_modules keeps the named modules' outputs float32 under bf16 autocast; parameters and
  gradients stay float32 (the master weights).
* Launched runs (one launch of four configs, ddp at world 2): bf16 trains like fp32; fp16 with
  dynamic loss scaling logs its scale and skipped steps, identically on both ranks.
* A NaN written into one weight at step k is named (module, step, phase) in the RunError.

Launches: 3 (training configs; the found-inf drill; the NaN fault), about 3 s each.
"""

import pytest
import torch
import torch.nn as nn

from distlab import RunConfig, RunError, launch, run_ranks, Run
from distlab.models import GPT, GPTConfig
from distlab.debug.nan import NanDetector, NonFiniteError, poison
from distlab.rank.precision import DynamicLossScaler, apply_fp32_modules, param_dtypes
from distlab.studies.precision_lessons import (formats, fp16_underflow_demo, rounding_demo,
                                       skip_together_demo)
from distlab.rank.train import train_with_state


# -- the scaler against torch.amp.GradScaler ------------------------------------------------------
def _replay(kind, bad, steps, **kw):
    """Train a small linear model for `steps` SGD steps with loss scaling; at step i in `bad`,
    one gradient entry is overwritten with bad[i] (inf, NaN, -inf) after backward. Returns
    (scale after each step, skipped per step, final parameters)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = (torch.amp.GradScaler("cpu", **kw) if kind == "torch" else DynamicLossScaler(**kw))
    gen = torch.Generator().manual_seed(1)
    scales, skipped = [], []
    for i in range(steps):
        x = torch.randn(8, 6, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        if i in bad:
            model[2].weight.grad[1, 3] = bad[i]
        before = [p.detach().clone() for p in model.parameters()]
        if kind == "torch":
            scaler.step(opt)
            scaler.update()
        else:
            found = scaler.unscale_([p.grad for p in model.parameters()])
            if not found:
                opt.step()
            scaler.update(found)
        skipped.append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
        scales.append(scaler.get_scale())
    return scales, skipped, [p.detach() for p in model.parameters()]


BAD = {2: float("inf"), 3: float("nan"), 4: float("inf"), 11: -float("inf"), 19: float("nan")}


@pytest.mark.parametrize("kw", [
    dict(init_scale=2.0 ** 10, growth_interval=3),
    # factors that are not powers of two: the float32 rounding of the scale must match too
    dict(init_scale=1000.0, growth_factor=3.0, backoff_factor=0.3, growth_interval=2),
], ids=["pow2", "odd-factors"])
def test_scaler_follows_torch_grad_scaler(kw):
    ours, ref = _replay("ours", BAD, 24, **kw), _replay("torch", BAD, 24, **kw)
    assert ours[0] == ref[0]  # the scale after every step
    assert ours[1] == ref[1] == [i in BAD for i in range(24)]  # exactly the poisoned steps skip
    for a, b in zip(ours[2], ref[2]):
        assert torch.equal(a, b)
    # it did both: backed off (3 overflows in a row among them) and grew
    changes = list(zip(ours[0], ours[0][1:]))
    assert any(b < a for a, b in changes) and any(b > a for a, b in changes)


def test_found_inf_is_shared_so_every_rank_skips():
    out = run_ranks(skip_together_demo, 2, timeout_s=30)
    assert [r["local_found_inf"] for r in out] == [False, True]  # only rank 1 saw the inf
    assert [r["synced_found_inf"] for r in out] == [True, True]  # both skip
    assert [r["scale_after"] for r in out] == [512.0, 512.0]
    assert all(r["comm"]["loss_scale.found_inf"]["calls"] == 1 for r in out)


# -- the demonstrations ------------------------------------------------------------------------
def test_formats_and_the_update_that_rounds_away():
    f = formats()
    assert (f["bf16"]["eps"], f["fp16"]["eps"], f["fp32"]["eps"]) == (2 ** -7, 2 ** -10, 2 ** -23)
    assert f["fp16"]["smallest_subnormal"] == 2 ** -24 and f["fp16"]["max"] == 65504
    # round to nearest even: 2^-25 is halfway to 2^-24 and rounds to 0; just above it does not
    assert torch.tensor(2.0 ** -25).half().item() == 0.0
    assert torch.tensor(1.5 * 2.0 ** -25).half().item() == 2 ** -24
    d = rounding_demo(w=1.0, update=1e-3, steps=100)
    assert d["bf16"]["after_one_update"] == 1.0 and d["bf16"]["after_100_updates"] == 1.0
    assert d["fp16"]["after_one_update"] == 1 + 2 ** -10
    assert d["fp16"]["after_100_updates"] == pytest.approx(1.09765625, abs=0)
    assert d["fp32"]["after_one_update"] == pytest.approx(1.001, abs=1e-7)
    assert d["fp32_master"]["after_100_updates"] == pytest.approx(1.1, abs=1e-5)
    assert d["fp32_master"]["as_bf16"] == 1.1015625  # the nearest bf16 to 1.1


def test_fp16_underflow_numbers_are_as_stated():
    d = fp16_underflow_demo(rms=1e-5, scale=2.0 ** 16, seed=0)
    # stated in the docstring: 6.4% unscaled, 0.063% scaled (all of them analytically-zero key
    # biases), 0 otherwise. Tolerance 0.005 absolute: the fraction of entries below a threshold
    # moves only if rounding in another torch build moves entries across it (~1e-7 relative)
    assert d["zero_fraction_unscaled"] == pytest.approx(0.064, abs=0.005)
    assert d["zero_fraction_scaled"] == pytest.approx(0.00063, abs=0.0002)
    assert d["zero_fraction_scaled_without_k_bias"] == 0.0
    assert set(d["scaled_zeros_by_param"]) == {f"blocks.{i}.attn.k.bias" for i in range(4)}
    assert d["subnormal_fraction_unscaled"] > 0.99 and d["overflow_fraction_scaled"] == 0.0


# -- selective precision and master weights --------------------------------------------------
def test_fp32_modules_stay_fp32_under_bf16_autocast():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    assert apply_fp32_modules(model, "head, blocks.1.mlp") == ["head", "blocks.1.mlp"]
    dtypes = {}
    for name, m in model.named_modules():
        m.register_forward_hook(lambda m, i, o, name=name: dtypes.__setitem__(name, o.dtype))
    x = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x, x).backward()
    for name in ("head", "blocks.1.mlp", "blocks.1.mlp.fc", "blocks.1.mlp.proj"):
        assert dtypes[name] == torch.float32, name
    for name in ("blocks.0.mlp.fc", "blocks.1.attn.q", "blocks.0.attn.o"):
        assert dtypes[name] == torch.bfloat16, name  # autocast still applies elsewhere
    # master weights: the parameters and their gradients never left float32
    assert set(param_dtypes(model)) == {"float32"}
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(ValueError, match="top-level modules are: tok_emb"):
        apply_fp32_modules(model, "lm_head")


# -- NaN detection, in process ---------------------------------------------------------------
class _SqrtOfZero(nn.Module):
    """Finite forward (adds 0), NaN backward: d sqrt(u)/du at u = 0 is inf, times 0 is NaN."""

    def forward(self, x):
        return x + torch.sqrt((x * 0).pow(2).sum(-1, keepdim=True))


def test_detector_names_first_module_in_forward_and_in_backward():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    det = NanDetector(model)
    det.step = 7
    x = torch.randint(0, 64, (2, 16))
    model(x, x).backward()  # clean: nothing raised
    det.check_gradients(model)
    assert poison(model, "blocks.1.mlp.proj") == "blocks.1.mlp.proj"
    with pytest.raises(NonFiniteError) as e:
        model(x, x)
    assert (e.value.step, e.value.phase, e.value.module) == (7, "forward", "blocks.1.mlp.proj")

    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), _SqrtOfZero(), nn.Linear(4, 1))
    NanDetector(net).step = 0
    with pytest.raises(NonFiniteError) as e:
        net(torch.randn(3, 4)).sum().backward()
    assert (e.value.phase, e.value.module) == ("backward", "2")  # not "1" or "0", downstream of it

    emb = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 1))  # an embedding passes no gradient on
    det = NanDetector(emb)
    out = emb(torch.tensor([1, 2])).sum()
    emb[0].weight.register_hook(lambda g: g * float("inf"))
    out.backward()
    with pytest.raises(NonFiniteError, match="parameter 'weight'") as e:
        det.check_gradients(emb)
    assert e.value.module == "0"


def test_config_knows_the_nan_fault_and_refuses_scaling_for_parameter_servers():
    RunConfig(fault="nan", detect_nan=True, steps=4, fault_step=2)
    with pytest.raises(ValueError, match="loss scaling and grad_clip"):
        RunConfig(strategy="ps-sync", world_size=3, precision="fp16", global_batch=8)
    RunConfig(strategy="ps-sync", world_size=3, precision="fp16", loss_scale="none", global_batch=8)


# -- launched runs -----------------------------------------------------------------------------
BASE = RunConfig(strategy="ddp", world_size=2, steps=30, lr=3e-3, global_batch=8, seq_len=16,
                 n_layer=2, n_embd=32, n_head=2, timeout_s=60)
RUNS = {
    "fp32": BASE,
    "bf16": BASE.replace(precision="bf16"),
    "bf16 fp32-head clip": BASE.replace(precision="bf16", fp32_modules="head", grad_clip=0.5),
    # fp16 is ~12x slower on this CPU: one layer, 12 steps. A first scale of 2^24 overflows
    # (the scaled logits' gradient exceeds 65504 in the head's fp16 backward), so the run
    # shows backing off; growth_interval 3 shows growing within 12 steps.
    "fp16": BASE.replace(precision="fp16", steps=12, n_layer=1, loss_scale_init=2.0 ** 24,
                         loss_scale_growth_interval=3),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("precision-runs"))
    out = run_ranks(train_with_state, 2, [c.to_dict() for c in RUNS.values()], run_dir=run_dir,
                    timeout_s=60)
    steps = Run.load(run_dir).history("step")
    # train_with_state runs the configs in turn; each restarts at step 0
    per_cfg, i = {name: {0: [], 1: []} for name in RUNS}, {0: 0, 1: 0}
    names = list(RUNS)
    for e in steps:
        r = e["rank"]
        if e["step"] == 0 and per_cfg[names[i[r]]][r]:
            i[r] += 1
        per_cfg[names[i[r]]][r].append(e)
    return {name: (out[0][k], per_cfg[name]) for k, name in enumerate(names)}


def test_bf16_trains_like_fp32(launched):
    fp32, bf16 = launched["fp32"][0]["losses"], launched["bf16"][0]["losses"]
    # trains: the last 5 steps' mean is well below the first step's loss (4.15 -> ~2.6)
    assert sum(bf16[-5:]) / 5 < bf16[0] - 1.0
    # rtol 1e-2: bf16 keeps 8 significant bits (2^-9 relative
    # per rounding), but weights, gradients and the loss stay fp32 and only the matmuls' inputs
    # are rounded; over 30 steps we observed at most ~4e-4 relative. A run that did not train
    # (or trained on other data) is off by >10% after a few steps.
    assert bf16 == pytest.approx(fp32, rel=1e-2)
    assert bf16 != fp32  # and autocast really ran in bf16
    # every step event says there was no scaling and nothing skipped
    assert all(e["scale"] is None and e["skipped"] is False for e in launched["bf16"][1][0])


def test_fp32_head_and_grad_clip_run(launched):
    res, events = launched["bf16 fp32-head clip"]
    assert sum(res["losses"][-5:]) / 5 < res["losses"][0] - 1.0
    norms = [e["grad_norm"] for e in events[0]]
    assert [e["grad_norm"] for e in events[1]] == norms  # ddp: same averaged gradients
    assert all(n > 0 for n in norms) and any(n > 0.5 for n in norms)  # the clip was active


def test_fp16_dynamic_loss_scaling_logs_scale_and_skipped_steps(launched):
    res, events = launched["fp16"]
    ev0, ev1 = events[0], events[1]
    assert len(ev0) == RUNS["fp16"].steps
    # both ranks skip the same steps with the same scale (DDP averaged the infs onto both,
    # and the found-inf flag is all-reduced besides)
    assert [(e["scale"], e["skipped"]) for e in ev0] == [(e["scale"], e["skipped"]) for e in ev1]
    assert all("loss_scale.found_inf" in e["comm"] for e in ev0)
    scales, skipped = [e["scale"] for e in ev0], [e["skipped"] for e in ev0]
    assert scales[0] == 2.0 ** 24 and skipped[0]  # the first scale overflows
    assert not all(skipped)  # and it finds one that does not
    # the logged scale (the one each step used) follows the rule step by step
    s, clean = 2.0 ** 24, 0
    for scale, skip in zip(scales, skipped):
        assert scale == s
        if skip:
            s, clean = s / 2, 0
        else:
            clean += 1
            if clean == 3:
                s, clean = s * 2, 0
    # the clean steps trained: the last loss is below the first (skipped steps do not update)
    assert res["losses"][-1] < res["losses"][0]


def test_nan_fault_names_module_step_and_phase(tmp_path):
    cfg = BASE.replace(steps=6, detect_nan=True, fault="nan", fault_rank=1, fault_step=3,
                       fault_module="blocks.1.mlp.proj", runs_root=str(tmp_path))
    run = launch(cfg)
    with pytest.raises(RunError) as e:
        run.wait(timeout=60)
    err = e.value
    assert (err.rank, err.step) == (1, 3)
    assert "NonFiniteError" in err.message and "'blocks.1.mlp.proj'" in err.message
    assert "step 3 in forward" in err.message
    [nan] = run.history("nan")
    assert (nan["rank"], nan["step"], nan["phase"], nan["module"]) == (1, 3, "forward",
                                                                      "blocks.1.mlp.proj")
    assert run.history("fault")[0]["module"] == "blocks.1.mlp.proj"
