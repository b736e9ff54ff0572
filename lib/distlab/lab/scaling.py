"""Large-batch learning rates: the linear and square-root scaling rules, as an experiment.

Data parallelism grows the global batch with the number of ranks. A batch k times larger gives
a gradient estimate with k times less variance, and takes 1/k as many steps per epoch, so the
learning rate has to change with it:

    none     lr_k = lr                    the same step size: fewer, equally small steps
    linear   lr_k = k · lr                Goyal et al. 2017 ("Accurate, Large Minibatch SGD:
                                          Training ImageNet in 1 Hour"): k small-batch SGD steps
                                          ≈ one large step with k times the lr, as long as the
                                          gradient changes little over those k steps
    sqrt     lr_k = sqrt(k) · lr          Krizhevsky 2014 ("One weird trick"), Hoffer et al.
                                          2017: keep the variance of the update the same; the
                                          rule that fits Adam-type optimisers better (Malladi
                                          et al. 2022)

The linear rule breaks early in training, when the gradient changes fast and k·lr can exceed
what the loss surface tolerates. Goyal et al. add a gradual warm-up: the lr rises linearly over
the first epochs (theirs from lr to k·lr over 5 epochs; RunConfig.warmup_steps rises from
lr_k / warmup_steps to lr_k, see RunConfig.lr_at). Every rule also has a ceiling: past the
largest stable lr, no rule helps and a larger batch stops paying off (the "critical batch
size", McCandlish et al. 2018).

`scaling_experiment` runs the tiny GPT at several global batch sizes, each rule and each warm-up,
sequentially in one launch (launches cost seconds), and returns one curve per run: loss against
step (does a larger batch make faster progress per step?) and against samples seen (is it as
data-efficient?). Plain SGD is the default: it is the optimizer the linear rule was derived for.
"""

from __future__ import annotations

import math

from distlab.config import RunConfig

RULES = ("none", "linear", "sqrt")
# lr_k = lr / k: an interview answer's "reduce the learning rate in proportion to the effective
# batch", the opposite of the linear rule; not in the default grid, run it by naming it.
SEED_RULES = ("inverse",)

# The experiment's default: a 1-layer GPT on 16-token Markov sequences, plain SGD at lr 0.1 for
# batch 8. Measured on this model: lr 0.4 (linear rule at batch 32) trains well; lr 1.6 (linear
# at batch 128) blows up within ~25 steps unless warmed up. One 60-step run takes ~0.5 s on one
# core, so the default grid (14 runs) takes ~15 s including the launch.
BASE = RunConfig(strategy="single", optimizer="sgd", lr=0.1, global_batch=8, steps=60,
                 seq_len=16, n_layer=1, n_embd=32, n_head=2, timeout_s=120, threads_per_rank=1)
BATCHES = (8, 32, 128)
WARMUPS = (0, 15)


def scaled_lr(base_lr: float, base_batch: int, batch: int, rule: str) -> float:
    """The learning rate for `batch` when `base_lr` suits `base_batch`, by `rule`."""
    if rule not in RULES + SEED_RULES:
        raise ValueError(f"rule={rule!r} is not one of {RULES + SEED_RULES}")
    k = batch / base_batch
    return base_lr * {"none": 1.0, "linear": k, "sqrt": math.sqrt(k), "inverse": 1 / k}[rule]


def lr_schedule(cfg: RunConfig, steps: int | None = None) -> list[float]:
    """The learning rate at each step of a run (warm-up included)."""
    return [cfg.lr_at(s) for s in range(cfg.steps if steps is None else steps)]


def scaled_config(base: RunConfig, batch: int, rule: str, warmup_steps: int = 0) -> RunConfig:
    """`base` at global batch `batch`, its lr scaled by `rule`, with `warmup_steps`."""
    lr = scaled_lr(base.lr, base.global_batch, batch, rule)
    return base.replace(global_batch=batch, lr=lr, warmup_steps=warmup_steps,
                        name=f"B{batch}-{rule}-wu{warmup_steps}")


