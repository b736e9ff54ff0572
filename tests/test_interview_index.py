"""docs/interview_index.md maps every interview question the workbook answers to a notebook
section, an evidence kind, the claims-report rows that back it and a verdict.

These checks are static and fast (no processes, no notebook execution). They fail when:

* a link points at a workbook notebook that does not exist, or at an anchor that is no
  Markdown heading of that notebook (JupyterLab/nbconvert anchors: the heading's rendered
  text, spaces as '-');
* a quoted claims-report row (notebook, claim, figure, held) is not a row of
  reports/claims-full.json, or the page's report date or commit is not the report's;
* an entry lacks a field, has an unknown evidence kind or verdict, links while saying "not
  yet answered", or a set's ids skip a question;
* the page names the question sets' private folder ("shared/", "/work/");
* a report row that reads no (or undecided) is quoted nowhere: neither under the question it
  bears on nor in the page's findings section.

Each checker returns a list of problems; test_checkers_catch_broken_lines feeds them broken
lines to show they can fail.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "interview_index.md"
REPORT = ROOT / "reports" / "claims-full.json"
WORKBOOK = ROOT / "workbook"

# questions per set: 20 + 20 + (5 questions + 5 production cases) twice + 8 (5 questions,
# 2 follow-ups, 1 production case)
SET_SIZES = {"A": 20, "B": 20, "C": 10, "D": 10, "E": 8}
EVIDENCE = {"measured", "modelled", "prose", "none"}
VERDICTS = {"right", "imprecise", "wrong"}
FORBIDDEN = ("shared/", "/work/")

ENTRY = re.compile(r"^- \*\*([A-Z]\d+)\*\* — (\S.*)$")
FIELD = re.compile(r"^  - (answered in|evidence|report|verdict|not answered here): (.*)$")
# a quoted field: `text`, or ``text`` (a Markdown code span that holds backticks itself)
_QUOTED = r"(?:`` (.+?) ``|`([^`]+)`)"
REPORT_ROW = re.compile(rf"^(\S+) — claim: {_QUOTED} — figure: {_QUOTED} — held: "
                        r"(yes|no|undecided on this machine|not measured here)$")


# --- anchors ---------------------------------------------------------------------------------

def anchor(heading: str) -> str:
    """JupyterLab's and nbconvert's id for a heading: its rendered text (inline-code backticks
    are markup, not text) with every space replaced by '-'."""
    return heading.strip().replace("`", "").replace(" ", "-")


def markdown_headings(markdown: str) -> list[str]:
    """ATX headings (# to ######) of one Markdown cell, outside fenced code blocks."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = re.match(r"^(#{1,6})\s+(.+?)\s*#*\s*$", line)
        if m and not fenced:
            out.append(m.group(2))
    return out


def notebook_anchors(path: pathlib.Path) -> set[str]:
    nb = json.loads(path.read_text(encoding="utf-8"))
    anchors = set()
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "markdown":
            src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            anchors |= {anchor(h) for h in markdown_headings(src)}
    return anchors


# --- links -----------------------------------------------------------------------------------

def links(text: str) -> list[str]:
    """Destinations of inline Markdown links; a destination may hold balanced parentheses
    (an anchor such as '2.-(a)-Same-training-as-one-process')."""
    out, i = [], 0
    while (j := text.find("](", i)) != -1:
        k, depth = j + 2, 1
        while k < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[k], 0)
            k += 1
        out.append(text[j + 2:k - 1])
        i = k
    return out


def check_link(dest: str, anchors_of) -> list[str]:
    """Problems with one link destination; anchors_of(path) gives a notebook's anchors."""
    if not dest.startswith("../workbook/"):
        return []
    path, _, frag = dest.partition("#")
    file = (PAGE.parent / path).resolve()
    if not file.name.endswith(".ipynb"):
        return [f"{dest}: links a workbook file that is not a notebook"]
    if not file.exists():
        return [f"{dest}: {path} does not exist"]
    if not frag:
        return [f"{dest}: no section anchor"]
    if frag not in anchors_of(file):
        return [f"{dest}: no heading of {file.name} has the anchor '{frag}'"]
    return []


