"""FP8 training (RunConfig(precision="fp8"), distlab.rank.fp8_linear): the three matmuls of a
Linear against torch._scaled_mm on the same FP8 bytes, which Linears turn FP8, and FP8 under
ddp and zero3 on real ranks against one process.

Tolerances:
  against _scaled_mm, 1e-6 relative to the largest output: both multiply the same FP8 values
      and scales in fp32, in another order (measured 2.7e-7);
  against the fp32 product, 0.25 relative (Frobenius): e4m3 keeps 3 mantissa bits (a value's
      rounding error up to 2^-4 of it) and e5m2 2 (up to 2^-3); summed over 256 products the
      errors partly cancel (measured 0.02 to 0.08);
  ddp and zero3 at world 2 against one process accumulating the same two micro-batches
      (grad_accum=2), 1e-5 on every parameter after 4 SGD steps: every FP8 scale is computed
      from one micro-batch's values on both sides, so the FP8 casts are the same and only the
      fp32 sums' order differs (measured: 1.5e-8 rowwise, 1.2e-7 blockwise). Against one
      process on the whole batch at once (grad_accum=1) the weight gradients' scales, taken
      over both micro-batches' tokens, differ: 1.4e-3 and 1.0e-3, which this test would
      catch. SGD, not AdamW: AdamW divides each gradient by its own running size, so a
      gradient that is rounding noise alone (attention's k bias, to which softmax is blind)
      becomes a full learning-rate step whose sign is the noise's.
"""

import pytest
import torch

from distlab import RunConfig, fp8, run_ranks
from distlab.rank.build import build_model
from distlab.rank.fp8_linear import FP8Matmul, apply_fp8
from distlab.rank.train import train_with_state

SCALINGS = ["tensorwise", "rowwise"]  # the two _scaled_mm takes scales for


def _scaled_mm(a, b_t, scheme, fmt_a, fmt_b):
    """a @ b_tᵀ from the FP8 bytes, both scaled along the dimension summed over (K)."""
    qa, sa = fp8.quantize(a.contiguous(), scheme, fmt_a)
    qb, sb = fp8.quantize(b_t.contiguous(), scheme, fmt_b)
    if scheme == "tensorwise":
        inv_a, inv_b = 1 / sa.reshape(-1)[0], 1 / sb.reshape(-1)[0]
    else:
        inv_a, inv_b = (1 / sa[:, :1]).contiguous(), (1 / sb[:, :1]).t().contiguous()
    return torch._scaled_mm(qa, qb.t(), scale_a=inv_a.float(), scale_b=inv_b.float(),
                            out_dtype=torch.float32)


def _close(got, want, rel):
    got, want = got.detach(), want.detach()
    return float((got - want).abs().max() / want.abs().max()) <= rel


@pytest.mark.parametrize("scaling", SCALINGS)
def test_forward_and_both_gradients_are_scaled_mm_of_the_fp8_bytes(scaling):
    torch.manual_seed(0)
    x = torch.randn(64, 256)
    x[:, 7] *= 100  # an outlier channel, as LLM activations have
    w = (torch.randn(96, 256) * 0.05).requires_grad_()
    x.requires_grad_()
    y = FP8Matmul.apply(x, w, None, scaling, fp8.E5M2)
    g = torch.randn_like(y)
    y.backward(g)
    e4, e5 = fp8.E4M3, fp8.E5M2
    assert _close(y, _scaled_mm(x, w, scaling, e4, e4), 1e-6)
    assert _close(x.grad, _scaled_mm(g, w.t(), scaling, e5, e4), 1e-6)
    assert _close(w.grad, _scaled_mm(g.t(), x.t(), scaling, e5, e4), 1e-6)
    # and FP8, not fp32: close to the exact products, not equal
    gx, gw, x, w, y = x.grad, w.grad, x.detach(), w.detach(), y.detach()
    for got, want in ((y, x @ w.t()), (gx, g @ w), (gw, g.t() @ x)):
        rel = float((got - want).norm() / want.norm())
        assert 0 < rel < 0.25, rel


def test_blockwise_scales_weights_by_block_and_the_rest_by_tile():
    """A weight whose two 128 x 128 blocks differ 1000x: blockwise reads the small block back
    as well as tensorwise reads a weight of its own scale; tensorwise flushes part of it."""
    torch.manual_seed(0)
    w = torch.cat([torch.randn(128, 128) * 1000, torch.randn(128, 128) * 1e-3], 1)
    x = torch.randn(4, 256)
    small = slice(128, 256)
    y_block = FP8Matmul.apply(x[:, small], w[:, small], None, "blockwise", fp8.E5M2)
    want = x[:, small] @ w[:, small].t()
    err = lambda y: float((y - want).norm() / want.norm())  # noqa: E731
    one_block = err(y_block)
    whole_tensor = err(x[:, small] @ fp8.fake_quantize(w, "tensorwise")[:, small].t())
    whole_block = err(x[:, small] @ fp8.fake_quantize(w, "block128x128")[:, small].t())
    assert whole_block < 0.1 < whole_tensor, (whole_block, whole_tensor)
    assert abs(whole_block - one_block) < 0.05


