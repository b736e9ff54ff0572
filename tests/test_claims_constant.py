"""No claims row counts as evidence with a verdict that cannot depend on the run (issue 42, 2).

The scan reads every notebook's source (workbook/NN_name.py, all cells as one module) and
every companion module under lib/distlab/lab, finds each `claim(...)` call, and asks whether
its verdict (`holds`) could change if the run measured something else. A row whose basis is
"measured", "timed" or "modelled" (the bases the interview index cites as evidence) must not
have one that is constant: a formula evaluated at constants only (a paper's configuration, an
interview answer's numbers) is basis "arithmetic".

"Constant" is decided by a flow-insensitive pass over the names a notebook (or a function)
assigns: a value is constant if it is a literal, a name every assignment of which is constant,
an operator, comparison, container, subscript or attribute of constants, or a call of a pure
function (a builtin such as round/abs/max, or anything reached through distlab.theory,
distlab.units, distlab.comm's formulas or math), or a method of a constant value, with
constant arguments. Everything else can
carry a measurement: a call of any other function (launch, a Run's history, allocated_bytes),
a function's parameters, a name assigned from one.

What it catches: a literal verdict (`claim(..., True)`), and a verdict computed from constants
only, however many names and theory formulas it goes through (70e9 / 8 rounded, a ZeRO table
computed from the paper's Ψ and N_d, an α-β time on published link figures), when the row is
labelled measured, timed or modelled. Run on the sources before issue 42's fixes it flagged
03's ZeRO table, 04's 70B rows and 80 GB row, 05's "TP within a node" and 03's "10 GB model".

What it cannot catch: an identity over measured values (`x - (x - 2y) == 2y`), a check too
loose to fail (`0.4 <= mfu` for a 40-50% claim), and a measuring call whose result does not
reach the verdict in a way that matters; nor a function outside the pure list that in fact
computes only from its constant arguments (it is taken to measure). Those need the row
builders' own tests with inputs that flip the verdict (tests/test_claims.py and below).
"""

from __future__ import annotations

import ast
import builtins
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "workbook").glob("[0-9][0-9]_*.py"))
COMPANIONS = sorted((ROOT / "lib" / "distlab" / "lab").glob("*.py"))

EVIDENCE = ("measured", "timed", "modelled")  # the bases a constant verdict must not carry
PURE_MODULES = ("distlab.theory", "distlab.units", "distlab.comm", "math")
PURE_BUILTINS = {"abs", "all", "any", "bool", "dict", "divmod", "enumerate", "float", "int",
                 "len", "list", "max", "min", "pow", "range", "reversed", "round", "set",
                 "sorted", "str", "sum", "tuple", "zip", "isinstance"}
CONTAINER_MUTATORS = {"append", "extend", "update", "add", "insert", "setdefault"}
BASIS_POSITION, HOLDS_POSITION = 4, 3  # claim(claim, source, figure, holds, basis)

# Rows that other work items fix (issue 42): they are listed by notebook and claim text, so the
# scan still runs over them and says so, and a new constant row anywhere else fails.
KNOWN: set[tuple[str, str]] = set()


