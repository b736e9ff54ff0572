"""FP8 arithmetic written here (distlab.fp8): the formats' facts, each scheme's groups and
scales by hand, round trips, saturation, delayed scaling, and the dequantized product against
torch._scaled_mm (torch's FP8 matmul, which runs on the CPU).

Tolerances: the dequantized product against _scaled_mm, 1e-6 relative to the largest output:
both multiply the same FP8 values and scales in fp32, in different orders (measured 2e-7).
"""

import math

import pytest
import torch

from distlab import fp8


def test_the_formats_facts_are_the_ocp_ones():
    e4, e5 = fp8.format_facts(fp8.E4M3), fp8.format_facts(fp8.E5M2)
    assert (e4["max"], e4["smallest_normal"], e4["smallest_subnormal"], e4["eps"]) == \
        (448.0, 2.0 ** -6, 2.0 ** -9, 2.0 ** -3)
    assert (e5["max"], e5["smallest_normal"], e5["smallest_subnormal"], e5["eps"]) == \
        (57344.0, 2.0 ** -14, 2.0 ** -16, 2.0 ** -2)


def test_each_scheme_groups_the_values_it_says():
    x = torch.zeros(2, 300)
    x[0, 5], x[0, 200], x[1, 290] = 3.0, -7.0, 11.0
    # tensorwise: one amax; rowwise: each row's; 1x128: per 128 of a row, the last tile 44 wide
    assert (fp8.group_amax(x, "tensorwise") == 11.0).all()
    assert fp8.group_amax(x, "rowwise")[:, 0].tolist() == [7.0, 11.0]
    tiles = fp8.group_amax(x, "block1x128")
    assert tiles[0, :128].unique().tolist() == [3.0]
    assert tiles[0, 128:256].unique().tolist() == [7.0]
    assert tiles[0, 256:].unique().tolist() == [0.0] and tiles[1, 256:].unique().tolist() == [11.0]
    m = torch.zeros(130, 300)
    m[0, 0], m[129, 299], m[5, 130] = 2.0, 5.0, 4.0
    blocks = fp8.group_amax(m, "block128x128")
    assert blocks[:128, :128].unique().tolist() == [2.0]
    assert blocks[:128, 128:256].unique().tolist() == [4.0]
    assert blocks[128:, 256:].unique().tolist() == [5.0]
    assert blocks[128:, :128].unique().tolist() == [0.0]
    assert fp8.quantize(x, "block1x128")[1].unique().numel() == 4  # 3 tiles' scales and 1.0


def test_the_scale_maps_each_groups_amax_onto_the_formats_max():
    x = torch.tensor([[0.5, -2.0], [0.0, 0.0]])
    q, scale = fp8.quantize(x, "rowwise")
    assert q[0].float().abs().max() == 448.0 and scale[0, 0] == 224.0
    assert (scale[1] == 1.0).all() and (q[1].float() == 0).all()  # an all-zero row stays zero
    e5, s5 = fp8.quantize(x, "rowwise", fp8.E5M2)
    assert e5[0].float().abs().max() == 57344.0


def test_representable_values_round_trip_exactly_and_others_round_to_nearest():
    x = torch.tensor([[448.0, 1.0, 0.5, -0.015625, 2.0 ** -9]])  # e4m3 values, amax 448
    assert torch.equal(fp8.fake_quantize(x), x)
    y = torch.tensor([[448.0, 1.0 + 2 ** -4 + 2 ** -6]])  # between 1 and 1.125, nearer 1.125
    assert fp8.fake_quantize(y)[0, 1] == 1.125
    tiny = torch.tensor([[448.0, 2.0 ** -11]])  # under half the smallest subnormal: zero
    st = fp8.error_stats(tiny, "tensorwise")
    assert fp8.fake_quantize(tiny)[0, 1] == 0 and st["flushed"] == 0.5


def test_delayed_scaling_saturates_a_tensor_larger_than_its_history():
    d = fp8.DelayedScaling(history=2)
    small, big = torch.tensor([[1.0, -0.5]]), torch.tensor([[8.0, 1.0]])
    assert d.amax(small) == 1.0  # before any history: the tensor's own
    d.observe(small)
    st = fp8.error_stats(big, "tensorwise", amax=d.amax(big))
    assert st["saturated"] == 0.5  # 8 scaled by 448/1 clamps at 448: read back as 1.0
    assert fp8.fake_quantize(big, amax=d.amax(big))[0, 0] == 1.0
    d.observe(big)
    d.observe(small)
    d.observe(small)  # the history holds 2: the 8 has left it
    assert d.amax(big) == 1.0
    with pytest.raises(ValueError, match="history=0"):
        fp8.DelayedScaling(0)


@pytest.mark.parametrize("scheme", ["tensorwise", "rowwise"])
def test_the_dequantized_product_is_torchs_scaled_mm(scheme):
    """torch._scaled_mm(q_a, q_w^T, 1/s_a, 1/s_w): per tensor a scalar scale each, rowwise a
    scale per row of the activations and per output row of the weight."""
    torch.manual_seed(0)
    a, w = torch.randn(64, 256), torch.randn(96, 256)
    qa, sa = fp8.quantize(a, scheme)
    qw, sw = fp8.quantize(w, scheme)
    want = fp8.dequantize(qa, sa) @ fp8.dequantize(qw, sw).t()
    if scheme == "tensorwise":
        inv_a, inv_w = 1 / sa.reshape(-1)[0], 1 / sw.reshape(-1)[0]
    else:
        inv_a, inv_w = (1 / sa[:, :1]).contiguous(), (1 / sw[:, :1]).t().contiguous()
    got = torch._scaled_mm(qa, qw.t(), scale_a=inv_a.float(), scale_b=inv_w.float(),
                           out_dtype=torch.float32)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()


def test_bad_inputs_are_refused_naming_the_setting():
    with pytest.raises(ValueError, match="scheme='blockwise' is not one of"):
        fp8.quantize(torch.ones(2, 2), "blockwise")
    with pytest.raises(ValueError, match="block128x128 scales a matrix"):
        fp8.quantize(torch.ones(2, 2, 2), "block128x128")


def test_an_outlier_channel_pushes_the_rest_of_its_group_towards_zero():
    """One column 10^4 times the rest: under one scale per tensor the other values land among
    e4m3's subnormals and some flush to zero; with a scale per 1x128 tile only the outlier's
    own tile suffers, so fewer do."""
    from distlab.studies.fp8_scaling import with_outliers
    torch.manual_seed(1)
    x, keep = with_outliers(torch.randn(64, 512), 1e4, n_outliers=1)
    per_tensor = fp8.error_stats(x, "tensorwise", where=keep)
    per_tile = fp8.error_stats(x, "block1x128", where=keep)
    assert per_tensor["subnormal"] > 0.3 and per_tensor["flushed"] > 0.01
    assert per_tile["flushed"] < per_tensor["flushed"] / 2
    torch.manual_seed(2)  # e4m3's 3 mantissa bits: 2-3% RMS relative error on normal values
    assert math.isclose(fp8.error_stats(torch.randn(64, 64), "tensorwise")["rel_error"], 0.026,
                        abs_tol=0.01)
