"""Random field values: every one is either refused before any process starts, with a
ValueError that names the field, or the run starts and ends cleanly (Hypothesis).

Each example changes one to three fields of a small config to values drawn from every kind a
user might type: integers (negative, zero, huge), floats (nan, inf, tiny, huge), strings (valid
choices, numbers as text, junk), booleans and None. A config RunConfig and launch() accept is
run: it must end "done" (or, for a long run, stop cleanly after its first step), never with a
rank's error, because any input a rank would fail on should have been refused at the door.
"""

import dataclasses
import math
import re

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from distlab import RunConfig, launch
from distlab.caller.run import RunError

BASE = dict(steps=2, global_batch=4, seq_len=8, n_layer=1, n_embd=16, n_head=2, timeout_s=30)
FIELDS = [f.name for f in dataclasses.fields(RunConfig)
          if f.name not in ("runs_root", "name", "save_final", "checkpoint_dir")]
# values of every kind; a few valid ones so that some examples are accepted and run
VALUES = st.one_of(
    st.integers(-3, 5), st.sampled_from([0, 1, 2, 4, 10 ** 9, 2 ** 62]),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e-12, 1e30, 0.5]),
    st.sampled_from(["", "abc", "1", "0.1", "none", "ddp", "zero2", "bf16", "fp16", "auto",
                     "gloo", "topk", "raise", "1f1b", "sgd", "full", "selective", "bnnet"]),
    st.booleans(), st.none())


def _names_a_field(message: str) -> bool:
    return any(re.search(rf"\b{f}\b", message) for f in FIELDS + ["runs_root"])


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(FIELDS), VALUES, min_size=1, max_size=3))
def test_random_values_are_refused_with_the_field_named_or_run_cleanly(tmp_path_factory, change):
    root = str(tmp_path_factory.mktemp("runs"))
    try:
        cfg = RunConfig(**{**BASE, **change, "runs_root": root})
        run = launch(cfg)
    except ValueError as e:
        assert _names_a_field(str(e)), f"{change}: {e}"
        event("refused")
        return
    event("accepted and run")
    try:
        run.wait(timeout=90)
    except TimeoutError:  # a long run: it started, so stop it and check it ends cleanly
        run.stop()
        assert run.status == "stopped", (change, run.status)
        return
    except RunError as e:
        if cfg.fault != "none":  # a fault on purpose: its own error is the clean outcome
            return
        pytest.fail(f"{change} was accepted but failed in a rank: {e}")
    assert run.status == "done", (change, run.status)
