"""RunConfig's sections, the one list: each a dataclass of the fields one subsystem owns, with
that subsystem's check. RunConfig is all of them in one flat dataclass, fields in this order.

A field is declared once, in its section (distlab.config.declare); `declarations()` is what
every other place reads about fields: the command line, the checks of one field alone, the
features, what a resume may change, the control panel's widgets.
"""

from __future__ import annotations

import dataclasses

from distlab.config.checkpoints import Checkpoints
from distlab.config.data import Data
from distlab.config.debugging import Debugging
from distlab.config.declare import Declared, declared
from distlab.config.finetuning import Finetuning
from distlab.config.launch import Launch
from distlab.config.mesh import Mesh
from distlab.config.model import Model
from distlab.config.parallelism import Parallelism
from distlab.config.precision import Precision
from distlab.config.training import Training

# title (the command line's group) -> section
SECTIONS = {
    "parallelism": Parallelism,
    "training": Training,
    "model": Model,
    "data": Data,
    "precision": Precision,
    "mesh": Mesh,
    "launch and nodes": Launch,
    "checkpoints": Checkpoints,
    "fine-tuning": Finetuning,
    "debugging": Debugging,
}


def declarations() -> dict[str, Declared]:
    """{field name: what is declared about it}, every RunConfig field in RunConfig's order."""
    return {f.name: declared(f) for section in SECTIONS.values()
            for f in dataclasses.fields(section)}
