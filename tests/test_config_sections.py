"""Each fact about a RunConfig field has one owner.

A field is declared once, in its section (distlab.config.sections), with its help, choices,
bounds, the feature it asks for, whether a resume may change it and its panel widget; which
strategies read it is each strategy's declaration (Strategy.knobs). Everything else is built
from those: KNOBS, FEATURES and FEATURE_FIELDS, MAY_CHANGE, the panel's widgets and
PANEL_FEATURES, the command line's groups, help and choices. These tests hold the derivation
to the declarations, and fail if a hand-kept table comes back.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib

import pytest

from distlab.config import FEATURE_FIELDS, FEATURES, SECTIONS, RunConfig, declarations
from distlab.config.declare import declared
from distlab.parallel import DEGREES, KNOBS, REGISTRY, strategies, strategy_class

LIB = pathlib.Path(__file__).resolve().parent.parent / "lib" / "distlab"
FIELDS = [f.name for f in dataclasses.fields(RunConfig)]


def test_every_field_is_in_exactly_one_section_and_says_what_it_is():
    owners = {}
    for title, section in SECTIONS.items():
        assert inspect.getdoc(section) and not inspect.getdoc(section).startswith(
            section.__name__ + "("), f"section {title!r} has no docstring"
        assert callable(getattr(section, "check", None)), f"section {title!r} has no check"
        for f in dataclasses.fields(section):
            owners.setdefault(f.name, []).append(title)
    twice = {n: t for n, t in owners.items() if len(t) > 1}
    assert not twice, f"fields in more than one section: {twice}"
    assert sorted(owners) == sorted(FIELDS)  # and RunConfig is the sections, flat
    assert list(declarations()) == FIELDS
    for name, d in declarations().items():
        assert d.help.strip() and "\n" not in d.help, f"{name}: one line of help"


def test_the_flat_constructor_and_json_are_unchanged():
    cfg = RunConfig(strategy="mesh", tp=2, pp=2, global_batch=8, steps=3)
    assert cfg.world_size == 4 and cfg.dp_degree == 1
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    assert set(cfg.to_dict()) == set(FIELDS) and len(FIELDS) >= 110
    assert RunConfig.from_dict({"extra": {"classes": 3}, "model": "bnnet"}).bn_classes == 3


def test_knobs_are_what_the_strategy_classes_declare():
    declared_by = {s: strategy_class(s).knobs for s in REGISTRY}
    for s, fields in declared_by.items():
        assert fields <= set(FIELDS), f"{s} declares knobs that are not fields"
        assert {k for k, readers in KNOBS.items() if s in readers} == fields, s
    assert set(KNOBS) == set().union(*declared_by.values())
    assert all(list(r) == [s for s in REGISTRY if s in r] for r in KNOBS.values())
    # the mesh reads its own degrees and the knobs of the parts it composes
    assert declared_by["mesh"] == {"microbatches", "schedule", "virtual_stages", "pp_op_delay_s",
                                   "cp_layout", "cp_attention", "cp", "dp_shard", "dp_replicate",
                                   "zero_stage", "ep", "fsdp_prefetch", "mesh_order",
                                   "param_dtype", "reduce_dtype", "fsdp_units", "fsdp_layout", "mesh"}
    # a field is a knob, a degree or a feature's: one way of saying who reads it
    assert not set(KNOBS) & set(DEGREES) and not set(KNOBS) & set(FEATURE_FIELDS.values())


def test_knobs_only_other_strategies_read_are_refused_and_dropped_on_a_change():
    for name, readers in KNOBS.items():
        other = next(s for s in ("ddp", "allreduce") if s not in readers)
        with pytest.raises(ValueError, match=f"{name}=.*does not read it"):
            RunConfig(**{"strategy": other, "world_size": 2, name: _another_value(name)})
    diloco = RunConfig(strategy="diloco", world_size=2, sync_every=4)
    assert diloco.replace(strategy="ddp").sync_every == 8  # diloco's knob back to its default


def _another_value(name):
    f = next(f for f in dataclasses.fields(RunConfig) if f.name == name)
    choices = declared(f).options()
    if choices:
        return next(c for c in choices if c != f.default)
    kind = str(f.type)
    return "x" if kind == "str" else not f.default if kind == "bool" else f.default + 2


def test_features_are_declared_on_fields_and_supported_by_strategies():
    supported = set().union(*(strategy_class(s).supports for s in REGISTRY))
    assert supported == set(FEATURES), "a feature some strategy supports that no field asks for"
    assert FEATURE_FIELDS["moe"] == "n_experts" and "mesh" in strategies(supporting="moe")
    assert set(strategies(supporting="moe")) == {"single", "allreduce", "ddp", "ep", "mesh"}
    for feature, field in FEATURE_FIELDS.items():
        assert declarations()[field].feature.name == feature


def test_what_a_resume_may_change_is_declared_on_the_field():
    from distlab.checkpoint import MAY_CHANGE
    assert MAY_CHANGE == {n for n, d in declarations().items() if d.may_change}
    assert {"strategy", "world_size", "steps", "backend"} <= MAY_CHANGE
    assert not {"lr", "seed", "n_layer", "nodes", "link_mbit"} & MAY_CHANGE


def test_the_panel_builds_a_widget_for_every_field_that_declares_one():
    pytest.importorskip("ipywidgets")
    from distlab.lab.panel import PANEL_FEATURES, ControlPanel
    panel = ControlPanel(steps=5)
    assert set(panel.knobs) == {n for n, d in declarations().items() if d.widget}
    assert set(PANEL_FEATURES) == {"offload", "sp", "backup_workers"}
    assert {*KNOBS, *DEGREES} <= set(panel.knobs)  # every knob has its widget
    assert panel.knobs["reduce_dtype"].options[0] == ("as param dtype", "")
    assert list(panel.knobs)[:2] == ["strategy", "world_size"]  # the general knobs first


def test_the_command_line_groups_flags_by_section_with_help_choices_and_defaults():
    from distlab.__main__ import parse_config, parser
    p = parser()
    groups = {g.title: g for g in p._action_groups}
    for title, section in SECTIONS.items():
        flags = [a.option_strings[0] for a in groups[title]._group_actions]
        assert flags == ["--" + f.name.replace("_", "-") for f in dataclasses.fields(section)]
    actions = [a for a in p._actions if a.option_strings and a.dest != "help"]
    assert len(actions) == len(FIELDS) + 2 and all(a.help for a in actions)
    text = p.format_help()
    assert "--strategy {" + ",".join(strategies()) + "}" in text
    assert "--precision {fp32,bf16,fp16,fp8}" in text and "(default: 'single')" in text
    assert text.index("\nparallelism:") < text.index("--tp ") < text.index("\ndebugging:")
    # parsing as before: the same flags and types, bools as --x / --no-x, no choice enforced
    # here (RunConfig refuses with its own message)
    args, run_dir, every = parse_config(["--strategy", "ddp", "--world-size", "2", "--lr", "0.1",
                                         "--no-broadcast-buffers", "--sp", "--precision", "fp8"])
    assert (args["strategy"], args["world_size"], args["lr"]) == ("ddp", 2, 0.1)
    assert args["broadcast_buffers"] is False and args["sp"] is True
    assert args["precision"] == "fp8" and (run_dir, every) == (None, 10)
    assert set(args) == set(FIELDS)


# -- no hand-kept table comes back ---------------------------------------------------------------
def _module_assignments(path: pathlib.Path) -> dict[str, ast.AST]:
    tree = ast.parse(path.read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node.value
    return out


def _is_literal_table(value) -> bool:
    """A dict, set, tuple or list written out with string entries, or one wrapped in a call
    (frozenset({...}))."""
    if isinstance(value, ast.Call):
        return any(_is_literal_table(a) for a in value.args)
    items = (value.keys if isinstance(value, ast.Dict) else
             value.elts if isinstance(value, (ast.Set, ast.Tuple, ast.List)) else [])
    return any(isinstance(i, ast.Constant) and isinstance(i.value, str) for i in items)


@pytest.mark.parametrize("path, names", [
    ("parallel/__init__.py", ["KNOBS"]),
    ("parallel/base.py", ["FEATURES", "FEATURE_FIELDS"]),
    ("config/reads.py", ["FEATURES", "FEATURE_FIELDS"]),
    ("checkpoint/store.py", ["MAY_CHANGE"]),
    ("lab/panel.py", ["PANEL_FEATURES", "MICROBATCHES", "VIRTUAL_STAGES"]),
])
def test_no_module_keeps_a_table_of_fields_by_hand(path, names):
    assigned = _module_assignments(LIB / path)
    for name in names:
        assert name not in assigned or not _is_literal_table(assigned[name]), \
            f"{path}: {name} is written out by hand; derive it from the declarations"


def test_the_old_tables_are_gone():
    sources = {f: f.read_text() for f in LIB.rglob("*.py")}
    for name in ("MOE_STRATEGIES", "_features_asked", "_AT_MOST", "_LEGACY_EXTRA"):
        assert not [f for f, s in sources.items() if name in s], name
    assert "KNOBS = {" not in sources[LIB / "parallel" / "__init__.py"]
    # the panel builds its widgets from the declarations, not from a dict of field names
    panel = ast.parse(sources[LIB / "lab" / "panel.py"])
    make = next(n for n in panel.body if isinstance(n, ast.FunctionDef)
                and n.name == "_make_knobs")
    assert not [n for n in ast.walk(make) if isinstance(n, ast.Dict) and n.keys]
