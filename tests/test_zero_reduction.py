"""distlab.theory.zero_memory's reading of the ZeRO paper's formula (what 04_zero_and_fsdp sets
beside its measured ratios): the reduction of each stage against plain data parallelism, in
closed form, and its limit as N_d grows (Rajbhandari et al. 2020, Figure 1: "4x", "8x", "N_d")."""

import math

import pytest

from distlab.theory.estimate import FP32_ADAM, MIXED_ADAM
from distlab.theory.zero_memory import zero_reduction, zero_reduction_limit


@pytest.mark.parametrize("n_d", [1, 4, 64, 1024])
def test_reduction_is_the_papers_closed_form(n_d):
    """K = 12: ZeRO-1 16/(4 + 12/N_d), ZeRO-2 16/(2 + 14/N_d), ZeRO-3 16/(16/N_d) = N_d."""
    assert zero_reduction(1, n_d, MIXED_ADAM) == pytest.approx(16 / (4 + 12 / n_d))
    assert zero_reduction(2, n_d, MIXED_ADAM) == pytest.approx(16 / (2 + 14 / n_d))
    assert zero_reduction(3, n_d, MIXED_ADAM) == pytest.approx(n_d)
    assert zero_reduction(0, n_d, MIXED_ADAM) == 1


def test_limits():
    """As N_d grows: 4x and 8x for K = 12, only 2x and 4x for fp32 AdamW (4 + 4 + 8), and
    ZeRO-3 unbounded; the reduction approaches each limit from below."""
    assert [zero_reduction_limit(s, MIXED_ADAM) for s in (1, 2)] == [4, 8]
    assert [zero_reduction_limit(s, FP32_ADAM) for s in (1, 2)] == [2, 4]
    assert zero_reduction_limit(3, MIXED_ADAM) == math.inf
    for bpp in (MIXED_ADAM, FP32_ADAM):
        for s in (1, 2):
            assert zero_reduction(s, 2**20, bpp) < zero_reduction_limit(s, bpp)
            assert zero_reduction(s, 2**20, bpp) == pytest.approx(zero_reduction_limit(s, bpp),
                                                                  rel=1e-5)
