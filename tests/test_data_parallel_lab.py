"""02's companion (distlab.lab.data_parallel) on made-up inputs of the shape the runs log: the
DDP timeline shows every bucket's all-reduce (a bar, or a marker and a named note when it was
over before its issuing call returned), the lr-rule figure keeps each panel to a few lines of
distinct colours, and expected_divergence takes the one warning it is meant for and no other.
No launches."""

from __future__ import annotations

import math
import warnings

import pytest

from distlab.lab.data_parallel import (done_when_issued, bucket_timeline, expected_divergence,
                                       scaling_figure)


def _event(spans):
    """A step event whose buckets have (ready, start, done) in seconds."""
    return {"step": 3, "rank": 0, "ddp": {
        "backward": [0.0, 0.160], "overlap": 0.5, "comm_s": 0.1, "hidden_s": 0.05,
        "buckets": [{"index": i, "params": 2, "bytes": 1000, "ready": r, "start": s, "done": d,
                     "waited": 0.165} for i, (r, s, d) in enumerate(spans)]}}


def test_a_bucket_done_before_its_issuing_call_returned_is_marked_and_named():
    # measured in full mode (02's GPT, 4 ranks, 0.25 MiB buckets): buckets 0 and 2 done
    # 0.015-0.06 ms after the call returned, under a pixel of a 200 ms axis
    event = _event([(0.0013, 0.0124, 0.012487), (0.0137, 0.0185, 0.040),
                    (0.020, 0.0296, 0.029620), (0.150, 0.164, 0.202)])
    assert done_when_issued(event) == [0, 2]
    fig = bucket_timeline(event)
    names = [t.name for t in fig.data]
    done = fig.data[names.index("all-reduce done")]
    assert list(done.x) == pytest.approx([12.487, 40.0, 29.62, 202.0])  # every bucket's end
    light = fig.data[names.index("ready → issued (its turn, then the call that issues it)")]
    assert list(light.base) == pytest.approx([1.3, 13.7, 20.0, 150.0])
    assert "buckets 0, 2: all-reduce already done" in fig.layout.title.text
    # none such: no note
    assert "already done" not in bucket_timeline(_event([(0.001, 0.002, 0.030)])).layout.title.text


def _curves():
    out = []
    for batch, rules in ((8, ["none"]), (32, ["none", "linear", "sqrt", "inverse"]),
                         (128, ["none", "linear", "sqrt", "inverse"])):
        for rule in rules:
            for w in (0, 15):
                k = batch / 8
                lr = 0.1 * {"none": 1, "linear": k, "sqrt": math.sqrt(k), "inverse": 1 / k}[rule]
                out.append({"label": f"B={batch} {rule} lr={lr:.3g}", "batch": batch,
                            "rule": rule, "warmup_steps": w, "lr": lr, "step": [0, 1, 2],
                            "samples": [batch, 2 * batch, 3 * batch], "loss": [4.1, 3.9, 3.7],
                            "loss_at_start": 4.16, "loss_floor": 1.0})
    return out


def test_the_lr_rule_figure_keeps_each_panel_to_a_few_lines_of_distinct_colours():
    fig = scaling_figure(_curves())  # 18 runs: 36 lines in two panels before
    panels = {}
    for t in fig.data:
        panels.setdefault((t.xaxis, t.yaxis), []).append(t)
    assert len(panels) == 8  # 4 rules x (vs step, vs samples)
    for lines in panels.values():
        assert len(lines) <= 10
        styles = [(t.line.color, t.line.dash) for t in lines]
        assert len(set(styles)) == len(styles)  # no two lines look alike
        assert len({t.line.color for t in lines}) == len(lines) // 2  # a colour per batch
    assert sum(bool(t.showlegend) for t in fig.data) == 6  # batch x warm-up, once each


def test_expected_divergence_takes_the_nan_note_and_passes_everything_else_on():
    nan = ("run 20260101-x: the loss was nan at step 26 on rank 0 (34 step events in all): "
           "RunConfig(detect_nan=True) names the step, the rank and the module (or the input "
           "batch) where it was born")
    both = ("run 20260101-y: rank 1 could not write 2 event(s); the loss was inf at step 3 on "
            "rank 1 (1 step events in all): RunConfig(detect_nan=True) names the step")
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        with expected_divergence() as noted:
            warnings.warn(nan, RuntimeWarning)
            warnings.warn(both, RuntimeWarning)
            warnings.warn("the loss was nan at step 1 on rank 0 (1 step events in all)",
                          UserWarning)  # not the Run's category: passed on
            warnings.warn("something else", RuntimeWarning)
    assert noted == ["the loss was nan at step 26 on rank 0 (34 step events in all)",
                     "the loss was inf at step 3 on rank 1 (1 step events in all)"]
    assert [str(w.message) for w in outside] == [
        "run 20260101-y: rank 1 could not write 2 event(s)",
        "the loss was nan at step 1 on rank 0 (1 step events in all)", "something else"]
