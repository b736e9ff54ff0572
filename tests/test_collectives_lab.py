"""01's companion (distlab.lab.collectives): the 'ring's bandwidth term stays ≈ 2S/β' row is
read off distlab.comm's models with a stated tolerance, so it reads yes for the ring's model
and no for a model that grows with N. No processes."""

from __future__ import annotations

from distlab import comm as C
from distlab.lab.collectives import BANDWIDTH_TERM_TOL, bandwidth_term_check


def test_the_bandwidth_term_row_reads_yes_for_the_ring_and_says_what_it_leaves_out():
    ib = C.LINKS["InfiniBand NDR"]
    r = bandwidth_term_check(100e6, ib, (8, 1024))
    assert r["holds"]
    limit = 2 * 100e6 / ib.bandwidth_Bps
    assert abs(r["ring_bw"][1024] / limit - 1) < 1e-3 and r["ring_bw"][8] == 7 / 8 * limit
    # the total the row used to print beside 2S/β: 14.2 ms, 10.2 ms of it latency
    assert round(r["ring_total"][1024] * 1e3, 1) == 14.2
    assert round(r["ring_latency"][1024] * 1e3, 1) == 10.2
    assert "14.2 ms, 10.2 ms of it the latency term" in r["figure"]
    assert f"within {BANDWIDTH_TERM_TOL:.0%}" in r["figure"]


def test_the_bandwidth_term_row_can_read_no():
    ib = C.LINKS["InfiniBand NDR"]
    naive_as_ring = {"ring": C.naive_allreduce_time, "naive": C.naive_allreduce_time}
    assert not bandwidth_term_check(100e6, ib, models=naive_as_ring)["holds"]
    ring_as_naive = {"ring": C.ring_allreduce_time, "naive": C.ring_allreduce_time}
    assert not bandwidth_term_check(100e6, ib, models=ring_as_naive)["holds"]
    # the tolerance is what separates N = 8 (7/8 of the limit) from a looser claim
    assert not bandwidth_term_check(100e6, ib, tol=0.1)["holds"]