class _Scope:
    """Which names of one module (or one function) hold constants."""

    def __init__(self, body: list[ast.stmt], outer: set[str] = frozenset(),
                 unknown: set[str] = frozenset()):
        self.pure_aliases = set(outer)  # names bound to pure modules or their members
        self.const = set(outer)
        assigned: dict[str, list[ast.expr | None]] = {}
        for node in _statements(body):
            self._collect(node, assigned)
        # names a function receives as parameters are unknown: they may carry a measurement
        for name in unknown:
            assigned.setdefault(name, []).append(None)
        candidates = set(assigned)
        self.const |= candidates
        changed = True
        while changed:  # drop every name with an assignment that is not constant
            changed = False
            for name in list(candidates):
                if any(v is None or not self.is_const(v) for v in assigned[name]):
                    candidates.discard(name)
                    self.const.discard(name)
                    changed = True

    def _collect(self, node: ast.stmt, assigned: dict):
        def bind(target, value):
            if isinstance(target, (ast.Tuple, ast.List, ast.Starred)):  # a, d[k] = ...: each
                for t in (target.elts if not isinstance(target, ast.Starred) else [target.value]):
                    bind(t, value)  # depends on the whole value
                return
            if isinstance(target, ast.Name):
                assigned.setdefault(target.id, []).append(value)
            if isinstance(target, (ast.Subscript, ast.Attribute)):  # d[k] = v: d depends on v
                base = target
                while isinstance(base, (ast.Subscript, ast.Attribute)):
                    base = base.value
                if isinstance(base, ast.Name):
                    assigned.setdefault(base.id, []).append(value)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            module = getattr(node, "module", None) or ""
            for alias in node.names:
                name = alias.asname or alias.name.split(".")[0]
                full = f"{module}.{alias.name}" if module else alias.name
                pure = full.startswith(PURE_MODULES) or module in PURE_MODULES
                assigned.setdefault(name, []).append(ast.Constant(0) if pure else None)
                if pure:
                    self.pure_aliases.add(name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                bind(target, node.value)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
            bind(node.target, node.value if isinstance(node, ast.AnnAssign) else
                 ast.BinOp(node.target, ast.Add(), node.value))
        elif isinstance(node, (ast.For, ast.comprehension)):
            bind(node.target, node.iter)
        elif isinstance(node, (ast.With,)):
            for item in node.items:
                if item.optional_vars is not None:
                    bind(item.optional_vars, None)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            assigned.setdefault(node.name, []).append(None)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            f = node.value.func  # rows.append(x): rows depends on x
            if isinstance(f, ast.Attribute) and f.attr in CONTAINER_MUTATORS and \
                    isinstance(f.value, ast.Name):
                for arg in node.value.args:
                    assigned.setdefault(f.value.id, []).append(arg)
        elif isinstance(node, (ast.Try,)):
            for h in node.handlers:
                if h.name:
                    assigned.setdefault(h.name, []).append(None)

    def _pure_call(self, func: ast.expr, local: frozenset) -> bool:
        if isinstance(func, ast.Name):
            return func.id in self.pure_aliases or (
                func.id in PURE_BUILTINS and func.id in dir(builtins))
        base = func
        while isinstance(base, ast.Attribute):
            base = base.value
        if isinstance(base, ast.Name) and base.id in self.pure_aliases:
            return True  # E.zero_table(...), math.log2(...)
        # a method of a constant value: {...}.values(), "...".format(...)
        return isinstance(func, ast.Attribute) and self.is_const(func.value, local)

    def is_const(self, node: ast.expr, local: frozenset = frozenset()) -> bool:
        if isinstance(node, ast.Constant):
            return True
        if isinstance(node, ast.Name):
            return node.id in self.const or node.id in local
        if isinstance(node, ast.Call):
            return self._pure_call(node.func, local) and all(
                self.is_const(a, local) for a in [*node.args, *(k.value for k in node.keywords)])
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            inner = set(local)
            for gen in node.generators:
                if not self.is_const(gen.iter, frozenset(inner)):
                    return False
                inner |= {t.id for t in ast.walk(gen.target) if isinstance(t, ast.Name)}
            parts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
            parts += [c for gen in node.generators for c in gen.ifs]
            return all(self.is_const(p, frozenset(inner)) for p in parts)
        if isinstance(node, ast.Lambda):
            return False
        if isinstance(node, ast.Attribute):
            return self.is_const(node.value, local)
        children = [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.expr)]
        return all(self.is_const(c, local) for c in children)


def _statements(body):
    """Every statement of a module or function body, nested blocks included, function and
    class bodies excluded (they are scopes of their own)."""
    for node in body:
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            yield from _statements(getattr(node, field, []) or [])
        if isinstance(node, (ast.Assign, ast.Expr, ast.AugAssign, ast.Return)):
            for sub in ast.walk(node):  # comprehension targets bind their iterables' values
                if isinstance(sub, ast.comprehension):
                    yield sub


def _claim_calls(body):
    for node in body:
        for sub in ast.walk(node) if not isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef)) else ():
            if isinstance(sub, ast.Call) and (
                    (isinstance(sub.func, ast.Name) and sub.func.id == "claim")
                    or (isinstance(sub.func, ast.Attribute) and sub.func.attr == "claim")):
                yield sub


def _arg(call: ast.Call, position: int, name: str):
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return call.args[position] if len(call.args) > position else None


def constant_rows(source: str) -> list[tuple[str, int]]:
    """(claim text, line) of every claim(...) row in `source` labelled as evidence whose
    verdict is constant: at module level and in each function (its parameters unknown)."""
    tree = ast.parse(source)
    found = []

    def scan(body, scope):
        for call in _claim_calls(body):
            basis = _arg(call, BASIS_POSITION, "basis")
            basis = basis.value if isinstance(basis, ast.Constant) else "measured"
            holds = _arg(call, HOLDS_POSITION, "holds")
            if basis in EVIDENCE and holds is not None and scope.is_const(holds):
                text = _arg(call, 0, "claim")
                found.append((ast.unparse(text), call.lineno))

    module = _Scope(tree.body)
    scan(tree.body, module)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = {a.arg for a in [*node.args.posonlyargs, *node.args.args,
                                      *node.args.kwonlyargs]}
            params |= {a.arg for a in (node.args.vararg, node.args.kwarg) if a}
            scope = _Scope(node.body, outer=module.const & module.pure_aliases | module.const,
                           unknown=params)
            scope.pure_aliases |= module.pure_aliases
            scan(node.body, scope)
    return found


