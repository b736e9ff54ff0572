"""What every notebook companion shares: units, palettes and tables.

Units are distlab.units': binary (KiB = 2^10 bytes, MiB = 2^20), as torch's and the kernel's
memory counters are; the papers' decimal GB (10^9) is there too.
"""

from __future__ import annotations

import html
import math
import re
import warnings
from contextlib import contextmanager

from distlab.units import GiB, KiB, MiB  # noqa: F401  (re-exported: the notebooks' units)

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


def md_escape(text: str) -> str:
    """Text shown literally in Markdown: every ASCII punctuation mark backslash-escaped
    (CommonMark allows it for all of them), so '*', '_' or '|' format nothing."""
    return "".join("\\" + c if c in "\\`*_{}[]<>()#+-.!|~" else c for c in str(text))


def say(*lines: str):
    """Show lines of text under the cell as Markdown, one paragraph with a break after each
    line: Markdown wraps a long line at a space, where print() output breaks mid-word.
    The text is shown literally (md_escape)."""
    from IPython.display import Markdown, display
    display(Markdown("  \n".join(md_escape(line) for line in lines)))


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


def byte_unit(*values) -> tuple[float, str]:
    """(scale, name) of the one unit a byte axis shows: the largest of KiB, MiB and GiB in
    which the largest value is at least 1, so ticks read 0.5 ... 900 in the axis title's unit,
    never "25k" (25,000 KiB). KiB also for small values (and all zeros); None is ignored.
    `values` are numbers or iterables of them: byte_unit(sent, wire) for two series."""
    flat = []
    for v in values:
        flat.extend(v if isinstance(v, (list, tuple, set)) or hasattr(v, "__next__") else [v])
    top = max((abs(v) for v in flat if v is not None), default=0)
    return (GiB, "GiB") if top >= GiB else (MiB, "MiB") if top >= MiB else (KiB, "KiB")


def hline(fig, y: float, text: str = "", log: bool = False, position: str = "top left",
          row=None, col=None, **line):
    """A horizontal line at y with a label. plotly's add_hline places its annotation in the
    axis's own units, which on a log axis are log10 of the value: a label for y=4 would land at
    1e4 (and stretch the autorange up to it). Here the label goes where the line is."""
    kw = dict(row=row, col=col) if row is not None else {}
    fig.add_hline(y=y, **line, **kw)
    if text:
        shape = fig.layout.shapes[-1]  # the subplot's axes, as add_hline chose them
        ypos, xpos = position.split()
        fig.add_annotation(text=text, showarrow=False, xref=shape.xref, yref=shape.yref,
                           x=0 if xpos == "left" else 1, xanchor=xpos,
                           y=math.log10(y) if log else y,
                           yanchor="bottom" if ypos == "top" else "top")
    return fig


HINT = "distlab-hint"  # the name of the annotation show_hint writes
HINT_HEIGHT = 200  # px: a hint needs a line, not a whole figure's height of white


def show_hint(fig, text: str):
    """A figure with no data yet: its axes, subplot titles and legend hidden, `text` in the
    middle instead (empty axes from 0 to 6 say nothing), the figure HINT_HEIGHT tall.
    clear_hint(fig) undoes it, its height back (kept in layout.meta meanwhile)."""
    hints = [a for a in fig.layout.annotations if a.name == HINT]
    if hints and hints[0].text == text:
        return  # shown already: a redraw sends nothing
    import plotly.graph_objects as go
    hint = go.layout.Annotation(name=HINT, text=text, xref="paper", yref="paper", x=0.5, y=0.5,
                                showarrow=False, font=dict(size=14, color="#666"))
    others = [a for a in fig.layout.annotations if a.name != HINT]
    with fig.batch_update():  # the annotations in one assignment: a batch reads stale values
        fig.layout.annotations = [go.layout.Annotation(a, visible=False) for a in others] + [
            hint]  # the subplot titles hidden, the hint shown
        if hints:
            return
        fig.update_xaxes(visible=False)
        fig.update_yaxes(visible=False)
        fig.layout.meta = {"height_before_hint": fig.layout.height}
        fig.layout.update(showlegend=False, height=HINT_HEIGHT)


def has_hint(fig) -> bool:
    """Whether show_hint's text stands in fig (it has shown no data yet)."""
    return any(a.name == HINT for a in fig.layout.annotations)