# --- report rows -----------------------------------------------------------------------------

def held(row: dict) -> str:
    """A report row's verdict as the page quotes it."""
    if row["holds"] is None:  # a timed row whose spreads overlap, or one only a GPU answers
        return "undecided on this machine" if row["basis"] == "timed" else "not measured here"
    return "yes" if row["holds"] else "no"


def report_rows(report: dict) -> set[tuple[str, str, str, str]]:
    return {(r["notebook"], r["claim"], r["figure"], held(r))
            for nb in report["notebooks"] for r in nb["rows"]}


def quoted_row(value: str) -> tuple | None:
    """(notebook, claim, figure, held) of a quoted report line, or None."""
    m = REPORT_ROW.match(value)
    if not m:
        return None
    nb, c1, c2, f1, f2, verdict = m.groups()
    return nb, c1 or c2, f1 or f2, verdict


def check_report_line(value: str, rows: set) -> list[str]:
    got = quoted_row(value)
    if got is None:
        return [f"report line not in the form 'NB — claim: `…` — figure: `…` — held: yes|no': {value}"]
    if got not in rows:
        return [f"not a row of reports/claims-full.json (notebook, claim, figure, held): {value}"]
    return []


# --- entries ---------------------------------------------------------------------------------

def parse_entries(text: str) -> dict[str, dict]:
    entries, current = {}, None
    for line in text.splitlines():
        if m := ENTRY.match(line):
            if m.group(1) in entries:
                raise ValueError(f"{m.group(1)} is listed twice")
            current = entries[m.group(1)] = {"question": m.group(2), "report": []}
        elif current is not None and (f := FIELD.match(line)):
            key, value = f.groups()
            if key == "report":
                current["report"].append(value)
            else:
                current[key] = value
        elif not line.startswith("  "):
            current = None
    return entries


def check_entry(eid: str, e: dict) -> list[str]:
    problems = []
    for key in ("answered in", "evidence", "verdict"):
        if key not in e:
            problems.append(f"{eid}: no '{key}' line")
    if problems:
        return problems
    answered = e["answered in"]
    kind = e["evidence"].split()[0]
    if kind not in EVIDENCE:
        problems.append(f"{eid}: evidence '{kind}' is none of {sorted(EVIDENCE)}")
    if kind == "modelled" and len(e["evidence"].split()) < 3:
        problems.append(f"{eid}: modelled evidence must name its source")
    if answered == "not yet answered":
        if kind != "none" or e["report"]:
            problems.append(f"{eid}: not yet answered, yet evidence '{kind}' or a report row")
    elif "](../workbook/" not in answered:
        problems.append(f"{eid}: 'answered in' has no workbook link: {answered}")
    elif kind == "none":
        problems.append(f"{eid}: linked, but evidence 'none'")
    verdict = re.split(r"[\s(—]", e["verdict"], maxsplit=1)[0]
    if verdict not in VERDICTS or " — " not in e["verdict"]:
        problems.append(f"{eid}: verdict must be one of {sorted(VERDICTS)}, then ' — ' and why")
    return problems


def check_ids(ids) -> list[str]:
    problems = []
    for letter, n in SET_SIZES.items():
        want = {f"{letter}{i}" for i in range(1, n + 1)}
        have = {i for i in ids if i[0] == letter}
        if want - have:
            problems.append(f"set {letter}: no entry for {sorted(want - have)}")
        if have - want:
            problems.append(f"set {letter}: unknown ids {sorted(have - want)}")
    return problems


def check_forbidden(text: str) -> list[str]:
    return [f"the page names '{s}'" for s in FORBIDDEN if s in text]


# --- the page --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def page() -> str:
    assert PAGE.exists(), "docs/interview_index.md is missing"
    return PAGE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads(REPORT.read_text(encoding="utf-8"))