def scaling_configs(base: RunConfig = BASE, batches=BATCHES, rules=RULES,
                    warmups=WARMUPS) -> list[tuple[str, RunConfig]]:
    """The grid of (rule, config). At the base batch every rule gives the base lr, so it runs
    once per warm-up, under rule "none"."""
    out = []
    for batch in batches:
        for rule in rules if batch != base.global_batch else ("none",):
            for w in warmups:
                out.append((rule, scaled_config(base, batch, rule, w)))
    return out


def scaling_rank(rank: int, world: int, device, log, cfg_dicts: list) -> list[list[float]]:
    """Rank body: train each config in turn; this rank's loss per step for each."""
    from distlab.rank.train import train

    out = []
    for d in cfg_dicts:
        keep: dict = {}
        train(RunConfig.from_dict(d), rank, world, device, log, keep=keep)
        out.append(keep["losses"])
    return out


def scaling_experiment(base: RunConfig = BASE, batches=BATCHES, rules=RULES, warmups=WARMUPS,
                       timeout_s: float | None = None) -> list[dict]:
    """Run the grid (one launch, configs one after another) and return one curve per run:

        label, batch, rule, warmup_steps, lr (the scaled peak lr), lr_per_step,
        step [0, 1, ...], samples [B, 2B, ...] (rows seen after each step), loss [...],
        final_loss (mean of the last 5 steps), diverged (a loss not finite or above 1.5x
        the untrained loss), loss_at_start, loss_floor

    `base` may be any strategy: with a data-parallel one every config runs on its
    world_size ranks and the loss is the mean over ranks (the global batch's)."""
    from distlab.data.dataset import make_data
    from distlab.caller.launch import run_ranks

    grid = scaling_configs(base, batches, rules, warmups)
    per_rank = run_ranks(scaling_rank, base.processes, [c.to_dict() for _, c in grid],
                         timeout_s=base.timeout_s, threads=base.threads_per_rank,
                         wall_timeout_s=timeout_s)
    data = make_data(base)
    curves = []
    for i, (rule, cfg) in enumerate(grid):
        ranks = [r[i] for r in per_rank]
        loss = [sum(v) / len(v) for v in zip(*ranks)]
        last = loss[-5:]
        curves.append({
            "label": f"B={cfg.global_batch} {rule} lr={cfg.lr:.3g}"
                     + (f" warm-up {cfg.warmup_steps}" if cfg.warmup_steps else ""),
            "batch": cfg.global_batch, "rule": rule, "warmup_steps": cfg.warmup_steps,
            "lr": cfg.lr, "lr_per_step": lr_schedule(cfg, len(loss)),
            "step": list(range(len(loss))),
            "samples": [cfg.global_batch * (s + 1) for s in range(len(loss))],
            "loss": loss, "final_loss": sum(last) / len(last) if last else float("nan"),
            "diverged": any(not math.isfinite(x) or x > 1.5 * data.loss_at_start for x in loss),
            "loss_at_start": data.loss_at_start, "loss_floor": data.loss_floor,
        })
    return curves


def loss_at_samples(curve: dict, samples: int, window: int = 5) -> float:
    """A curve's loss once it has seen `samples` rows (mean over `window` steps up to there):
    compares batch sizes at equal data rather than at equal steps."""
    upto = [x for s, x in zip(curve["samples"], curve["loss"]) if s <= samples][-window:]
    return sum(upto) / len(upto) if upto else float("nan")


def summary(curves: list[dict]) -> list[dict]:
    """One row per run, for a table: the final loss at equal steps and the loss at the
    smallest run's sample budget (equal data)."""
    budget = min(c["samples"][-1] for c in curves if c["samples"])
    return [{"run": c["label"], "lr": c["lr"], "final_loss": c["final_loss"],
             f"loss_at_{budget}_samples": loss_at_samples(c, budget), "diverged": c["diverged"]}
            for c in curves]
