"""RunConfig refuses bad input before any process starts, naming the field and the choices."""

import pytest

from distlab import RunConfig, launch
from distlab.config import STRATEGIES


@pytest.mark.parametrize("changes, words", [
    ({"strategy": "zero9"}, ["strategy", "'single'", "'allreduce'"]),
    ({"world_size": 0}, ["world_size", ">= 1"]),
    ({"strategy": "allreduce", "world_size": 3, "global_batch": 16}, ["global_batch=16", "3"]),
    ({"world_size": 2}, ["world_size=2", "single"]),
    ({"precision": "fp8"}, ["precision", "'bf16'"]),
    ({"allreduce": "tree"}, ["allreduce", "'ring'", "'naive'"]),
    ({"optimizer": "lamb"}, ["optimizer", "'sgd'"]),
    ({"n_embd": 30, "n_head": 4}, ["n_embd=30", "n_head=4"]),
    ({"lr": -1.0}, ["lr"]),
    ({"steps": 2.5}, ["steps"]),
    ({"fault": "raise", "fault_rank": 3}, ["fault_rank=3"]),
    ({"backend": "mpi"}, ["backend", "'gloo'"]),
])
def test_bad_config_raises_value_error_naming_the_field(changes, words):
    with pytest.raises(ValueError) as e:
        RunConfig(**changes)
    for w in words:
        assert w in str(e.value)


def test_launch_never_starts_for_a_bad_config(tmp_path):
    # construction fails, so nothing is launched and no run folder appears
    with pytest.raises(ValueError):
        launch(RunConfig(strategy="allreduce", world_size=4, global_batch=6, runs_root=str(tmp_path)))
    assert list(tmp_path.iterdir()) == []


def test_round_trip_through_dict_and_unknown_fields():
    cfg = RunConfig(strategy="allreduce", world_size=2, lr=0.1)
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown RunConfig field"):
        RunConfig.from_dict({**cfg.to_dict(), "zero_stage": 3})
    assert cfg.replace(world_size=4).local_batch == 4
    assert set(STRATEGIES) >= {"single", "allreduce"}


def test_learning_rate_warmup_is_linear_then_flat():
    cfg = RunConfig(lr=0.1, warmup_steps=4)
    assert [cfg.lr_at(s) for s in range(6)] == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1])
    assert RunConfig(lr=0.1).lr_at(0) == 0.1


def test_micro_batches_must_divide_evenly():
    assert RunConfig(strategy="allreduce", world_size=2, global_batch=16, grad_accum=4).micro_batch == 2
    with pytest.raises(ValueError, match="grad_accum=3"):
        RunConfig(strategy="allreduce", world_size=2, global_batch=16, grad_accum=3)
