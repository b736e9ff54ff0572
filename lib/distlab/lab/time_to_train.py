"""Time to train, from what one measures: 13_search_and_time's companion for its last parts.

    flops_rows(count)              PyTorch's FLOP count by operator beside the formula
    achieved(cfg)                  one process's step: FLOP/s, the peak it is set against, MFU
    scaling_runs(base, worlds)     ddp at 1, 2, 4 ranks, the same rows per rank (weak scaling)
    scaling_rows(runs)             tokens/s and scaling efficiency per world size
    predict_seconds(...)           time per step × steps, the interview's recipe
    cluster_days(...)              6·N·D over a cluster's FLOP/s, with the efficiency band

**Scaling efficiency** at N ranks is throughput(N) / (N · throughput(1)) with the rows per rank
fixed (weak scaling, as data parallelism is used: more ranks, larger global batch). Every rank
gets one thread, so on a machine with fewer cores than ranks the ranks share cores, and the
figure says so: it measures this machine, not a law.
"""

from __future__ import annotations

import os
import statistics

import plotly.graph_objects as go

from distlab import RunConfig, launch
from distlab.studies.flop_count import matmul_peak
from distlab.studies.gpu import time_training
from distlab.theory.flops import datasheet_peak
from distlab.lab.common import RUN_COLORS
from distlab.caller.run import Run

DAY = 86_400


def flops_rows(count: dict) -> list[list]:
    """Rows: what PyTorch counted, per part, beside the formula's figure for that part."""
    matmuls = count["counted"] - count["attention"]
    return [["Linear layers (mm, addmm)", f"{matmuls:,}", f"{count['formula_6n']:,}", "6·N·tokens",
             f"{matmuls / count['formula_6n']:.4f}"],
            ["attention (bmm)", f"{count['attention']:,}", f"{count['formula_attention']:,}",
             "12·L·h·s·tokens", f"{count['attention'] / count['formula_attention']:.4f}"],
            ["total", f"{count['counted']:,}", f"{count['formula']:,}", "(6N + 12·L·h·s)·tokens",
             f"{count['counted'] / count['formula']:.4f}"]]