# -- the checker itself: it flags a constant row, and passes a measured one ----------------------
def test_the_scan_flags_a_literal_and_a_verdict_made_of_constants():
    src = '''
from distlab.lab.common import claim
from distlab.theory import estimate as E
PSI = 70e9
per_gpu = PSI / 8
zero = E.zero_table(7.5e9, 64)
rows = [
    claim("literal", "s", "f", True),
    claim("70B / 8", "s", f"{per_gpu:g}", round(per_gpu / 1e9) == 9),
    claim("table", "s", "f", list(zero.values()) == [1, 2], basis="timed"),
    claim("same, labelled", "s", "f", round(per_gpu / 1e9) == 9, basis="arithmetic"),
]
'''
    assert [c for c, _ in constant_rows(src)] == ["'literal'", "'70B / 8'", "'table'"]


def test_the_scan_passes_a_verdict_that_reads_the_run():
    src = '''
from distlab import launch
from distlab.lab.common import claim
run = launch(cfg)
n = run.info("n_params")
mem = run.history("step")[-1]["memory"]
rows = [claim("4 bytes", "s", "f", mem["params"] == 4 * n)]
def row(alloc):
    return claim("grads", "s", "f", alloc["grads"] == alloc["params"])
def bad_row(alloc):
    return claim("grads", "s", "f", 4 == 4)
'''
    assert [c for c, _ in constant_rows(src)] == ["'grads'"]  # bad_row's, not row's


def test_the_scan_follows_containers_and_loops():
    src = '''
from distlab.lab.common import claim
import math
sizes = {}
for t in (2, 4):
    sizes[t] = math.log2(t)
measured, other = {}, {}
for t in (2, 4):
    measured[t], other[t] = time_it(t)
rows = [claim("const", "s", "f", all(v < 3 for v in sizes.values())),
        claim("timed", "s", "f", all(v < 3 for v in measured.values()), basis="timed")]
'''
    assert [c for c, _ in constant_rows(src)] == ["'const'"]


# -- the scan over the workbook -------------------------------------------------------------------
@pytest.mark.parametrize("path", NOTEBOOKS + COMPANIONS, ids=lambda p: p.name)
def test_no_evidence_row_has_a_verdict_the_run_cannot_change(path):
    found = [(c, line) for c, line in constant_rows(path.read_text())
             if (path.stem[:2], c) not in KNOWN]
    assert not found, (
        f"{path.relative_to(ROOT)}: rows labelled {'/'.join(EVIDENCE)} whose verdict is built from "
        f"constants only (make it a measurement, or basis='arithmetic'): {found}")


# -- the row builders this issue added: other measurements, other verdicts -----------------------
def test_allocator_rows_follow_the_bytes():
    from distlab.lab.start_here import memory_rows
    fp32 = {"n_params": 10, "n_tensors": 2, "params": 40, "grads": 40, "optim": 88}
    assert [r["holds"] for r in memory_rows(fp32)] == [True, True, True]
    bf16 = {**fp32, "params": 20, "grads": 20, "optim": 48}  # a model built in 2-byte floats
    assert [r["holds"] for r in memory_rows(bf16)] == [False, True, True]
    kept = {**fp32, "grads": 80, "optim": 128}  # a second copy of the gradients kept
    assert [r["holds"] for r in memory_rows(kept)] == [True, False, False]


def test_seq_len_row_reads_the_two_lengths():
    from distlab.config import RunConfig
    from distlab.lab.memory_and_precision import seq_len_configs, seq_len_row, seq_len_scaling
    cfgs = seq_len_configs(RunConfig(n_layer=2, n_embd=32, n_head=2), lengths=(256, 64))
    linear = {(k, s): 1000 * s for k, s in cfgs}
    squared = {**linear, ("unfused", 256): 1000 * 256 + 40 * 256 ** 2,
               ("unfused", 64): 1000 * 64 + 40 * 64 ** 2}
    assert seq_len_row(seq_len_scaling(linear, cfgs), 0.5)["holds"] is True
    row = seq_len_row(seq_len_scaling(squared, cfgs), 0.5)
    assert row["holds"] is False and "unfused attention ×" in row["figure"]
    assert seq_len_scaling(squared, cfgs)["unfused"]["s2_bytes"] == 40 * 256 ** 2