_ANCHORS: dict[pathlib.Path, set[str]] = {}


def cached_anchors(path: pathlib.Path) -> set[str]:
    if path not in _ANCHORS:
        _ANCHORS[path] = notebook_anchors(path)
    return _ANCHORS[path]


def test_page_says_why_it_is_markdown(page):
    intro = page.split("\n## ", 1)[0]
    assert "GitHub" in intro and "JupyterLab" in intro and "static site" in intro


def test_page_does_not_name_the_private_folder(page):
    assert not check_forbidden(page)


def test_every_link_reaches_a_notebook_heading(page):
    dests = [d for d in links(page) if d.startswith("../workbook/")]
    assert len(dests) >= len(SET_SIZES), "hardly any workbook links: was the page parsed?"
    problems = [p for d in dests for p in check_link(d, cached_anchors)]
    assert not problems, "\n".join(problems)


def test_every_question_has_a_complete_entry(page):
    entries = parse_entries(page)
    problems = check_ids(entries) + [p for i, e in entries.items() for p in check_entry(i, e)]
    assert not problems, "\n".join(problems)


def test_cited_rows_are_the_reports(page, report):
    rows = report_rows(report)
    entries = parse_entries(page)
    cited = [v for e in entries.values() for v in e["report"]]
    assert cited, "no report rows cited"
    problems = [p for v in cited for p in check_report_line(v, rows)]
    assert not problems, "\n".join(problems)
    head = page.split("\n## ", 1)[0]
    assert report["date"] in head and str(report["commit"]) in head, (
        f"the page's report date/commit is not the report's ({report['date']}, {report['commit']})")


FINDINGS = "\n## The workbook's own findings"


def uncited_findings(page: str, rows: set) -> list[str]:
    """Report rows that read no (or could not be decided) and that the page quotes nowhere:
    neither in an entry's report lines nor in its findings section. A rule that failed is news,
    so every such row must be cited by the question it bears on or listed as a finding."""
    quoted = set()
    for line in page.splitlines():
        m = re.match(r"^\s*- (?:report: )?(.*)$", line)
        if m and (q := quoted_row(m.group(1).strip())) is not None:
            quoted.add(q)
    return [f"{nb} — {claim}: reads {held}, cited nowhere" for nb, claim, figure, held
            in sorted(rows) if held != "yes" and (nb, claim, figure, held) not in quoted]


def arithmetic_cited(page: str, report: dict) -> list[str]:
    """Entries' report lines that quote a row with basis "arithmetic": constants and
    identities are shown for reading, never cited as evidence for an answer."""
    arithmetic = {(r["notebook"], r["claim"]) for nb in report["notebooks"] for r in nb["rows"]
                  if r.get("basis") == "arithmetic"}
    return [f"{i}: cites the arithmetic row {q[0]} — {q[1]}" for i, e in
            parse_entries(page).items() for v in e["report"]
            if (q := quoted_row(v)) is not None and (q[0], q[1]) in arithmetic]


def test_no_entry_cites_arithmetic_as_evidence(page, report):
    problems = arithmetic_cited(page, report)
    assert not problems, "\n".join(problems)


def test_every_row_that_does_not_hold_is_cited_or_a_finding(page, report):
    """A row that reads no is evidence against someone's answer or against a rule of ours: the
    index quotes it under the question it bears on, or in its findings section."""
    assert FINDINGS in page, "no section for the workbook's own findings"
    problems = uncited_findings(page, report_rows(report))
    assert not problems, "\n".join(problems)


def test_gaps_list_every_unanswered_question(page):
    entries = parse_entries(page)
    gaps = page.split("\n## Gaps", 1)
    assert len(gaps) == 2, "no 'Gaps' section"
    for eid, e in entries.items():
        if e.get("answered in") == "not yet answered" or e.get("not answered here"):
            assert f"**{eid}**" in gaps[1], f"{eid} has a gap the Gaps section does not list"


