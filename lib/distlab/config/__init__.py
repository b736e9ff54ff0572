"""RunConfig: every knob of a run, checked before any process starts.

A config is plain data (it is pickled into spawned ranks and written to `config.json` in the
run's folder), so it holds only strings, numbers and booleans, in one flat dataclass:
RunConfig(strategy="mesh", tp=2, steps=50). Its fields come in sections, each owned by one
subsystem and holding that subsystem's check (distlab.config.sections: parallelism, training,
model, data, precision, mesh, launch and nodes, checkpoints, fine-tuning, debugging). A field
is declared once, in its section, with all that is known about it (distlab.config.declare);
the command line, the features, what a resume may change and the control panel read it there.

May import: parallel/ and what it may. Nothing above (checkpoint/, rank/, caller/, lab/).
"""

from __future__ import annotations

import dataclasses
import json

from distlab.config.checkpoints import Checkpoints
from distlab.config.data import Data
from distlab.config.debugging import BUGS, FAULTS, Debugging
from distlab.config.declare import check_fields
from distlab.config.finetuning import LORA_TARGETS, Finetuning
from distlab.config.launch import BACKENDS, DEVICES, Launch
from distlab.config.mesh import MESH_ORDERS, SCHEDULES, Mesh
from distlab.config.model import MODELS, Model
from distlab.config.parallelism import (ALLREDUCE_ALGORITHMS, COMPRESSIONS, DP_GATHERS,
                                        FSDP_LAYOUTS, Parallelism)
from distlab.config.precision import LOSS_SCALES, PRECISIONS, Precision
from distlab.config.reads import FEATURE_FIELDS, FEATURES, check_features, check_knobs
from distlab.config.sections import SECTIONS, declarations
from distlab.config.training import CHECKPOINTING, OPTIMIZERS, Training
from distlab.parallel import STRATEGIES, knobs, strategy_class


# dataclasses takes the fields of the last base first: reversed, they come in SECTIONS' order
@dataclasses.dataclass
class RunConfig(*reversed(SECTIONS.values())):
    """One run: what to train, how to parallelise it, and how to launch it.

    `global_batch` is the batch of one optimizer step across all ranks; data-parallel strategies
    give each rank `global_batch // world_size` rows of it, so runs at any world size see the
    same data and can be compared with `single` step by step.
    """

    def __post_init__(self):
        # Each field alone first (its kind, size, least value, choices), so that the rules
        # between fields read sane values; then each section's rules. The strategy's own
        # checks come once the layout is one it runs, and before the global batch is split
        # by its data-parallel degree.
        check_fields(self)
        Mesh.pick_strategy(self)
        Model.check(self)
        check_knobs(self)
        Precision.check(self)
        Mesh.check(self)
        Finetuning.check(self)
        Checkpoints.check(self)
        strategy_class(self.strategy).check_config(self)
        Training.check(self)
        Data.check(self)
        Parallelism.check(self)
        check_features(self)
        Debugging.check(self)
        Launch.check(self)

    def replace(self, **changes) -> "RunConfig":
        """A copy with some fields changed (validated again). When the strategy changes, the
        knobs only the old one read (parallel.KNOBS: microbatches for a pipeline, bucket_mb for
        DDP, ...) go back to their defaults unless given: the same run under another strategy,
        not a config the new strategy would refuse for a knob it does not read."""
        new = changes.get("strategy", self.strategy)
        if new != self.strategy:
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            for name, readers in knobs().items():
                if name not in changes and new not in readers:
                    changes[name] = defaults[name]
        return dataclasses.replace(self, **changes)

    def as_mesh(self) -> "RunConfig":
        """The same run on the `mesh` strategy: the named strategy's preset of degrees
        (Strategy.mesh_preset). ValueError where the mesh has no equivalent."""
        from distlab.parallel import strategy_class
        preset = strategy_class(self.strategy).mesh_preset(self)
        if preset is None:
            raise ValueError(f"strategy={self.strategy!r} has no mesh preset (threads, "
                             "servers, torch's own implementations, DiLoCo and compression "
                             "are not degrees of the mesh)")
        return self.replace(strategy="mesh", **preset)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        if not isinstance(d, dict):
            raise ValueError(f"a RunConfig is read from a dict, not {type(d).__name__}")
        d = dict(d)
        # configs written before every knob was a field kept some in "extra": read them as fields
        extra = d.pop("extra", {})
        if not isinstance(extra, dict):
            raise ValueError(f"extra={extra!r} must be a dict of RunConfig fields")
        was = {decl.was: name for name, decl in declarations().items() if decl.was}
        d.update({was.get(k, k): v for k, v in extra.items()})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown RunConfig field(s): {', '.join(unknown)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)


__all__ = ["ALLREDUCE_ALGORITHMS", "BACKENDS", "BUGS", "CHECKPOINTING", "COMPRESSIONS",
           "DEVICES", "DP_GATHERS", "FAULTS", "FEATURES", "FEATURE_FIELDS", "FSDP_LAYOUTS",
           "LORA_TARGETS", "LOSS_SCALES", "MESH_ORDERS", "MODELS", "OPTIMIZERS", "PRECISIONS",
           "SCHEDULES", "SECTIONS", "STRATEGIES", "RunConfig", "declarations"]
