"""The caller's side of training checkpoints: launch a run again from its checkpoint.

    run = launch(RunConfig(..., checkpoint_every=5))   # killed, preempted, or just finished
    resume(run, steps=200)                             # a new Run, from the latest checkpoint
"""

from __future__ import annotations

import json
import os

from distlab.checkpoint.store import (CheckpointError, check_compatible, checkpoint_root,
                                      latest_checkpoint, read_meta, resolve, verify)
from distlab.config import RunConfig
from distlab.caller.launch import launch


def resume(source, block: bool = False, **changes):
    """Launch a run again from its latest checkpoint and return the new Run.

    source: a Run, its folder, a checkpoint folder or a folder of checkpoints. changes: RunConfig
    fields to change (those in MAY_CHANGE, e.g. world_size=2, steps=200). The checkpoint is
    checked here first (files, CRCs, config), so a bad one fails before any process starts.
    New checkpoints go on into the same folder; the injected fault is not repeated."""
    path, cfg, root = _locate(source)
    label = cfg.name or f"{cfg.strategy}-w{cfg.world_size}"
    new = cfg.replace(**{"resume_from": path, "checkpoint_dir": root, "fault": "none", "fault_module": "",
                         "name": label if label.endswith("-resumed") else label + "-resumed",
                         **changes})
    meta = verify(path)
    check_compatible(meta, new, path)
    if meta["steps_done"] >= new.steps:  # nothing would train: say so instead of a no-op run
        raise CheckpointError(f"{path} has {meta['steps_done']} steps done and the run asks for "
                              f"steps={new.steps}; pass steps=N with N > {meta['steps_done']} "
                              "to train on")
    return launch(new, block=block)


def _locate(source) -> tuple[str, RunConfig, str]:
    """(checkpoint folder, the config that wrote it, the checkpoints root) for `resume`."""
    run_dir = getattr(source, "dir", None) or os.path.abspath(str(source))
    config_file = os.path.join(run_dir, "config.json")
    if os.path.isfile(config_file):  # a run's folder
        with open(config_file, encoding="utf-8") as f:
            cfg = RunConfig.from_dict(json.load(f))
        root = checkpoint_root(cfg, run_dir)
        path = latest_checkpoint(root)
        if path is None:
            raise CheckpointError(f"run {run_dir} has no complete checkpoint under {root} "
                                  "(was checkpoint_every > 0? did a save finish?)")
        return path, cfg, root
    path = resolve(run_dir, run_dir)
    return path, RunConfig.from_dict(read_meta(path)["config"]), os.path.dirname(path)
