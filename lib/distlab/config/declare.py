"""A RunConfig field, declared once: its default and everything else known about it.

    seq_len: int = declare(64, "tokens per row", at_least=1, at_most=1 << 20)

The field's metadata holds a `Declared`; what the rest of distlab knows about a field is read
from there (distlab.config.sections.declarations): the command line's help, choices and groups
(distlab.__main__), the checks of one field alone (`check_fields` below), the optional feature a
field asks a strategy for (distlab.config.reads), which fields a resumed run may change
(distlab.checkpoint.store.MAY_CHANGE), and the control panel's widget (distlab.lab.panel).
Which strategies read a field is each strategy's to declare (Strategy.knobs), not the field's.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Feature:
    """An optional feature a field asks for; strategies that implement it list `name` in
    Strategy.supports, and RunConfig refuses it under the others."""
    name: str
    says: str  # what asks for it, for the refusal: "join=True (uneven inputs: ...)"
    # whether a config asks for it; None: the field is not at its default
    asks: Callable | None = None


@dataclass(frozen=True)
class Widget:
    """The control panel's knob for a field (built by distlab.lab.panel, which alone imports
    ipywidgets). kind: "menu" (a dropdown: `offer` with the current value, else the field's
    choices, else the current value alone, for the panel to fit), "int", "float" (a box between
    low and high), "log" (a slider over 10**low .. 10**high), "check", "text"."""
    label: str
    kind: str = "menu"
    offer: tuple = ()
    low: float | None = None
    high: float | None = None
    step: float | None = None
    hint: str = ""  # a text box's placeholder
    labels: tuple = ()  # (value, label) pairs a menu shows instead of the value


@dataclass(frozen=True)
class Declared:
    """What is known about one RunConfig field besides its name, kind and default."""
    help: str  # one line: the command line's help
    # the values it accepts; a function is called when checked (the strategy registry's
    # names, which a user may extend at run time)
    choices: tuple | Callable = ()
    at_least: int | float | None = None  # alone, refused below this
    at_most: int | float | None = None  # beyond it no run finishes on a machine this is for
    feature: Feature | None = None
    may_change: bool = False  # a resumed run may change it (distlab.checkpoint.store)
    widget: Widget | None = None
    was: str = ""  # its name in configs written before it was a field (their "extra")

    def options(self) -> tuple:
        return self.choices() if callable(self.choices) else self.choices


def declare(default, help: str, **facts) -> dataclasses.Field:
    """A dataclass field with its default and what is declared about it (Declared's fields)."""
    return field(default=default, metadata={"declared": Declared(help, **facts)})


def declared(f: dataclasses.Field) -> Declared:
    return f.metadata["declared"]


# -- one field alone ---------------------------------------------------------------------------
_KINDS = {"bool": "True or False", "int": "an integer (not a bool)",
          "float": "a finite number", "str": "a string"}


def check_fields(cfg) -> None:
    """Each field alone, before any rule between fields reads it: it holds what it declares
    (an int is not a bool nor a float, a number not a string, a float is finite), it is not
    absurdly large, not below its least value, and one of its choices."""
    for f in dataclasses.fields(cfg):
        _check_kind(cfg, f.name, str(f.type))
    for f in dataclasses.fields(cfg):
        check_at_most(cfg, f.name)
    for f in dataclasses.fields(cfg):
        d, value = declared(f), getattr(cfg, f.name)
        if d.choices:
            choice(f.name, value, d.options())
        if d.at_least is not None and value < d.at_least:
            kind = "an integer" if str(f.type) == "int" else "a number"
            raise ValueError(f"{f.name}={value!r} must be {kind} >= {d.at_least}")


def check_at_most(cfg, name: str) -> None:
    most, value = declared(cfg.__dataclass_fields__[name]).at_most, getattr(cfg, name)
    if most is not None and value > most:
        raise ValueError(f"{name}={value!r} is more than this tool is for (at most {most:,})")


def _check_kind(cfg, name: str, kind: str) -> None:
    value = getattr(cfg, name)
    if kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "int":
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    elif kind == "float":
        ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
              and math.isfinite(value))
    else:
        ok = isinstance(value, str)
    if not ok:
        raise ValueError(f"{name}={value!r} must be {_KINDS[kind]}")
    if kind in ("int", "float"):  # NumPy's scalars as Python's: configs are JSON
        setattr(cfg, name, int(value) if kind == "int" else float(value))


def choice(name, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of: {', '.join(map(repr, choices))}")


def positive_int(name, value, minimum=1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