def test_coverage_line_counts_the_entries(page):
    entries = parse_entries(page)
    kinds = [e["evidence"].split()[0] for e in entries.values()]
    m = re.search(r"Coverage: (\d+) questions: (\d+) answered with measured evidence, (\d+) "
                  r"modelled, (\d+) prose, (\d+) not yet answered", page)
    assert m, "no coverage line"
    assert tuple(int(x) for x in m.groups()) == (
        len(entries), kinds.count("measured"), kinds.count("modelled"), kinds.count("prose"),
        kinds.count("none"))


# --- the checkers can fail -------------------------------------------------------------------

def test_anchor_is_jupyterlabs():
    assert anchor("## 3. DDP: buckets all-reduced during backward".lstrip("# ")) == \
        "3.-DDP:-buckets-all-reduced-during-backward"
    assert anchor("3. From a terminal: `python -m distlab`, and torchrun") == \
        "3.-From-a-terminal:-python--m-distlab,-and-torchrun"
    assert markdown_headings("text\n```\n# not a heading\n```\n### 7.1 GPT-3's 64 × 8 × 8") == \
        ["7.1 GPT-3's 64 × 8 × 8"]
    assert links("[a](../workbook/x.ipynb#2.-(a)-Same) and [b](y.md)") == \
        ["../workbook/x.ipynb#2.-(a)-Same", "y.md"]


def test_checkers_catch_broken_lines(report):
    nb = "../workbook/02_data_parallel.ipynb"
    assert check_link(f"{nb}#7.-Stragglers", cached_anchors) == []
    assert check_link(f"{nb}#7.-Stragglerz", cached_anchors), "a wrong anchor passed"
    assert check_link(f"{nb}#7. Stragglers", cached_anchors), "an anchor with a space passed"
    assert check_link(nb, cached_anchors), "a link without an anchor passed"
    assert check_link("../workbook/99_missing.ipynb#Intro", cached_anchors), "a missing file passed"

    rows = report_rows(report)
    nbname, claim, figure, held = sorted(rows)[0]
    good = f"{nbname} — claim: `{claim}` — figure: `{figure}` — held: {held}"
    assert check_report_line(good, rows) == []
    assert check_report_line(good.replace(claim, claim + " (edited)"), rows), "an edited claim passed"
    assert check_report_line(good.replace(f"held: {held}", "held: " + ("no" if held == "yes" else "yes")),
                             rows), "a flipped verdict passed"
    assert check_report_line(good.replace(figure, figure[:-1]), rows), "a truncated figure passed"
    assert check_report_line(f"{nbname} — {claim}", rows), "a malformed line passed"
    row = ("01_collectives", "a rule", "a figure", "no")
    said = f"- 01_collectives — claim: `a rule` — figure: `a figure` — held: no"
    assert uncited_findings("", {row}), "an uncited row that reads no passed"
    assert uncited_findings(said, {row}) == []
    assert uncited_findings("", {row[:3] + ("yes",)}) == []  # rows that hold need no citation
    fake = {"notebooks": [{"rows": [{"notebook": "01_collectives", "claim": "a rule",
                                     "figure": "a figure", "holds": False,
                                     "basis": "arithmetic"}]}]}
    entry = "- **A1** — a question\n  - report: " + said[2:]
    assert arithmetic_cited(entry, fake), "an entry citing an arithmetic row passed"

    broken = "\n".join([
        "- **A1** — a question",
        "  - answered in: not yet answered",
        "  - evidence: measured",
        "  - verdict: right — because",
        "- **A2** — a question",
        "  - answered in: [x](../workbook/02_data_parallel.ipynb#7.-Stragglers)",
        "  - evidence: guessed",
        "  - verdict: maybe",
        "- **A2** — listed twice",
    ])
    with pytest.raises(ValueError):
        parse_entries(broken)
    entries = parse_entries(broken.rsplit("\n", 1)[0])
    assert check_entry("A1", entries["A1"]), "not yet answered with evidence 'measured' passed"
    assert len(check_entry("A2", entries["A2"])) == 2, "a bad evidence kind and verdict passed"
    assert check_ids(entries), "a set with 2 of 20 entries passed"
    assert all(check_forbidden(f"see {s}x") for s in FORBIDDEN)


