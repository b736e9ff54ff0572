"""tools/claims_report.py on two tiny notebooks: one records a holding and a failing claim, one
raises. The tool's functions run them in real kernels (quick mode, no workbook notebook)."""

import hashlib
import importlib.util
import json
from pathlib import Path

import nbformat
import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "claims_report.py"


def load_tool():
    # tools/ is a folder of scripts, not a package: load the script by its path.
    spec = importlib.util.spec_from_file_location("claims_report", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CLAIMS_CELL = """\
from distlab.lab.common import claim, claims_table
x = 2 + 2
claims_table([
    claim("two and two make four", "arithmetic", f"2 + 2 = {x}", x == 4),
    claim("two and two make five", "Orwell", f"2 + 2 = {x}", x == 5, basis="modelled"),
])
"""


def write_notebook(path: Path, *sources: str) -> str:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_report_has_claims_verdicts_failure_and_machine(tmp_path):
    tool = load_tool()
    workbook = tmp_path / "workbook"
    workbook.mkdir()
    good = workbook / "00_claims.ipynb"
    bad = workbook / "01_raises.ipynb"
    digests = {good: write_notebook(good, CLAIMS_CELL),
               bad: write_notebook(bad, "y = 1", "raise ValueError('boom in the second cell')")}
    out = tmp_path / "reports" / "claims.md"

    status = tool.main(["--quick", "--workbook", str(workbook), "--out", str(out),
                        "--timeout-per-cell", "60"])

    assert status == 1  # a notebook failed; the claim that does not hold is not a failure
    report = out.read_text()
    raw = json.loads(out.with_suffix(".json").read_text())
    first, second = raw["notebooks"]
    assert first["status"] == "pass" and second["status"] == "fail"
    assert [(r["claim"], r["holds"], r["notebook"]) for r in first["rows"]] == [
        ("two and two make four", True, "00_claims"), ("two and two make five", False,
                                                       "00_claims")]
    assert "| two and two make four | arithmetic | 2 + 2 = 4 | measured | yes |" in report
    assert "| two and two make five | Orwell | 2 + 2 = 4 | modelled | no |" in report
    assert "1 of 2 hold" in report
    assert second["error"] == {"ename": "ValueError", "evalue": "boom in the second cell",
                               "cell": 1}
    assert "`ValueError`: boom in the second cell" in report
    for field in ("date (UTC):", "machine:", "cores", "torch ", "Python ", "CUDA:",
                  "mode: quick", "git commit:"):
        assert field in report, field
    assert raw["machine"]["cores"] and raw["mode"] == "quick"
    # the tool executes copies in memory: the notebooks on disk are untouched
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in digests} == digests
    assert sorted(p.name for p in workbook.iterdir()) == ["00_claims.ipynb", "01_raises.ipynb"]


def test_notebooks_are_picked_by_number_or_name(tmp_path):
    tool = load_tool()
    for name in ("00_a", "01_b", "02_c"):
        write_notebook(tmp_path / f"{name}.ipynb", "pass")
    assert [p.stem for p in tool.find_notebooks(tmp_path, ["02", "00_a"])] == ["00_a", "02_c"]
    assert [p.stem for p in tool.find_notebooks(tmp_path)] == ["00_a", "01_b", "02_c"]


def test_full_mode_reports_each_notebook_against_its_budget():
    tool = load_tool()
    results = [{"notebook": "00_start_here", "status": "pass", "seconds": 61.0, "rows": []},
               {"notebook": "04_zero_and_fsdp", "status": "pass", "seconds": 179.0, "rows": []}]
    table = "\n".join(tool.summary_lines(results, "full"))
    assert "| 00_start_here | pass | 61 | **over** 60 s |" in table
    assert "| 04_zero_and_fsdp | pass | 179 | within 180 s |" in table
    assert "| all | 0 failed | 240 | 1 over |" in table
    assert "| — |" in "\n".join(tool.summary_lines(results, "quick"))



def test_merge_puts_a_notebook_into_the_report_under_its_own_commit(tmp_path):
    """--merge: a rerun replaces its entry, a new notebook joins in order, each with the commit
    and date of its own run, which the header and its section say; the main pass's meta stays.
    Merging into a report that is not there, or of the other mode, stops before anything runs."""
    tool = load_tool()
    meta = {"date": "d0", "mode": "full", "commit": "c0", "seconds": 30.0, "runs_bytes": 0,
            "machine": {"platform": "p", "cpu": "x", "cores": 2, "memory_gib": 1.0,
                        "torch": "t", "python": "3", "cuda": False}}

    def entry(name, seconds, held):
        return {"notebook": name, "seconds": seconds, "status": "pass", "error": None,
                "rows": [{"claim": f"{name} claim", "source": "s", "figure": "f",
                          "basis": "measured", "holds": held, "notebook": name}]}

    previous = {**meta, "notebooks": [entry("00_a", 10.0, True), entry("02_c", 20.0, True)]}
    merged_meta, notebooks = tool.merge(previous, [entry("02_c", 25.0, False),
                                                   entry("01_b", 5.0, True)], "c1", "d1")
    assert [n["notebook"] for n in notebooks] == ["00_a", "01_b", "02_c"]
    assert notebooks[2]["rows"][0]["holds"] is False  # the rerun replaced the old entry
    assert "commit" not in notebooks[0] and notebooks[1]["commit"] == "c1"
    assert (merged_meta["commit"], merged_meta["date"]) == ("c0", "d0")
    assert merged_meta["separate"] == [("01_b", "c1", "d1"), ("02_c", "c1", "d1")]
    assert merged_meta["seconds"] == 40.0
    report = tool.render(merged_meta, notebooks)
    assert "- git commit: c0" in report
    assert "- run separately (--merge): 01_b at commit c1, d1; 02_c at commit c1, d1" in report
    assert report.count("- run separately: commit c1, d1") == 2
    out = tmp_path / "claims.md"
    write_notebook(tmp_path / "00_a.ipynb", "raise SystemError('this notebook must not run')")
    args = ["--merge", "--notebooks", "00", "--out", str(out), "--workbook", str(tmp_path)]
    with pytest.raises(SystemExit, match="no report"):
        tool.main(args)
    out.with_suffix(".json").write_text(json.dumps(previous))
    with pytest.raises(SystemExit, match="is a full report, this run is quick"):
        tool.main(["--quick", *args])
