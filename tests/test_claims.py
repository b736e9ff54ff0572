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
    good = buffer_broadcast_claim(_buffers(0.0), _buffers(0.25))
    bad = buffer_broadcast_claim(_buffers(1e-3), _buffers(0.25))
    assert good["holds"] is True and bad["holds"] is False
    assert good["figure"] != bad["figure"] and "1.00e-03" in bad["figure"]
    # without the broadcast the ranks must differ, or the comparison shows nothing
    assert buffer_broadcast_claim(_buffers(0.0), _buffers(0.0))["holds"] is False


def _strag(allreduce, ps_sync, backup):
    row = lambda u: {"update_s": u, "dropped": 3}  # noqa: E731
    return {"allreduce": row(allreduce), "ps-sync": row(ps_sync),
            "ps-sync + 1 backup": row(backup)}


def test_straggler_row_follows_the_measurement_and_its_yardstick():
    waits = _strag(0.21, 0.22, 0.01)
    assert straggler_claim(waits, noise_s=0.01, delay_s=0.2)["holds"] is True
    # the backup run waited too: no
    assert straggler_claim(_strag(0.21, 0.22, 0.2), 0.01, 0.2)["holds"] is False
    # a delay that does not dwarf the no-delay run's time between updates cannot be judged
    noisy = straggler_claim(waits, noise_s=0.05, delay_s=0.2)
    assert noisy["holds"] is False and "too close to judge" in noisy["figure"]


def test_dp_vs_ddp_row_is_the_measured_ratio():
    fast, slow = dp_vs_ddp_claim(0.02, 0.01, 4, 2), dp_vs_ddp_claim(0.01, 0.02, 4, 2)
    assert fast["holds"] is True and "2.00×" in fast["figure"]
    assert slow["holds"] is False and "0.50×" in slow["figure"]


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
