"""The learning-rate scaling rules and warm-up, and one small real scaling experiment."""

import math

import pytest

from distlab import RunConfig
from distlab.lab.scaling import (BASE, RULES, loss_at_samples, lr_schedule, scaled_config, scaled_lr,
                             scaling_configs, scaling_experiment, summary)


def test_linear_warmup_rises_to_the_peak_then_stays():
    cfg = RunConfig(lr=0.8, warmup_steps=4, steps=7)
    assert lr_schedule(cfg) == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.8, 0.8, 0.8])
    assert lr_schedule(cfg.replace(warmup_steps=0)) == [0.8] * 7
    assert lr_schedule(cfg.replace(warmup_steps=1)) == [0.8] * 7  # one step: no warm-up
    assert lr_schedule(cfg, steps=2) == pytest.approx([0.2, 0.4])


def test_scaling_rules():
    # k = 64 / 8 = 8
    assert scaled_lr(0.1, 8, 64, "none") == 0.1
    assert scaled_lr(0.1, 8, 64, "linear") == pytest.approx(0.8)  # Goyal et al.: k * lr
    assert scaled_lr(0.1, 8, 64, "sqrt") == pytest.approx(0.1 * math.sqrt(8))  # Krizhevsky
    assert scaled_lr(0.1, 8, 2, "linear") == pytest.approx(0.025)  # smaller batches too
    for rule in RULES:
        assert scaled_lr(0.3, 16, 16, rule) == pytest.approx(0.3)  # k = 1: every rule agrees
    with pytest.raises(ValueError, match="rule="):
        scaled_lr(0.1, 8, 64, "cubic")
    cfg = scaled_config(BASE, 32, "linear", warmup_steps=5)
    assert (cfg.global_batch, cfg.lr, cfg.warmup_steps) == (32, pytest.approx(0.4), 5)
    assert cfg.lr_at(0) == pytest.approx(0.4 / 5)


def test_grid_runs_the_base_batch_once_per_warmup():
    grid = scaling_configs(BASE, batches=(8, 32), rules=RULES, warmups=(0, 4))
    assert [(r, c.global_batch, c.warmup_steps) for r, c in grid] == [
        ("none", 8, 0), ("none", 8, 4),
        ("none", 32, 0), ("none", 32, 4), ("linear", 32, 0), ("linear", 32, 4),
        ("sqrt", 32, 0), ("sqrt", 32, 4)]
    assert [c.lr for r, c in grid if r == "sqrt"] == pytest.approx([0.2, 0.2])


def test_a_small_experiment_returns_falling_curves():
    base = BASE.replace(steps=30)
    curves = scaling_experiment(base, batches=(8, 32), rules=("none", "linear"), warmups=(0,))
    assert [(c["batch"], c["rule"]) for c in curves] == [(8, "none"), (32, "none"),
                                                          (32, "linear")]
    for c in curves:
        assert len(c["loss"]) == len(c["step"]) == len(c["samples"]) == 30
        assert c["samples"][:2] == [c["batch"], 2 * c["batch"]]
        assert c["lr_per_step"] == [c["lr"]] * 30
        # starts near ln(vocab) (an untrained model's uniform guess) and falls
        assert abs(c["loss"][0] - c["loss_at_start"]) < 0.1
        assert c["final_loss"] < c["loss"][0] - 0.3 and not c["diverged"]
        assert c["loss_floor"] < c["final_loss"]
        print(f"{c['label']}: loss {c['loss'][0]:.2f} -> {c['final_loss']:.2f}")
    rows = summary(curves)
    assert len(rows) == 3 and "loss_at_240_samples" in rows[0]
    assert loss_at_samples(curves[0], 240) == pytest.approx(curves[0]["final_loss"])
