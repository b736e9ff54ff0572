"""The workbook layer: what only the notebooks use. The runtime (the rest of distlab) never
imports it, and it is the only part that needs the [lab] extra (plotly, ipywidgets, anywidget).

    common.py           units, palettes and tables every companion shares
    panel.py            the control panel (00); it re-exports the names of the three below
    dashboard.py        the live dashboard: loss, memory and bytes per rank; lab.watch(run)
    explorer.py         the explorers' base: Run, Stop and a status line, off the kernel's thread
    live.py             reading a run while it grows; what every live widget shares
    runs.py             several configs in one launch; comparing what they trained
    <notebook>.py       each notebook's companion, named after it: collectives (01),
                        data_parallel, stragglers and scaling (02), memory_and_precision (03),
                        zero_and_fsdp (04), tensor_parallel (05), pipeline_parallel (06),
                        parallelism_3d (07), lora_finetuning (08), checkpoints_and_faults (09),
                        your_model (10); debugging (11); out_of_memory (12);
                        time_to_train (13)
    search.py           search with Optuna over real runs (live trials, pruning, storage):
                        hp_search.py, arch_search.py, search_figures.py (13)
    git_outputs.py      git compares the notebooks without their outputs (README)

`from distlab import lab` gives the panel's API: lab.watch(run), lab.ControlPanel(), ...

May import: all of distlab. Nothing else in distlab imports it.
"""


from distlab.caller import run as _run
from distlab.lab.common import MEMORY_CATEGORIES, MiB
from distlab.lab.live import in_a_kernel
from distlab.lab.panel import (
    ControlPanel,
    Explorer,
    LiveDashboard,
    bytes_sent,
    dashboard_for,
    describe,
    loss_curve,
    step_events,
    watch,
    wire_sent,
)

__all__ = ["ControlPanel", "Explorer", "LiveDashboard", "MEMORY_CATEGORIES", "MiB", "bytes_sent",
           "dashboard_for", "describe", "loss_curve", "step_events", "watch", "wire_sent"]



class NotebookProgress:
    """wait()'s progress in a notebook: one output, updated in place, so the saved notebook
    holds only its final state ("done: 435 steps in 47.1 s, 2,530 tokens/s"), where each
    update printed with a carriage return was saved as a line of its own (02: 107)."""

    def __init__(self):
        self.handle = None

    def show(self, line: str, final: bool = False) -> None:
        from IPython.display import display
        if self.handle is None:
            self.handle = display({"text/plain": line}, raw=True, display_id=True)
        else:
            self.handle.update({"text/plain": line}, raw=True)


if in_a_kernel():  # in a notebook: a cell that waits on a run shows its progress
    _run.SHOW_PROGRESS = True
    _run.PROGRESS_OUT = NotebookProgress