def test_the_blocks_linears_turn_fp8_the_head_and_router_stay_fp32():
    dense = build_model(RunConfig(n_layer=1, n_embd=32, n_head=2, precision="fp8"))
    made = [n for n, m in dense.named_modules() if getattr(m, "_distlab_fp8", False)]
    assert made == ["blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v", "blocks.0.attn.o",
                    "blocks.0.mlp.fc", "blocks.0.mlp.proj"]
    moe = build_model(RunConfig(n_layer=1, n_embd=32, n_head=2, precision="fp8", n_experts=2,
                                top_k=1, strategy="ddp", world_size=2))
    made = {n for n, m in moe.named_modules() if getattr(m, "_distlab_fp8", False)}
    assert "blocks.0.mlp.experts.1.fc2" in made and "blocks.0.mlp.router" not in made
    assert "head" not in made
    assert apply_fp8(dense) == []  # already FP8: nothing twice


def test_settings_that_would_be_ignored_or_cannot_apply_are_refused():
    with pytest.raises(ValueError, match="settings of precision='fp8'"):
        RunConfig(fp8_scaling="rowwise")
    with pytest.raises(ValueError, match="strategy 'tp' does not support it"):
        RunConfig(precision="fp8", strategy="tp", world_size=2, tp=2)
    with pytest.raises(ValueError, match="use expert_grouped='loop'"):
        RunConfig(precision="fp8", strategy="ddp", world_size=2, n_experts=2, top_k=1,
                  expert_grouped="grouped_mm")
    with pytest.raises(ValueError, match="it needs precision='fp8' and fp8_scaling='tensorwise'"):
        RunConfig(precision="fp8", fp8_scaling="rowwise", fp8_all_gather=True,
                  strategy="zero3", world_size=2)
    with pytest.raises(ValueError, match="fp8_all_gather"):
        RunConfig(precision="fp8", fp8_all_gather=True, strategy="ddp", world_size=2)
    with pytest.raises(ValueError, match="fp8_all_gather=True with fsdp_layout='per_param'"):
        RunConfig(precision="fp8", fp8_all_gather=True, strategy="zero3", world_size=2,
                  fsdp_layout="per_param")
    with pytest.raises(ValueError, match="fp8_scaling='int8' is not one of"):
        apply_fp8(torch.nn.Linear(2, 2), "int8")


BASE = RunConfig(steps=4, optimizer="sgd", lr=0.1, global_batch=8, seq_len=16, n_layer=2,
                 n_embd=128, n_head=2, precision="fp8", timeout_s=60, threads_per_rank=1)
RUNS = {f"{s} {strategy}": BASE.replace(strategy=strategy, world_size=2, fp8_scaling=s)
        for s in ("rowwise", "blockwise") for strategy in ("ddp", "zero3")}


# zero3's all-gather of the FP8 Linears' weights: in fp32, in bf16 and in e4m3 (tensorwise)
ZERO3 = BASE.replace(strategy="zero3", world_size=2, steps=2)
GATHERS = {"fp32": ZERO3, "bf16": ZERO3.replace(param_dtype="bf16"),
           "fp8": ZERO3.replace(fp8_all_gather=True)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """One launch at world 2 runs every FP8 config in turn, then GATHERS; one process, the
    references."""
    single = run_ranks(train_with_state, 1, [c.replace(strategy="single", world_size=1,
                                                        grad_accum=2).to_dict()
                                              for c in RUNS.values()],
                       timeout_s=60, run_dir=str(tmp_path_factory.mktemp("single")))[0]
    pair = run_ranks(train_with_state, 2, [c.to_dict() for c in [*RUNS.values(),
                                                                    *GATHERS.values()]],
                     timeout_s=60, run_dir=str(tmp_path_factory.mktemp("pair")))
    return single, pair


@pytest.mark.parametrize("i,name", list(enumerate(RUNS)))
def test_fp8_on_two_ranks_equals_one_process_on_the_same_micro_batches(ranks, i, name):
    single, pair = ranks
    want = single[i]["state"]
    for rank in range(2):
        got = pair[rank][i]["state"]
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, atol=1e-5, rtol=0, msg=lambda m: f"{name} {k}: {m}")
    assert single[i]["losses"][-1] < single[i]["losses"][0]  # it trains


def test_zero3_all_gathers_the_fp8_weights_in_one_byte_each_plus_their_scales(ranks):
    """The FP8 Linears' weights (their own units) on the wire: fp8 is half of bf16's bytes and a
    quarter of fp32's, exactly, plus one fp32 amax per weight per gather; and the run is
    bitwise the fp32 gather's: the bytes each rank casts are those the Linear casts."""
    _, pair = ranks
    out = {name: pair[0][len(RUNS) + i] for i, name in enumerate(GATHERS)}
    sent = {name: sum(c["all_gather.fp8_linears"]["bytes_sent"] for c in o["comm"])
            for name, o in out.items()}
    assert sent["fp8"] * 2 == sent["bf16"] and sent["fp8"] * 4 == sent["fp32"]
    calls = sum(c["all_gather.fp8_linears"]["calls"] for c in out["fp8"]["comm"])
    weights_per_unit = 6  # a block's q, k, v, o, fc and proj
    # each gather: every rank's amax of each weight, 4 bytes, the ring's (N-1)/N of it
    assert sum(c["fp8.amax"]["bytes_sent"] for c in out["fp8"]["comm"]) == (
        calls * weights_per_unit * 2 * 4 // 2)
    assert "fp8.amax" not in out["bf16"]["comm"][0]
    for k, v in out["fp32"]["state"].items():
        assert torch.equal(out["fp8"]["state"][k], v), k
    assert any(not torch.equal(out["bf16"]["state"][k], v)
               for k, v in out["fp32"]["state"].items())  # bf16 parameters do differ
