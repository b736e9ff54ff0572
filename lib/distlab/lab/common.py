"""What every notebook companion shares: units, palettes and tables.

Units are binary (KiB = 2^10 bytes, MiB = 2^20 from distlab.estimate), as torch's and the
kernel's memory counters are; the papers' decimal GB (10^9) is distlab.estimate's too.
"""

from __future__ import annotations

import html

from distlab.estimate import MiB  # noqa: F401  (re-exported: the notebooks' unit)

KiB = 2**10

# One colour per run or configuration, in the order they are drawn (the last is a neutral grey).
RUN_COLORS = ("#1f5fbf", "#e8590c", "#2b8a3e", "#c2255c", "#6741d9", "#0b7285", "#5c3c00",
              "#868e96")
# Memory categories as the ranks log them (distlab.memory), with the names the figures show.
MEMORY_CATEGORIES = (("params", "parameters"), ("grads", "gradients"),
                     ("optim", "optimizer state"), ("activations", "activations"),
                     ("comm_buffers", "comm buffers"))
# One colour per memory category above, then two for extra series (autocast casts, peak).
MEMORY_COLORS = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756", "#72b7b2", "#222222")


def markdown_table(header, rows) -> str:
    """A Markdown table (display it with IPython.display.Markdown, or call table())."""
    def row(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
    return "\n".join([row(header), "|" + "---|" * len(header)] + [row(r) for r in rows])


def table(header, rows):
    """Show a Markdown table under the cell."""
    from IPython.display import Markdown, display
    display(Markdown(markdown_table(header, rows)))


def html_table(header, rows) -> str:
    """A small HTML table for a widget (Markdown does not render inside ipywidgets.HTML)."""
    def cell(tag, v):
        return f"<{tag} style='padding:2px 8px'>{html.escape(str(v))}</{tag}>"
    head = "".join(cell("th", h) for h in header)
    body = "".join("<tr>" + "".join(cell("td", v) for v in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def fmt_bytes(b: float) -> str:
    """Bytes in the unit that reads best: B below 10 KiB, then KiB, then MiB."""
    return f"{b:,.0f} B" if b < 10 * 1024 else f"{b / 1024:,.1f} KiB" if b < MiB else \
        f"{b / MiB:,.2f} MiB"


def mib(b) -> str:
    """Bytes as MiB (2^20), 3 decimals; an em dash for None."""
    return "—" if b is None else f"{b / MiB:,.3f}"


# -- claims tables -----------------------------------------------------------------------------
# Every notebook ends with a table of textbook claims set against its own run. A row's verdict
# is computed from the run (a bool), never typed in, and the basis says whether the figure was
# measured in this run or modelled by a formula (whose source the row names). When the
# environment variable DISTLAB_CLAIMS_JSONL names a file, every row is also appended to it as
# one JSON object: tools/claims_report.py collects them from a full-mode run of the workbook.
BASES = ("measured", "modelled")


def claim(claim: str, source: str, figure: str, holds: bool, basis: str = "measured") -> dict:
    """One row of a claims table. `holds` must be computed from the run: a bool, not a string."""
    if not isinstance(holds, bool):
        raise TypeError(f"holds must be a bool computed from the run, got {holds!r}")
    if basis not in BASES:
        raise ValueError(f"basis={basis!r} is not one of {BASES}")
    return {"claim": claim, "source": source, "figure": figure, "holds": holds, "basis": basis}


def verdict(holds: bool) -> str:
    return "yes" if holds else "**no**"


def claims_markdown(rows: list[dict]) -> str:
    return markdown_table(["claim", "source", "what this run shows", "basis", "holds?"],
                          [[r["claim"], r["source"], r["figure"], r["basis"], verdict(r["holds"])]
                           for r in rows])


def claims_table(rows: list[dict]) -> list[dict]:
    """Show the claims table under the cell (and record it, see above); returns the rows."""
    import json
    import os

    from IPython.display import Markdown, display
    display(Markdown(claims_markdown(rows)))
    path = os.environ.get("DISTLAB_CLAIMS_JSONL")
    if path:
        notebook = os.environ.get("DISTLAB_NOTEBOOK", "")
        with open(path, "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps({"notebook": notebook, **r}) + "\n")
    return rows
