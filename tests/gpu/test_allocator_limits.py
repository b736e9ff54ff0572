"""torch.cuda.empty_cache() and set_per_process_memory_fraction on a real GPU
(distlab.studies.allocator_limits); skipped, saying why, without CUDA."""

import pytest
import torch

from distlab.studies.allocator_limits import (empty_cache_released, fraction_capped, freed,
                                              measure_allocator_limits, released)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_empty_cache_returns_wholly_free_segments_only():
    r = measure_allocator_limits()
    assert r.cuda and empty_cache_released(r), r
    assert released(r, "all freed") > 0 and released(r, "half freed") < freed(r, "half freed")


def test_the_memory_fraction_caps_the_allocator():
    r = measure_allocator_limits()
    assert fraction_capped(r), r
    assert "out of memory" in r.capped_oom.lower()
