"""Build the workbook as a static web site: the notebooks with their outputs, figures you can
hover and zoom, the claims report, the interview index and the reference pages of docs/,
readable from disk with no network and no kernel.

    .venv/bin/python tools/claims_report.py --executed reports/executed   # full mode, ~30 min
    .venv/bin/python tools/build_site.py --executed reports/executed --out site
    # then open site/index.html in a browser

Why nbconvert, not Jupyter Book: nbconvert is already installed with the workbook (nbval and
jupytext need it), it turns an executed notebook into one HTML page, and it needs no build
chain or network; Jupyter Book would add a dependency tree and a theme fetched at build time
for what is here a dozen pages and an index.

What this adds to nbconvert's pages: plotly figures (saved by the notebooks as
application/vnd.plotly.v1+json, which nbconvert does not draw) become plotly divs drawn by
the plotly.js that the installed plotly package ships, copied once into the site; a widget (an
explorer or the control panel needs a kernel) becomes a note saying so, above the static
picture of its figure that its output carries (distlab.lab.live.LiveBox). The saved widget
state is left out: no page draws a widget, and it was most of a page's weight (02 and 17 were
11 MB, nearly all of it plotly's widget bundle). A notebook with no
executed copy is shown from its source, marked as not executed, so every link of the index
resolves. Links between pages (the interview index points at notebook sections, the reference
pages at each other) are rewritten from the .ipynb and .md files to the pages; a reference
page's link back to the README goes to the site's index, which stands in for it.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import shutil
from datetime import datetime, timedelta
from pathlib import Path
from urllib.parse import unquote

import mistune
import nbformat
from nbconvert import HTMLExporter

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"  # every .md here is a page of the site (interview_index.md among them)
PLOTLY_MIME = "application/vnd.plotly.v1+json"
# a widget's output, and the mark claims_report.for_reading leaves where it took the view out
from claims_report import WAS_WIDGET, WIDGET_MIME  # noqa: E402  (tools/ is the script's folder)
WIDGET_NOTE = ("<p class='site-note'><i>An interactive widget stands here (an explorer or the "
               "control panel): it needs a running kernel. Open this notebook in JupyterLab to "
               "use it. Below, where it drew one, its figure as the notebook's run left it."
               "</i></p>")
STYLE = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
         "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px}"
         ".site-note{color:#555}")


def _markdown(text: str) -> str:
    """Our own pages: their links are trusted (mistune's URL policy would drop a section
    link whose anchor holds a ':', taking it for a scheme)."""
    renderer = mistune.HTMLRenderer(escape=False, allow_harmful_protocols=True)
    return mistune.create_markdown(renderer=renderer, plugins=["table"])(text)


def _plotly_html(fig: dict, n: int) -> str:
    """A plotly figure as a div and the call that draws it (plotly.js is on the page)."""
    spec = json.dumps({"data": fig.get("data", []), "layout": fig.get("layout", {}),
                       "config": {"responsive": True}})
    return (f"<div id='plot-{n}' class='site-plot'></div><script>(function(){{var f={spec};"
            f"Plotly.newPlot('plot-{n}',f.data,f.layout,f.config);}})();</script>")


def prepare(nb: nbformat.NotebookNode) -> int:
    """Plotly outputs to drawable HTML, widgets to a note; returns the number of figures."""
    figures = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            widget = WIDGET_MIME in data or out.get("metadata", {}).get(WAS_WIDGET)
            if PLOTLY_MIME in data and not widget:
                out["data"] = {"text/html": _plotly_html(data[PLOTLY_MIME], figures)}
                figures += 1
            elif widget:
                picture = data.get(PLOTLY_MIME)
                out["data"] = {"text/html": WIDGET_NOTE + (
                    _plotly_html(picture, figures) if picture is not None else "")}
                figures += picture is not None
    nb.metadata.pop("widgets", None)  # the widgets' saved state: no page draws a widget
    return figures


def slug(text: str) -> str:
    """A heading's anchor as plain ASCII: JupyterLab's anchor ("4.-The-α-β-model...") and
    nbconvert's id (the same, percent-encoded in part) both become "4-the-model-...", so a
    link finds its heading in any browser."""
    return re.sub(r"[^0-9a-z]+", "-", unquote(text).lower()).strip("-")


def _slug_ids(body: str) -> str:
    """nbconvert's heading ids and their anchor links, as slugs."""
    body = re.sub(r'(<h[1-6][^>]*\sid=")([^"]+)"', lambda m: f'{m.group(1)}{slug(m.group(2))}"',
                  body)
    return re.sub(r'(class="anchor-link" href="#)([^"]+)"', lambda m: f'{m.group(1)}'
                  f'{slug(m.group(2))}"', body)