def achieved(cfg: RunConfig, steps: int = 6, repeats: int = 1, threads: int = 1) -> dict:
    """Time `cfg`'s training step in this process and set its model FLOP/s against a peak: the
    datasheet's on a known GPU, else this machine's measured matmul peak at the same threads.
    The step runs on the GPU where there is one (cfg.precision as given), else on the CPU.
    On the CPU the peak and the step are measured `repeats` times, interleaved (peak, step,
    peak, step, ...), with `threads` intra-op threads for both, and "mfus" holds one MFU per
    pair: the two share the load of their moment, so each ratio is this machine's under that
    load. One thread by default: with every core in use, a process that takes a core for a
    moment slows the matmul and the small-model step unequally (measured on a 2-core machine:
    MFU 54-57% at 2 threads when quiet, 41-58% beside one busy process; 66-79% at one thread,
    either way)."""
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        result = time_training(cfg, device, steps=steps, warmup=2)
        name = torch.cuda.get_device_name()
        peak = datasheet_peak(name, cfg.precision if cfg.precision in ("bf16", "fp8")
                              else "fp32")
        if peak is None:
            return {**result, "device": name, "peak": None, "peak_source": "unknown GPU",
                    "mfu": None, "mfus": []}
        return {**result, "device": name, "peak": peak[0], "peak_source": peak[1],
                "mfu": result["flops_per_s"] / peak[0], "mfus": [result["flops_per_s"] / peak[0]]}
    pairs, old = [], torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(repeats):
            peak = matmul_peak()  # at the threads set above
            pairs.append((peak, time_training(cfg, device, steps=steps, warmup=2)))
    finally:
        torch.set_num_threads(old)
    mfus = [r["flops_per_s"] / p["flops_per_s"] for p, r in pairs]
    peak, result = pairs[mfus.index(sorted(mfus)[(len(mfus) - 1) // 2])]  # the median pair
    return {**result, "device": f"CPU, {peak['threads']} threads", "peak": peak["flops_per_s"],
            "peak_source": f"measured: median of 10 fp32 {peak['n']}×{peak['n']} matmuls",
            "mfu": result["flops_per_s"] / peak["flops_per_s"], "mfus": mfus}


def scaling_runs(base: RunConfig, worlds=(1, 2, 4), rows_per_rank: int = 8) -> dict[int, Run]:
    """`ddp` (`single` at 1) at each world size, rows_per_rank rows on every rank, one thread
    per rank; one launch per world size (the process count differs), run one after another."""
    runs = {}
    for w in worlds:
        cfg = base.replace(strategy="ddp" if w > 1 else "single", world_size=w,
                           global_batch=rows_per_rank * w, threads_per_rank=1,
                           name=f"scaling-w{w}")
        runs[w] = launch(cfg).wait()
    return runs


def slowest_rank_seconds(run: Run) -> dict[int, float]:
    """Per step, the slowest rank's step time: a synchronous step ends when its last rank
    does."""
    by_step: dict[int, float] = {}
    for e in run.history("step"):
        by_step[e["step"]] = max(by_step.get(e["step"], 0.0), e["step_s"])
    return by_step


def step_seconds(run: Run, skip: int = 2) -> float:
    """Median over steps (the first `skip` left out: allocation, first-touch) of the slowest
    rank's step time."""
    return statistics.median(step_samples(run, skip))


def step_samples(run: Run, skip: int = 2) -> list[float]:
    """Every step's time (the slowest rank's), the first `skip` left out: the repeats a timed
    claim reads (distlab.lab.timed)."""
    by_step = slowest_rank_seconds(run)
    return [s for step, s in sorted(by_step.items()) if step >= skip] or list(by_step.values())


def tokens_per_step(run: Run) -> int:
    """Tokens the whole job trains per step (every rank's rows)."""
    return run.cfg.global_batch * run.cfg.seq_len


def scaling_rows(runs: dict[int, Run]) -> list[dict]:
    """Per world size: step seconds, tokens/s, and efficiency against world 1."""
    base = tokens_per_step(runs[min(runs)]) / step_seconds(runs[min(runs)]) / min(runs)
    out = []
    for w, run in sorted(runs.items()):
        tps = tokens_per_step(run) / step_seconds(run)
        out.append({"world": w, "step_s": step_seconds(run), "tokens_per_s": tps,
                    "efficiency": tps / (w * base)})
    return out


def scaling_figure(rows: list[dict]) -> go.Figure:
    worlds = [r["world"] for r in rows]
    one = rows[0]["tokens_per_s"] / rows[0]["world"]
    fig = go.Figure()
    fig.add_bar(x=[str(w) for w in worlds], y=[r["tokens_per_s"] for r in rows],
                name="measured", marker_color=RUN_COLORS[0],
                text=[f"{r['efficiency']:.0%}" for r in rows], textposition="outside")
    fig.add_scatter(x=[str(w) for w in worlds], y=[one * w for w in worlds],
                    name="ideal (N × one)",
                    mode="lines+markers", line=dict(color=RUN_COLORS[-1], dash="dash"))
    fig.update_layout(template="plotly_white",
                      title=f"Throughput against ranks ({os.cpu_count()} cores; bar labels: "
                            "scaling efficiency)", xaxis_title="ranks (one thread each)",
                      yaxis_title="tokens / s", height=380, width=720,
                      legend=dict(x=1.02, y=1, xanchor="left"))
    return fig


def predict_seconds(step_s: float, steps: int) -> float:
    """The interview's recipe: time per step × steps per epoch × epochs (here: × steps)."""
    return step_s * steps


def trained_seconds(run: Run) -> float:
    """What a run's steps took, start of its first step to end of its last: the sum over steps
    of the slowest rank's step time."""
    return sum(slowest_rank_seconds(run).values())


def cluster_days(n_params: float, tokens: float, gpus: int, peak: float, mfu: float,
                 efficiency: float) -> float:
    """Days for 6·N·D FLOPs (Kaplan et al. 2020) on `gpus` GPUs each reaching mfu·peak alone,
    the job reaching `efficiency` of gpus × that (modelled: a formula, its inputs named)."""
    return 6 * n_params * tokens / (gpus * peak * mfu * efficiency) / DAY


def check_prediction(short: Run, steps: int) -> dict:
    """Predict the training time of `steps` steps of `short`'s config from its median step,
    then run them and measure: the interview's recipe, tested."""
    step_s = step_seconds(short)
    long = launch(short.cfg.replace(steps=steps, name=f"{short.cfg.name}-long")).wait()
    times = sorted(e["step_s"] for e in short.history("step", rank=0))
    return {"predicted_s": predict_seconds(step_s, steps), "measured_s": trained_seconds(long),
            "step_s": step_s, "steps": steps, "run": long,
            # the short run's spread: the 10th to 90th percentile of its steps, over the median
            "spread": (times[int(0.9 * (len(times) - 1))] - times[int(0.1 * (len(times) - 1))])
            / step_s}


def prediction_errors(short: Run, steps: int, repeats: int) -> dict:
    """check_prediction `repeats` times: the first from `short`, each further one from a fresh
    short run of the same config; "errors" holds measured / predicted − 1 per repeat (each
    prediction is tested against the long run that follows its short run)."""
    preds = [check_prediction(short, steps)]
    for i in range(1, repeats):
        again = launch(short.cfg.replace(name=f"{short.cfg.name}-again{i}")).wait()
        preds.append(check_prediction(again, steps))
    return {**preds[0], "errors": [p["measured_s"] / p["predicted_s"] - 1 for p in preds],
            "repeats": repeats}


def fusion_runs(base: RunConfig) -> dict:
    """Horovod's Tensor Fusion is DDP's bucketing: the same `ddp` run with buckets capped at
    1 KiB (close to HOROVOD_FUSION_THRESHOLD=0, one all-reduce per small group of tensors)
    and at 25 MiB (all of this model's gradients in one), in one launch. Returns per label the
    all-reduce calls and bytes of rank 0's last step and its median step time."""
    from distlab.lab.runs import launch_together
    runs = launch_together({"buckets of 1 KiB": base.replace(bucket_mb=1 / 1024),
                            "buckets of 25 MiB": base.replace(bucket_mb=25.0)}, name="fusion")
    out = {}
    for label, run in runs.items():
        last = run.history("step", rank=0)[-1]["comm"]["all_reduce"]
        out[label] = {"calls": last["calls"], "bytes": last["bytes_sent"],
                      "step_s": step_seconds(run)}
    return out
