"""Bring docs/interview_index.md's quoted report rows up to a regenerated claims report.

    .venv/bin/python tools/index_quotes.py                 # rewrite the page from the report
    .venv/bin/python tools/index_quotes.py --check         # only list what would change

The page quotes rows of reports/claims-full.json word for word ("NB — claim: `…` — figure:
`…` — held: …"), and tests/test_interview_index.py fails when a quote is not a row of the
report. After tools/claims_report.py has run again, every figure may have moved. This script
finds each quoted row's claim in the new report (by its claim text, in the notebook the page
names when two notebooks test the same claim; a row that moved to another notebook is found
there too), rewrites its notebook, figure and verdict, and updates
the page's report date and commit line. It prints every verdict that changed, because an
entry's own verdict on the answer ("right", "wrong") is prose someone must read again: the
script never touches it. A quoted claim that is gone from the report, or that two notebooks
share, is listed and left as it was.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "interview_index.md"
REPORT = ROOT / "reports" / "claims-full.json"

_QUOTED = r"(?:`` (.+?) ``|`([^`]+)`)"
ROW = re.compile(rf"(\S+) — claim: {_QUOTED} — figure: {_QUOTED} — held: "
                 r"(yes|no|undecided on this machine|not measured here)$")


def held(row: dict) -> str:
    """A report row's verdict as the page quotes it (tests/test_interview_index.py's rule)."""
    if row["holds"] is None:
        return "undecided on this machine" if row["basis"] == "timed" else "not measured here"
    return "yes" if row["holds"] else "no"


def quote(text: str) -> str:
    """A Markdown code span for text: double backticks where the text holds one itself."""
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def rows_by_claim(report: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for nb in report["notebooks"]:
        for r in nb["rows"]:
            out.setdefault(r["claim"], []).append(r)
    return out


def refresh(page: str, report: dict) -> tuple[str, list[str], list[str]]:
    """(the new page, verdicts that changed, quotes left alone and why)."""
    by_claim = rows_by_claim(report)
    changed, left = [], []
    lines = []
    for line in page.splitlines(keepends=True):
        body = line.rstrip("\n")
        m = ROW.search(body)
        if not m:
            lines.append(line)
            continue
        nb, c1, c2, _f1, _f2, old = m.groups()
        claim = c1 or c2
        found = by_claim.get(claim, [])
        if len(found) > 1:  # two notebooks test the same claim: the one the page names
            found = [r for r in found if r["notebook"] == nb] or found
        if len(found) != 1:
            left.append(f"{nb} — {claim}: " + ("not in the report" if not found else
                                                f"in {len(found)} rows"))
            lines.append(line)
            continue
        row = found[0]
        new = (f"{row['notebook']} — claim: {quote(claim)} — figure: {quote(row['figure'])} — "
               f"held: {held(row)}")
        if held(row) != old:
            changed.append(f"{row['notebook']} — {claim}: {old} -> {held(row)}")
        lines.append(body[:m.start()] + new + line[len(body):])
    return "".join(lines), changed, left


def report_line(page: str, report: dict) -> str:
    """The page's words naming the report's date and commit ("dated 2026-11-26 05:44 UTC, at
    commit 671a358"), set to this report's. Notebooks rerun on their own (--merge) are named
    in the prose beside it: that sentence is the reader's to fix, and main() says so."""
    return re.sub(r"dated \d{4}-\d\d-\d\d \d\d:\d\d UTC, at commit [^,]+",
                  f"dated {report['date']}, at commit {report['commit']}", page, count=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="list the changes, write nothing")
    ap.add_argument("--report", type=Path, default=REPORT)
    args = ap.parse_args()
    report = json.loads(args.report.read_text())
    page = PAGE.read_text()
    new, changed, left = refresh(page, report)
    new = report_line(new, report)
    for c in changed:
        print("verdict changed:", c)
    for c in left:
        print("left as it was:", c)
    for nb, commit, date in report.get("separate", []):
        print(f"the report holds {nb} from a run of its own ({commit}, {date}): check that "
              "the page's report paragraph says so")
    if not args.check and new != page:
        PAGE.write_text(new)
        print(f"rewrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