def clear_hint(fig):
    """Undo show_hint: axes, titles, legend and height back, the hint gone (nothing if none)."""
    if not has_hint(fig):
        return
    import plotly.graph_objects as go
    others = [go.layout.Annotation(a, visible=True) for a in fig.layout.annotations
              if a.name != HINT]
    with fig.batch_update():
        fig.layout.annotations = others
        fig.update_xaxes(visible=True)
        fig.update_yaxes(visible=True)
        height = (fig.layout.meta or {}).get("height_before_hint")
        fig.layout.update(showlegend=None, height=height, meta=None)


def mib(b) -> str:
    """Bytes as MiB (2^20), 3 decimals; an em dash for None."""
    return "—" if b is None else f"{b / MiB:,.3f}"


# -- claims tables -----------------------------------------------------------------------------
# Every notebook ends with a table of textbook claims set against its own run. A row's verdict
# is computed from the run (a bool), never typed in, and the basis says what it rests on:
#   measured           a figure this run measured (bytes, counts, values), not a clock
#   timed              a clock, read over repeats: min/median/max in the figure, and
#                      holds=None ("undecided on this machine") when the spreads overlap
#   modelled           a formula, whose source the row names
#   arithmetic         constants and identities: shown for reading, never cited as evidence
#   not measured here  only other hardware can answer (a GPU): holds=None on this machine
# When the environment variable DISTLAB_CLAIMS_JSONL names a file, every row is also appended
# to it as one JSON object: tools/claims_report.py collects them from a full-mode run.
BASES = ("measured", "timed", "modelled", "arithmetic", "not measured here")
UNDECIDED = {"timed": "undecided on this machine", "not measured here": "not measured here"}


def claim(claim: str, source: str, figure: str, holds: bool | None,
          basis: str = "measured") -> dict:
    """One row of a claims table. `holds` must be computed from the run: a bool, not a string;
    None only for a timed row whose spreads overlap, or one not measured on this hardware."""
    if basis not in BASES:
        raise ValueError(f"basis={basis!r} is not one of {BASES}")
    if not (isinstance(holds, bool) or (holds is None and basis in UNDECIDED)):
        raise TypeError(f"holds must be a bool computed from the run (None only with basis "
                        f"{' or '.join(map(repr, UNDECIDED))}), got {holds!r}")
    return {"claim": claim, "source": source, "figure": figure, "holds": holds, "basis": basis}


def verdict(holds: bool | None, basis: str = "measured") -> str:
    if holds is None:
        return UNDECIDED[basis]
    return "yes" if holds else "**no**"


def claims_markdown(rows: list[dict]) -> str:
    return markdown_table(["claim", "source", "what this run shows", "basis", "holds?"],
                          [[r["claim"], r["source"], r["figure"], r["basis"],
                            verdict(r["holds"], r["basis"])]
                           for r in rows])


def claims_table(rows: list[dict]) -> None:
    """Show the claims table under the cell (and record it, see above). It returns nothing: as
    a cell's last line, a returned list would be shown again, raw, under the table."""
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


# The note a Run adds when a loss went NaN or inf (distlab.caller.run, _note_non_finite_loss),
# as far as its first colon after the counts: what an on-purpose divergence is said with.
NON_FINITE_NOTE = re.compile(r"the loss was (?:nan|inf|-inf) at step \d+ on rank \d+ "
                             r"\(\d+ step events in all\)(?:: RunConfig\(detect_nan=True\)[^;]*)?")


@contextmanager
def expected_divergence():
    """Around a launch that diverges on purpose (02's largest lr without warm-up, 11's drills): the
    RuntimeWarning the Run gives when a loss went NaN or inf is caught, and its note (the
    first such step, without the run's folder or the library's line) is appended to the list
    this yields, for the cell to say; any other warning, and any other problem the same
    warning names, is warned again as it came. Nothing outside the block is silenced.

        with expected_divergence() as noted:
            curves = scaling_experiment(...)
        say(...noted...)
    """
    noted: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield noted
    for w in caught:
        text = str(w.message)
        found = NON_FINITE_NOTE.search(text) if issubclass(w.category, RuntimeWarning) else None
        if found is None:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            continue
        noted.append(found.group(0).split(": RunConfig(")[0])
        rest = text[:found.start()] + text[found.end():]
        head, _, tail = rest.partition(": ")  # "run <folder>: <problems joined by '; '>"
        others = [p for p in tail.split("; ") if p.strip()] if head.startswith("run ") else \
            [rest] if rest.strip() else []
        if others:
            warnings.warn_explicit(f"{head}: " + "; ".join(others), w.category, w.filename,
                                   w.lineno)
