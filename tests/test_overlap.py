"""distlab.theory.overlap: each condition's threshold is where its compute meets its transfer,
and the compute and bytes are the counts its docstring names."""

import pytest

from distlab.theory.overlap import dp_overlap, pp_overlap, tp_overlap

F, BETA = 5e10, 2.5e9  # FLOP/s and bytes/s: 20 FLOPs a byte, about this machine's loopback


@pytest.mark.parametrize("n", [2, 4, 8])
def test_dp_hides_from_the_token_count_its_threshold_names(n):
    need = dp_overlap(1e6, 1, n, F, BETA).need
    at = dp_overlap(1e6, need, n, F, BETA)
    assert at.compute_s == pytest.approx(at.comm_s)  # the threshold: compute = transfer
    assert dp_overlap(1e6, 2 * need, n, F, BETA).hides
    assert not dp_overlap(1e6, need / 2, n, F, BETA).hides
    # the parameters cancel: a bigger model needs no more tokens per rank
    assert dp_overlap(1e9, 1, n, F, BETA).need == pytest.approx(need)
    # backward is 4·P·T FLOPs; the ring sends 2(N-1)/N of the P·4 bytes of fp32 gradients
    assert at.compute_s == pytest.approx(4 * 1e6 * need / F)
    assert at.comm_s == pytest.approx(2 * (n - 1) / n * 1e6 * 4 / BETA)


def test_tp_and_pp_thresholds_are_where_compute_meets_the_transfer():
    tp = tp_overlap(8, 64, 128, 2, F, BETA)
    assert tp.need == pytest.approx(4 * F / (6 * BETA))  # (t-1)·b·F/(6β)
    edge = tp_overlap(8, 64, tp.need, 2, F, BETA)
    assert edge.compute_s == pytest.approx(edge.comm_s)
    pp = pp_overlap(8, 64, 128, 2, F, BETA)
    assert pp.have == 256 and pp.need == pytest.approx(4 * F / (24 * BETA))
    edge = pp_overlap(8, 64, pp.need, 1, F, BETA)
    assert edge.compute_s == pytest.approx(edge.comm_s)


def test_a_slow_link_exposes_what_loopback_hides():
    """The simulated nodes' 100 Mbit/s link carries 200x fewer bytes a second than loopback's
    2.5 GB/s: DP's threshold rises 200x, past the tokens this model gives a rank."""
    fast, slow = dp_overlap(1e6, 256, 2, F, BETA), dp_overlap(1e6, 256, 2, F, 100e6 / 8)
    assert fast.hides and not slow.hides
    assert slow.need / fast.need == pytest.approx(200)
    assert fast.ratio > 1 > slow.ratio