def _relink(text: str) -> str:
    """Links to the workbook's notebooks (and the docs) become links to the site's pages, a
    section's anchor as its slug (the pages' heading ids are slugs too: `slug`)."""
    def page(m):
        frag = m.group(2)
        return f"{m.group(1)}.html" + (f"#{slug(frag[1:])}" if frag else "")
    # an anchor may hold parentheses ("3.-(b)-Memory..."), one level deep as Markdown allows
    text = re.sub(r"(?:\.\./)?(?:workbook/)?(\d\d_[A-Za-z0-9_]+)\.ipynb"
                  r"(#(?:[^()\s]|\([^()\s]*\))*)?", page, text)
    for md in DOCS.glob("*.md"):  # a notebook's link to a page, and the pages' to each other
        text = text.replace(f"../docs/{md.name}", f"{md.stem}.html")
        text = text.replace(f"]({md.name})", f"]({md.stem}.html)")
    return text.replace("](../README.md)", "](index.html)")


def executed_at(nb) -> str | None:
    """When the notebook's first cell ran (nbclient's cell metadata), as 'YYYY-MM-DD HH:MM UTC';
    None for a copy that holds no execution times."""
    times = [c.get("metadata", {}).get("execution", {}).get("iopub.execute_input")
             for c in nb.cells if c.cell_type == "code"]
    times = sorted(t for t in times if t)
    return times[0][:16].replace("T", " ") + " UTC" if times else None


def from_report_run(report: dict, started: dict[str, str | None]) -> bool:
    """Whether every executed page comes from the run that wrote `report` (claims_report's
    JSON): each of them is one of its notebooks and started (executed_at) within the report's
    span, from its start to start + its seconds (to the minute both are written in)."""
    if not started or any(t is None for t in started.values()):
        return False
    names = {nb["notebook"] for nb in report.get("notebooks", [])}
    fmt = "%Y-%m-%d %H:%M UTC"
    start = datetime.strptime(report["date"], fmt)
    end = start + timedelta(seconds=report.get("seconds", 0) + 60)
    return all(name in names and start <= datetime.strptime(t, fmt) <= end
               for name, t in started.items())


def notebook_page(path: Path, executed: bool) -> tuple[str, int]:
    nb = nbformat.read(path, as_version=4)
    figures = prepare(nb)
    if not executed:
        nb.cells.insert(0, nbformat.v4.new_markdown_cell(
            "*Not executed for this site: the cells are shown without their outputs. Run "
            "`tools/claims_report.py --executed` and build the site again to see them.*"))
    else:  # one story: say which run this page shows (the claims page says which it shows)
        when = executed_at(nb)
        nb.cells.insert(0, nbformat.v4.new_markdown_cell(
            f"*This page shows the run of {when or 'an unrecorded time'}: its figures and its "
            "claims table are that run's. The site's claims page is the full-mode report's, "
            "whose date and commit it names; timings differ between runs.*"))
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = _relink(cell.source)
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(
        nb, resources={"metadata": {"name": _title(path)}})
    # the template's scripts from CDNs (require.js, MathJax, the widget manager's loader):
    # nothing here needs them, and the site is read offline (math shows as its TeX source)
    body = re.sub(r"<script[^>]*src=['\"]https?://[^>]*>\s*</script>", "", body)
    body = re.sub(r"<script>\s*\(function\(\) \{\s*function addWidgetsRenderer.*?</script>", "",
                  body, count=1, flags=re.S)
    body = _slug_ids(body)
    script = "<script src='plotly.min.js'></script>"
    return body.replace("</head>", f"{script}\n</head>", 1), figures


