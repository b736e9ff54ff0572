"""The explorers' base (Explorer): what every notebook's explorer widget shares, Run and Stop
buttons, a status line with the live run's progress, and work that never blocks the kernel when
Run is clicked. Its docstring says how a notebook's explorer plugs in.
"""

from __future__ import annotations

import html
import threading
import time

import ipywidgets as W

from distlab.caller.run import Run
from distlab.lab.live import (FigureView, LiveBox, _error_html, _stop_in_background,
                              keep_for_reload, show_live, status_text)


class ExplorerBusy(RuntimeError):
    """Run was asked for while the explorer's last run is still going."""


class Explorer:
    """What every notebook's explorer widget shares: Run and Stop buttons, a status line, and
    work that never blocks the kernel when Run is clicked.

    A subclass calls `super().__init__()` first (it makes `self.button`, `self.stop_button` and
    `self.status`), lays out `self.widget` with them, and defines two hooks:

    * `_run(**values)`: the work. Set the knobs from `values`, say what runs with
      `self._announce(text)`, launch (passing `on_start=self._started` to launch_together or
      run_ranks; after launch(), call `self._started(run)`), wait, draw the result (the one
      place the figure is drawn), say it with `self._say(html)`, return the result.
    * `_clear()`: the stale result goes at once (its figure emptied, its numbers blanked).

    Its figure is a plain `go.Figure` in `self.fig`, shown by `self._view_of(self.fig)` (a
    static plotly output, redrawn when the work ends or is cleared: live.FigureView), and its
    outer box `self._box(children)` (a LiveBox: without a kernel, the figure's picture).

    `run(**values)` does the work and returns its result, blocking: what a notebook cell calls,
    so nbval exercises it. A click on Run clears the stale result at once, does the same work
    in a thread, shows the live run's progress line in the status (Run.progress_line: ranks
    starting, then step k/n, tokens/s and the ETA) and enables Stop, which ends the run
    (Run.stop) and says "stopped". One run at a time: another click meanwhile is refused with
    a message. Errors show in the status: a click handler's exception would only reach the
    kernel's log.

    Threads: the worker and a ticker (at most every TICK_S) only set widget values, which
    ipywidgets sends from any thread; status writes take one lock, so the ticker's progress
    line never lands after the result it precedes. Messages from the browser reach the kernel
    only between cells, so Stop works for a run started by a click, not by a blocking cell.
    """

    TICK_S = 0.5  # the progress line's refresh: the run's events arrive every POLL_S at most

    @property
    def status_text(self) -> str:
        """The status line's words, as printed text (lab.panel.status_text)."""
        return status_text(self.status)

    def __init__(self):
        self.button = W.Button(description="Run", button_style="primary", icon="play")
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop",
                                    disabled=True)
        self.status = W.HTML()
        self.view: FigureView | None = None  # how self.fig is shown (_view_of)
        self.live: Run | None = None  # the run going now (set by _started)
        self.error: BaseException | None = None  # what the last click's work raised
        self._status_lock = threading.RLock()
        self._busy = False
        self._generation = 0  # one ticker per run: an older one exits when this moves on
        self._stop_asked = False
        self._heading = ""  # what runs, said before its progress line
        self._said = False  # the outcome (or a message) is in the status: no progress line
        self._note = ""  # a refused click, said under the progress line
        self._worker: threading.Thread | None = None
        self._launched = threading.Event()  # set once the live run exists (or the work ended)
        self._claimed = 0.0  # when the work was asked for
        self.button.on_click(self._on_run_click)
        self.stop_button.on_click(self._on_stop_click)

    # -- the hooks a subclass defines -----------------------------------------------------------
    def _run(self, **values):
        raise NotImplementedError

    def _clear(self):
        """The stale result goes; a subclass empties its figure too (and calls this)."""
        self._say("starting: the previous result is cleared")

    # -- how a subclass lays itself out ---------------------------------------------------------
    def _view_of(self, fig) -> W.Widget:
        """The widget that shows `fig` (self.fig) as a static plotly output; show_figure()
        redraws it (the base does when the work ends and after _clear)."""
        self.view = FigureView(fig)
        return self.view.widget

    def _box(self, children) -> LiveBox:
        """The explorer's outer box: without a kernel it leaves its figure's picture."""
        return LiveBox(children, f"{type(self).__name__} (an explorer)",
                       figure=lambda: self.view.fig if self.view is not None else None)

    def show_figure(self):
        """Show the figure as it is now (from any thread; nothing is sent if unchanged)."""
        if self.view is not None:
            self.view.show()

    # -- running -------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether a run (started by a click or a cell) is still going."""
        return self._busy

    def run(self, **values):
        """Do the work with these knob values and return its result, blocking (a cell's way).
        Raises ExplorerBusy while another run is going, and whatever the work raised."""
        self._claim()
        self._clear()
        self.show_figure()
        return self._guarded(values)

    def start(self, **values) -> threading.Thread:
        """What a click on Run does: clear the stale result, then the work in a thread; returns
        the thread at once. Raises ExplorerBusy while another run is going."""
        self._claim()
        self._clear()
        self.show_figure()
        self._worker = threading.Thread(target=self._background, args=(values,), daemon=True,
                                        name=f"distlab-{type(self).__name__}")
        self._worker.start()
        return self._worker

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the work a click (or start) began; True once it has ended."""
        if self._worker is not None:
            self._worker.join(timeout)
        return not self.busy

    def stop(self):
        """End the live run (what Stop does); its work then ends with the status "stopped".
        Asked before the ranks started, the run is stopped as soon as they have."""
        with self._status_lock:
            if not self._busy:
                return
            self._stop_asked = True
            run = self.live
            self.stop_button.disabled = True
            if run is None or not run.done:  # a finished run's result is on its way: keep it
                self.status.value = "stopping: ending every rank"
        if run is not None:
            run.stop()

    def _started(self, run: Run):
        """The live run exists (launch_together's / run_ranks' on_start, or after launch())."""
        with self._status_lock:
            self.live = run
            stop = self._stop_asked
        self._launched.set()
        if stop:  # Stop came while the ranks were starting
            run.stop()

    def _announce(self, text: str):
        """Say what runs (plain text); the progress line follows it while the run goes."""
        with self._status_lock:
            self._heading, self._said = text, False
            self.status.value = html.escape(text)

    def _say(self, html_text: str):
        """Set the status line (HTML): the result, or a message. The progress line stops here:
        it never lands after what it was the progress of."""
        with self._status_lock:
            self._said = True
            self.status.value = html_text

    # -- the machinery ---------------------------------------------------------------------------
    def _claim(self):
        with self._status_lock:
            if self._busy:
                raise ExplorerBusy("one run at a time: the last one is still going "
                                   "(press Stop to end it)")
            self._busy, self._stop_asked, self.live, self.error = True, False, None, None
            self._heading, self._note = "", ""
            self._generation += 1
            self._claimed = time.time()
            self._launched.clear()
            self.stop_button.disabled = False
        threading.Thread(target=self._tick, args=(self._generation,), daemon=True,
                         name=f"distlab-{type(self).__name__}-progress").start()

    def _guarded(self, values: dict):
        """The work, its outcome in the status line, and the explorer idle again after it."""
        try:
            result = self._run(**values)
            if self._stop_asked and self.live is not None and self.live.status == "stopped":
                self._say_stopped()  # launch()'s runs: stopped, yet the work ended normally
            return result
        except BaseException as e:
            if self._stop_asked:
                self._say_stopped()
            elif isinstance(e, KeyboardInterrupt):  # Run.wait stopped the ranks first
                self._say("interrupted: every rank ended")
            else:
                self._say(_error_html("failed", e))
            raise
        finally:
            with self._status_lock:
                self._busy = False
                self.stop_button.disabled = True
            self._launched.set()
            self.show_figure()  # the figure the work drew (or left cleared)
            for fig in (getattr(self, "fig", None),
                        getattr(getattr(self, "dashboard", None), "fig", None)):
                keep_for_reload(fig)  # the figure a reload draws: this run's

    def _background(self, values: dict):
        try:
            self._guarded(values)
        except BaseException as e:  # noqa: BLE001 - shown in the status line by _guarded;
            self.error = e  # a thread's exception would vanish into the kernel's log

    def _say_stopped(self):
        run = self.live
        what = self._heading.rstrip(" .…").removeprefix("running ") or "the run"
        after = f" after {len(run.history('step', rank=0))} step(s)" if run is not None else ""
        self._say(html.escape(f"stopped {what}{after}: every rank ended; press Run to start "
                              "again"))

    def _tick(self, generation: int):
        """The live run's progress line under its heading, until the work ends."""
        while True:
            with self._status_lock:
                if generation != self._generation or not self._busy:
                    return
                if self._heading and not (self._said or self._stop_asked):
                    self._show_progress()
            time.sleep(self.TICK_S)

    def _show_progress(self):
        """(Under the status lock.) The heading, the live run's progress line, a refusal."""
        text, run = self._heading.rstrip(" .…"), self.live
        if run is None:  # checks, a fresh fork server (seconds on the first launch)
            line = f"launching... {time.time() - self._claimed:.0f} s"
        else:
            line = run.progress_line(time.time() - run.started).strip()
        text = f"{text}: {line}" if text else line
        note = f"<br><small>{html.escape(self._note)}</small>" if self._note else ""
        self.status.value = html.escape(text) + note

    def _on_run_click(self, _button):
        try:
            self.start()
        except ExplorerBusy as e:  # refused: said under the progress line, which goes on
            with self._status_lock:
                self._note = f"Run refused: {e}"
                if self._heading and not (self._said or self._stop_asked):
                    self._show_progress()
                else:
                    self.status.value += f"<br><small>{html.escape(self._note)}</small>"
        except Exception as e:  # noqa: BLE001 - a click handler's exception is invisible
            self._say(_error_html("not started", e))

    def _on_stop_click(self, _button):
        _stop_in_background(self.stop, self._say)

    def _ipython_display_(self):
        show_live(self.widget)
