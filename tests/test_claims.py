"""Claims tables: a row's figure and verdict come from the measurement, and can say no.

distlab.lab.common.claim refuses a verdict that is not a bool, and the companions' row builders
(here notebook 02's) turn different measurements into different figures and verdicts.
"""

import pytest

from distlab.lab.common import claim, claims_markdown
from distlab.lab.data_parallel import buffer_broadcast_claim, dp_vs_ddp_claim, straggler_claim


def test_claim_refuses_a_verdict_that_is_not_a_bool():
    for bad in ("yes", 1, None, "no", 0.0):
        with pytest.raises(TypeError):
            claim("c", "s", "f", bad)
    with pytest.raises(ValueError):
        claim("c", "s", "f", True, basis="assumed")


def test_the_table_prints_the_computed_verdict():
    md = claims_markdown([claim("a", "s", "1", True), claim("b", "s", "2", False, "modelled")])
    assert "| a | s | 1 | measured | yes |" in md
    assert "| b | s | 2 | modelled | **no** |" in md


def _buffers(spread, steps=5):
    return {"steps": steps, "max_spread": spread}


def test_buffer_broadcast_row_follows_the_measurement():
    good = buffer_broadcast_claim(_buffers(0.0), _buffers(0.25), _buffers(0.0))
    bad = buffer_broadcast_claim(_buffers(1e-3), _buffers(0.25), _buffers(0.0))
    assert good["holds"] is True and bad["holds"] is False
    assert good["figure"] != bad["figure"] and "1.00e-03" in bad["figure"]
    # without the broadcast the ranks must differ, or the comparison shows nothing
    assert buffer_broadcast_claim(_buffers(0.0), _buffers(0.0), _buffers(0.0))["holds"] is False
    # torch's DDP is measured beside ours: its ranks differing says no too
    torch_apart = buffer_broadcast_claim(_buffers(0.0), _buffers(0.25), _buffers(2e-3))
    assert torch_apart["holds"] is False and "torch's DDP 2.00e-03" in torch_apart["figure"]


def _strag(allreduce, ps_sync, backup):
    # each layout's times between updates: five repeats around the given seconds
    def row(u):
        return {"update_samples_s": [u * f for f in (0.97, 0.99, 1, 1.01, 1.03)], "dropped": 3}
    return {"allreduce": row(allreduce), "ps-sync": row(ps_sync),
            "ps-sync + 1 backup": row(backup)}


def test_straggler_row_is_timed_over_the_updates():
    waits = _strag(0.21, 0.22, 0.01)
    row = straggler_claim(waits, delay_s=0.2)
    assert row["holds"] is True and row["basis"] == "timed"
    # the backup run waited too: no
    assert straggler_claim(_strag(0.21, 0.22, 0.2), 0.2)["holds"] is False
    # the synchronous updates straddle 0.9 × the delay: undecided
    assert straggler_claim(_strag(0.18, 0.22, 0.01), 0.2)["holds"] is None
    # two updates per layout are too few to decide
    few = {k: {**r, "update_samples_s": r["update_samples_s"][:2]} for k, r in waits.items()}
    assert straggler_claim(few, 0.2)["holds"] is None
    # the run without the delay is shown beside them
    shown = straggler_claim(waits, 0.2, {"update_samples_s": [0.01, 0.011, 0.012]})
    assert "allreduce without the delay" in shown["figure"]


def test_dp_vs_ddp_row_is_timed_over_the_steps():
    def steps(s):  # seven per-step samples around s seconds
        return [s * f for f in (0.95, 0.98, 0.99, 1, 1.01, 1.02, 1.1)]
    fast = dp_vs_ddp_claim(steps(0.02), steps(0.01), 4, 2)
    slow = dp_vs_ddp_claim(steps(0.01), steps(0.02), 4, 2)
    tied = dp_vs_ddp_claim(steps(0.0101), steps(0.01), 4, 2)
    assert fast["holds"] is True and "2.00×" in fast["figure"] and fast["basis"] == "timed"
    assert slow["holds"] is False and "0.50×" in slow["figure"]
    assert tied["holds"] is None  # the middle halves overlap: undecided on this machine
    assert dp_vs_ddp_claim(steps(0.02)[:2], steps(0.01)[:2], 4, 2)["holds"] is None
    assert "min / median / max of 7 repeats" in fast["figure"]


def test_a_claims_table_as_a_cells_last_line_shows_only_the_table(monkeypatch):
    # 12 (now 13) showed the rows again, as a raw list of dicts, under its first claims table
    # (issue 25): the table's function returned them, and a cell displays its last value
    from IPython.core.interactiveshell import InteractiveShell
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda *a, **k: shown.append(a))
    shell = InteractiveShell.instance()
    try:
        result = shell.run_cell("import distlab.lab.common as c\n"
                                "c.claims_table([c.claim('x', 'y', 'z', True)])")
    finally:
        InteractiveShell.clear_instance()
    assert result.success and result.result is None and len(shown) == 1