def _page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
            f"</title><style>{STYLE}</style></head><body>{body}</body></html>")


def _md_title(path: Path) -> str:
    """A Markdown page's title: its first top-level heading."""
    m = re.search(r"^#\s+(.+)$", path.read_text(), re.M)
    return m.group(1).strip() if m else path.stem


def _title(path: Path) -> str:
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            m = re.search(r"^#\s+(.+)$", cell.source, re.M)
            if m:
                return m.group(1).strip()
    return path.stem


def build(executed_dir: Path | None, out: Path, workbook: Path = REPO / "workbook") -> dict:
    """Write the site into `out`; returns {page: figures drawn} for the notebooks."""
    out.mkdir(parents=True, exist_ok=True)
    import plotly
    shutil.copy(Path(plotly.__file__).parent / "package_data" / "plotly.min.js",
                out / "plotly.min.js")
    pages, items, started = {}, [], {}
    for src in sorted(workbook.glob("[0-9][0-9]_*.ipynb")):
        done = executed_dir / src.name if executed_dir else None
        ran = done is not None and done.exists()
        if ran:
            started[src.stem] = executed_at(nbformat.read(done, as_version=4))
        page, figures = notebook_page(done if ran else src, ran)
        (out / f"{src.stem}.html").write_text(page, encoding="utf-8")
        pages[src.stem] = figures
        items.append(f"<li><a href='{src.stem}.html'>{html.escape(_title(src))}</a>"
                     f"{'' if ran else ' <i>(not executed)</i>'}</li>")
    index_md = DOCS / "interview_index.md"
    (out / "interview_index.html").write_text(
        _page("Interview index", _markdown(_relink(index_md.read_text()))), encoding="utf-8")
    reference = []  # the other pages of docs/ (the README's reference), each as a page
    for md in sorted(DOCS.glob("*.md")):
        if md == index_md:
            continue
        title = _md_title(md)
        (out / f"{md.stem}.html").write_text(_page(title, _markdown(_relink(md.read_text()))),
                                             encoding="utf-8")
        reference.append(f"<li><a href='{md.stem}.html'>{html.escape(title)}</a></li>")
    claims = REPO / "reports" / "claims-full.md"
    claims_link = ""
    if claims.exists():
        report = json.loads(claims.with_suffix(".json").read_text())
        note = ("<p class='site-note'><i>This is the full-mode report of the run every "
                "notebook page here shows: one story, its date and commit in its header.</i></p>"
                if from_report_run(report, started) and len(started) == len(pages) else
                "<p class='site-note'><i>This is the committed full-mode report, not the run "
                "each notebook page shows (each page names its own); its header gives its date "
                "and commit. Where a page's timing row and this report disagree, they are two "
                "runs of a shared machine.</i></p>")
        (out / "claims.html").write_text(_page("Claims, full mode", note + _markdown(
            _relink(claims.read_text()))), encoding="utf-8")
        claims_link = ("<li><a href='claims.html'>every claim with its figure and verdict "
                       "(the latest full-mode report)</a></li>")
    (out / "index.html").write_text(_page("distlab workbook", (
        "<h1>distlab: distributed training, run and measured</h1>"
        "<p>The workbook's notebooks as their last run left them: figures are live (hover, "
        "zoom), widgets need JupyterLab.</p><h2>Notebooks</h2><ol start='0'>"
        + "".join(items) + "</ol><h2>Also</h2><ul><li><a href='interview_index.html'>the "
        "interview index: each question, the section that answers it, the evidence</a></li>"
        + claims_link + "</ul><h2>Reference</h2><ul>" + "".join(reference) + "</ul>")),
        encoding="utf-8")
    return pages


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--executed", type=Path, help="executed notebooks (claims_report.py "
                   "--executed DIR); notebooks missing there are shown unexecuted")
    p.add_argument("--out", type=Path, default=REPO / "site", help="where to write (site/)")
    args = p.parse_args(argv)
    pages = build(args.executed, args.out)
    print(f"{len(pages)} notebooks, {sum(pages.values())} figures -> {args.out / 'index.html'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
