"""Which strategy reads which RunConfig field, from the declarations that say so: a strategy's
`knobs`, `degrees` and `supports` (distlab.parallel.base.Strategy) and a field's Feature
(distlab.config.declare).

* A knob is a field only some strategies read (distlab.parallel.KNOBS, built from each class's
  `knobs`). Under any other strategy a value other than its default would be ignored in
  silence, so RunConfig refuses it.
* A feature is optional behaviour a field asks for (lora_rank > 0 asks for "lora"); RunConfig
  refuses it under a strategy that does not list it in `supports`.
* tp and pp are read by the strategies that declare them in `degrees`.
"""

from __future__ import annotations

import dataclasses

from distlab.config.declare import declared
from distlab.config.sections import declarations
from distlab.parallel import DEGREES, knobs, strategies, strategy_class

# {feature: what asks for it} and {feature: the field that asks for it}
FEATURES = {d.feature.name: d.feature.says for d in declarations().values() if d.feature}
FEATURE_FIELDS = {d.feature.name: name for name, d in declarations().items() if d.feature}


def features_asked(cfg) -> dict[str, bool]:
    """{feature: whether cfg asks for it}: its Feature's `asks`, else its field is not at its
    default."""
    out = {}
    for f in dataclasses.fields(cfg):
        feature = declared(f).feature
        if feature is not None:
            asked = feature.asks(cfg) if feature.asks else getattr(cfg, f.name) != f.default
            out[feature.name] = bool(asked)
    return out


def check_knobs(cfg) -> None:
    """A knob only other strategies read would be ignored in silence: refuse it."""
    readers = knobs()
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in readers and cfg.strategy not in readers[f.name] and value != f.default:
            raise ValueError(f"{f.name}={value!r}: strategy {cfg.strategy!r} does not read it "
                             f"(only {', '.join(readers[f.name])}); leave it at {f.default!r}")


def check_features(cfg) -> None:
    """Every feature asked for must be one the strategy declares it supports."""
    supports = strategy_class(cfg.strategy).supports
    for feature, asked in features_asked(cfg).items():
        if asked and feature not in supports:
            raise ValueError(f"{FEATURES[feature]}: strategy {cfg.strategy!r} does not "
                             f"support it; strategies that do: "
                             f"{', '.join(strategies(supporting=feature)) or 'none'}")


def strategy_knobs() -> tuple[str, ...]:
    """The RunConfig fields that only some strategies read: the knobs, the model-parallel
    degrees (Strategy.degrees) and the fields that ask for a feature (Strategy.supports)."""
    return (*knobs(), *DEGREES, *FEATURE_FIELDS.values())


def reads(strategy: str, field: str) -> bool:
    """Whether `strategy` reads RunConfig field `field`: a knob under the strategies that
    declare it, tp and pp under those declaring the degree, a feature's field under those
    supporting the feature; any other field every strategy reads."""
    cls = strategy_class(strategy)
    if field in knobs():
        return field in cls.knobs
    if field in DEGREES:
        return field in cls.degrees
    feature = {f: name for name, f in FEATURE_FIELDS.items()}.get(field)
    return feature is None or feature in cls.supports
