"""RunConfig refuses bad input before any process starts, naming the field and the choices."""

import pytest

from distlab import RunConfig, launch
from distlab.config import STRATEGIES


@pytest.mark.parametrize("changes, words", [
    ({"strategy": "zero9"}, ["strategy", "'single'", "'allreduce'"]),
    ({"world_size": 0}, ["world_size", ">= 1"]),
    ({"strategy": "allreduce", "world_size": 3, "global_batch": 16}, ["global_batch=16", "3"]),
    ({"world_size": 2}, ["world_size=2", "single"]),
    ({"precision": "fp4"}, ["precision", "'bf16'"]),
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
        RunConfig.from_dict({**cfg.to_dict(), "zero_level": 3})
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


@pytest.mark.parametrize("changes, words", [
    ({"lr": float("inf")}, ["lr=inf", "finite"]),
    ({"grad_clip": float("nan")}, ["grad_clip=nan"]),
    ({"weight_decay": float("nan")}, ["weight_decay=nan"]),
    ({"bucket_mb": float("nan")}, ["bucket_mb=nan"]),
    ({"steps": 10 ** 15}, ["steps=", "at most"]),
    ({"seed": "abc"}, ["seed='abc'", "integer"]),
    ({"steps": True}, ["steps=True", "not a bool"]),
    ({"lr": "0.1"}, ["lr='0.1'", "number"]),
    ({"world_size": 2.0}, ["world_size=2.0"]),
    ({"strategy": "ddp", "world_size": 2, "broadcast_buffers": "no"}, ["broadcast_buffers='no'"]),
    ({"sync_bn": "no"}, ["sync_bn='no'", "True or False"]),
    ({"strategy": "ddp", "world_size": 2, "microbatches": 2}, ["microbatches=2", "'ddp'", "pp"]),
    ({"strategy": "zero2", "world_size": 2, "bucket_mb": 1.0}, ["bucket_mb=1.0", "ddp"]),
    ({"strategy": "ddp", "world_size": 2, "allreduce": "ring"}, ["allreduce='ring'"]),
    ({"sync_bn": True}, ["sync_bn=True", "GPT has no BatchNorm"]),
    ({"strategy": "ddp", "world_size": 2, "param_dtype": "bf16"}, ["param_dtype='bf16'", "zero3"]),
    ({"strategy": "zero3", "world_size": 2, "param_dtype": "bf16", "precision": "bf16"},
     ["param_dtype='bf16'", "precision='bf16'"]),
    ({"strategy": "zero3", "world_size": 2, "reduce_dtype": "int8"}, ["reduce_dtype='int8'"]),
])
def test_types_non_finite_numbers_and_ignored_knobs_are_refused(changes, words):
    with pytest.raises(ValueError) as e:
        RunConfig(**changes)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_numpy_numbers_are_taken_as_python_numbers():
    import numpy as np
    cfg = RunConfig(steps=np.int64(3), lr=np.float32(0.5))
    assert type(cfg.steps) is int and type(cfg.lr) is float
    assert RunConfig.from_dict(__import__("json").loads(cfg.to_json())) == cfg
    with pytest.raises(ValueError, match="extra='notadict' must be a dict"):
        RunConfig.from_dict({"extra": "notadict"})


def test_launch_checks_this_machine_before_starting_a_rank(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    cases = [
        (dict(runs_root=str(a_file)), "runs_root="),
        (dict(runs_root=str(a_file / "below")), "is a file, not a folder"),
        (dict(strategy="ddp", world_size=2, checkpoint_every=1, checkpoint_dir=str(a_file)),
         "checkpoint_dir="),
        (dict(strategy="ddp", world_size=2, resume_from=str(tmp_path)),
         "no complete checkpoint"),
        (dict(init_from=str(tmp_path / "missing.pt")), "init_from="),
        (dict(strategy="ddp", world_size=4, n_layer=48, n_embd=4096, n_head=32),
         "more than this machine's"),
    ]
    for changes, words in cases:
        runs = tmp_path / "runs"
        with pytest.raises(ValueError, match=words):
            launch(RunConfig(**{"runs_root": str(runs), **changes}))
        assert not runs.exists() or not any(runs.iterdir()), changes  # nothing started
