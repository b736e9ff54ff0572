"""A finished training frees its model, so the next one in the same process starts clean.

train_with_state trains several configs in one launch (tests and notebooks compare them), and
on a GPU each step event records torch.cuda.memory_allocated: a model that outlives its run
is counted in the next run's memory. Measured on an H200 before the fix: a ZeRO-2 run trained
after another started with the first one's 162.7 MiB still allocated, and ZeRO-Offload showed
no saving (309.6 MiB after a step with and without it; 260.4 and 162.7 MiB when each ran
alone). Three references torch keeps where Python's collector cannot see them held the models:
post-accumulate-grad hooks that lead back to their parameter (ZeRO, DDP), a leaf's gradient
hook that does (sequence parallelism), and waited collectives' Work handles holding results
with an autograd graph (tensor parallelism). Each check is a weak reference to the model after
the run, the strategy and the optimizer are dropped and the collector has run.
"""

import gc
import weakref

import pytest

from distlab import RunConfig, run_ranks
from distlab.rank.train import train

pytestmark = pytest.mark.slow

BASE = RunConfig(steps=2, n_layer=2, n_embd=64, n_head=2, seq_len=32, global_batch=8,
                 strategy="ddp", world_size=2, timeout_s=60)
CASES = {"ddp": {}, "zero1": {}, "zero2": {}, "zero3": {}, "tp": {"tp": 2},
         "tp sp": {"tp": 2, "sp": True}, "pp": {"pp": 2, "microbatches": 2}}


def model_freed(rank, world, device, log, cfg_dicts):
    """Per config: (the model freed once the collector ran, ZeRO's gradient path freed before
    it: by reference counting alone; None where the strategy has none)."""
    freed = []
    for d in cfg_dicts:
        keep = {}
        gc.disable()  # only reference counting frees, until the collect() below
        try:
            train(RunConfig.from_dict(d), rank, world, device, log, keep=keep)
            model = weakref.ref(keep["model"])
            grads = getattr(getattr(keep["strategy"], "optimizer", None), "grads", None)
            grads = None if grads is None else weakref.ref(grads)
            del keep
            by_refcount = None if grads is None else grads() is None
        finally:
            gc.enable()
        gc.collect()
        freed.append((model() is None, by_refcount))
    return freed


@pytest.fixture(scope="module")
def freed():
    cfgs = [BASE.replace(strategy=name.split()[0], **knobs).to_dict()
            for name, knobs in CASES.items()]
    per_rank = run_ranks(model_freed, 2, cfgs, timeout_s=120)
    return {name: [r[i] for r in per_rank] for i, name in enumerate(CASES)}


@pytest.mark.parametrize("case", list(CASES))
def test_the_model_is_freed_after_its_run(freed, case):
    alive = [r for r, (ok, _) in enumerate(freed[case]) if not ok]
    assert not alive, f"{case}: the model outlived its run on ranks {alive}"


@pytest.mark.parametrize("case", ["zero1", "zero2"])
def test_zero_units_need_no_collector(freed, case):
    """ZeRO-1/2's units (flat parameters, gradient shards) are freed as soon as the run's
    objects are dropped, with the collector off. Before, each parameter's ZeRO mark held the
    ShardedGradients that holds the parameters: a cycle that kept the flat buffers (on a GPU,
    device memory the next run counted) until the collector ran."""
    assert [by_refcount for _, by_refcount in freed[case]] == [True, True]


def test_a_launch_of_another_size_than_the_config_is_refused():
    """A config checked for one world size (its batch split, its stages) is not run on
    another: train() names both (before, pp on 2 ranks with pp=1 died on an IndexError)."""
    with pytest.raises(Exception, match="runs in 1 processes but this launch has 2"):
        run_ranks(model_freed, 2, [BASE.replace(world_size=1).to_dict()], timeout_s=60)

