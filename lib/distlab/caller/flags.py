"""A RunConfig as `python -m distlab` flags: what a launcher puts on torchrun's command line
(the inverse of distlab.__main__.parse_config)."""

from __future__ import annotations

import dataclasses

from distlab.config import RunConfig


def cli_args(cfg) -> list[str]:
    """parse_config's inverse: `python -m distlab` flags for the fields of cfg that differ
    from RunConfig's defaults (world_size, nodes and the links are the launcher's to set)."""
    args = []
    for f in dataclasses.fields(RunConfig):
        value = getattr(cfg, f.name)
        if f.name in ("world_size", "nodes", "link_mbit", "link_pairs") or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):  # --dp-threads / --no-dp-threads
            args.append(flag if value else "--no-" + f.name.replace("_", "-"))
        else:
            args += [flag, str(value)]
    return args