def test_index_quotes_follow_a_regenerated_report():
    """tools/index_quotes.py: a quoted row whose figure, verdict and notebook moved is rewritten
    from the new report and its verdict change listed; a claim gone from it is left and named."""
    import sys
    sys.path.insert(0, str(ROOT / "tools"))
    import index_quotes
    page = ("  - report: 17_multi_node — claim: `a` — figure: `old 1` — held: yes\n"
            "  - report: 17_multi_node — claim: `` b `x` `` — figure: `old 2` — held: no\n"
            "- 03_memory — claim: `gone` — figure: `f` — held: no\n")
    report = {"notebooks": [{"rows": [
        {"notebook": "18_across_nodes", "claim": "a", "figure": "new 1", "holds": None,
         "basis": "timed"},
        {"notebook": "17_multi_node", "claim": "b `x`", "figure": "new `2`", "holds": False,
         "basis": "measured"}]}]}
    new, changed, left = index_quotes.refresh(page, report)
    lines = new.splitlines()
    assert lines[0] == ("  - report: 18_across_nodes — claim: `a` — figure: `new 1` — held: "
                        "undecided on this machine")
    assert lines[1] == ("  - report: 17_multi_node — claim: `` b `x` `` — figure: `` new `2` `` — "
                        "held: no")
    assert lines[2] == page.splitlines()[2]
    assert changed == ["18_across_nodes — a: yes -> undecided on this machine"]
    # the same claim in two notebooks: each quote keeps its own notebook's row
    report["notebooks"].append({"rows": [
        {"notebook": "06_pipe", "claim": "c", "figure": "six", "holds": True, "basis": "timed"},
        {"notebook": "07_3d", "claim": "c", "figure": "seven", "holds": True, "basis": "timed"}]})
    twice = ("- 07_3d — claim: `c` — figure: `old` — held: yes\n"
             "- 06_pipe — claim: `c` — figure: `old` — held: yes\n")
    both, _, left_twice = index_quotes.refresh(twice, report)
    assert "`seven`" in both.splitlines()[0] and "`six`" in both.splitlines()[1]
    assert not left_twice
    assert left == ["03_memory — gone: not in the report"]
    for line in lines[:2]:  # what it writes is what the page's checker reads
        assert quoted_row(line.split("report: ", 1)[1]) is not None


def uncited_interview_rows(page: str, report: dict) -> list[str]:
    """Report rows that test an interview answer (the claim or its source says so) and that the
    page quotes nowhere: such a row bears on a question, so an entry cites it (or, reading no,
    the findings section does)."""
    quoted = set()
    for line in page.splitlines():
        m = re.match(r"^\s*- (?:report: )?(.*)$", line)
        if m and (q := quoted_row(m.group(1).strip())) is not None:
            quoted.add((q[0], q[1]))
    return [f"{r['notebook']} — {r['claim']}: an interview answer's row, cited nowhere"
            for nb in report["notebooks"] for r in nb["rows"]
            if "interview answer" in r["claim"] + r["source"]
            and (r["notebook"], r["claim"]) not in quoted]


def test_every_row_on_an_interview_answer_is_cited(page, report):
    problems = uncited_interview_rows(page, report)
    assert not problems, "\n".join(problems)


def test_the_interview_row_check_can_fail(report):
    row = next(r for nb in report["notebooks"] for r in nb["rows"]
               if "interview answer" in r["claim"] + r["source"])
    assert uncited_interview_rows("no quotes here", report)
    assert any(row["claim"] in p for p in uncited_interview_rows("", report))
