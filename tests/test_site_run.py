"""tools/build_site.py tells one story: its claims page says it is the run every notebook page
shows only when each executed page started inside the report's own run (issue 43, item 3)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import build_site  # noqa: E402

REPORT = {"date": "2026-11-29 03:15 UTC", "seconds": 1214.8,
          "notebooks": [{"notebook": "00_start_here"}, {"notebook": "17_multi_node"}]}


def test_pages_inside_the_reports_run_are_that_run():
    assert build_site.from_report_run(REPORT, {"00_start_here": "2026-11-29 03:15 UTC",
                                               "17_multi_node": "2026-11-29 03:33 UTC"})


def test_a_page_from_another_run_or_without_times_is_not():
    later = {"00_start_here": "2026-11-29 03:15 UTC", "17_multi_node": "2026-11-29 04:10 UTC"}
    assert not build_site.from_report_run(REPORT, later)  # after the report's 1215 s
    earlier = {"00_start_here": "2026-11-29 02:54 UTC"}
    assert not build_site.from_report_run(REPORT, earlier)
    assert not build_site.from_report_run(REPORT, {"05_tensor_parallel": "2026-11-29 03:20 UTC"})
    assert not build_site.from_report_run(REPORT, {"00_start_here": None})
    assert not build_site.from_report_run(REPORT, {})
