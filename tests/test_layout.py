"""The layout: no import cycle among mtpflow's modules beyond an explicit,
shrinking allow-list.  ``python tests/test_layout.py`` also prints the cycles
and the functions over ~80 and modules over ~600 lines (a report, not a gate).

Imports are read with ``ast`` from every module under ``mtpflow/``; module-level
and function-level imports count together (a function-level import is a
dependency all the same); imports under ``if TYPE_CHECKING:`` do not (they
exist for annotations only).  A
``from pkg import name`` counts as an import of ``pkg.name`` when that is a
module, else of ``pkg``.  Modules, not packages, are the nodes.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "mtpflow"

#: the cycles that remain (each a sorted tuple of its modules): none, and none may come back
ALLOWED_CYCLES: set[tuple[str, ...]] = set()
#: report thresholds
MAX_FUNCTION_LINES, MAX_MODULE_LINES = 80, 600


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for b in ast.walk(tree) if isinstance(b, ast.If) and _is_type_checking(b.test)
                   for stmt in b.body for n in ast.walk(stmt)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                out.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod)
    return {m for m in out if m in MODULES and m != name}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@functools.cache
def import_graph() -> dict[str, set[str]]:
    return {name: _imports(name, path) for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.add(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {("a", "b", "c")}
    assert cycles({"a": {"b"}, "b": set()}) == set()


def test_no_import_cycle_beyond_the_allowed_ones():
    found = cycles(import_graph())
    new = found - ALLOWED_CYCLES
    assert not new, f"new import cycle(s): {sorted(new)}"
    gone = ALLOWED_CYCLES - found
    assert not gone, f"cycle(s) gone: remove them from ALLOWED_CYCLES: {sorted(gone)}"


def test_the_graph_sees_module_and_function_level_imports():
    g = import_graph()
    assert "mtpflow.state" in g["mtpflow.targets.base"]  # module level
    assert "mtpflow.targets.cache" in g["mtpflow.state"]  # inside BatchState.merge
    assert "mtpflow.convert.files" in g["mtpflow.convert.packaged"]
    assert "mtpflow.engine" not in g["mtpflow.hookspecs"]  # for annotations only, under TYPE_CHECKING


#: imports from one drafter kind's folder into another's (the list may only shrink): what
#: kinds share lives in a neutral module (``mtpflow/drafters/base.py``, ``layers.py``)
ALLOWED_CROSS_KIND: set[tuple[str, str]] = set()


def _kind_of(module: str) -> str | None:
    """The drafter kind folder ``module`` belongs to (``None``: not in one)."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "drafters":
        return None
    folder = PKG / "drafters" / parts[2]
    return parts[2] if folder.is_dir() else None


def cross_kind_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(m, d) for m, deps in graph.items() for d in deps
            if _kind_of(m) is not None and _kind_of(d) is not None and _kind_of(m) != _kind_of(d)}


def test_drafter_kinds_import_shared_pieces_from_a_neutral_module():
    found = cross_kind_imports(import_graph())
    assert not found - ALLOWED_CROSS_KIND, f"a drafter kind imports another kind's folder: {sorted(found - ALLOWED_CROSS_KIND)}"
    gone = ALLOWED_CROSS_KIND - found
    assert not gone, f"gone: remove them from ALLOWED_CROSS_KIND: {sorted(gone)}"
    assert cross_kind_imports({"mtpflow.drafters.eagle3.model": {"mtpflow.drafters.dflash.model", "mtpflow.drafters.base"},
                               "mtpflow.drafters.base": {"mtpflow.drafters.ngram"}}) == {
        ("mtpflow.drafters.eagle3.model", "mtpflow.drafters.dflash.model")}


#: train/ modules that may import a drafter kind's folder: ``mtpflow eval`` (its offline scoring
#: replays assistant drafters) and the modules that re-export names from where they used to live
TRAIN_ABOVE_THE_KINDS = {"mtpflow.train.eval", "mtpflow.train.loop", "mtpflow.train.kinds", "mtpflow.train.mtp"}
#: names of drafter kinds (registered or ``--kind``) a ``kind == ...`` branch would name
KIND_NAMES = {"assistant", "eagle3", "dflash", "mtp", "native_mtp", "ngram", "model"}


def kind_branches(path: Path) -> list[int]:
    """Lines of ``path`` that compare something called ``kind`` (``kind``, ``cfg.kind``,
    ``self.kind`` ...) with a drafter kind's name."""

    def named_kind(e):
        return (isinstance(e, ast.Name) and e.id.endswith("kind")) or (
            isinstance(e, ast.Attribute) and e.attr.endswith("kind"))

    def kind_name(e):
        if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
            return any(kind_name(x) for x in e.elts)
        return isinstance(e, ast.Constant) and e.value in KIND_NAMES

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(named_kind(x) for x in sides) and any(kind_name(x) for x in sides):
                out.append(node.lineno)
    return out


def test_train_knows_no_drafter_kind():
    """train/ holds the kind-independent parts: below the kinds it imports no kind's folder, no
    train/ module branches on a kind (each kind's trainer is found through the plugins), and
    nothing in mtpflow imports the re-exporting modules."""
    g = import_graph()
    for m in MODULES:
        if m.startswith("mtpflow.train") and m not in TRAIN_ABOVE_THE_KINDS:
            assert not {d for d in g[m] if _kind_of(d)}, f"{m} imports a drafter kind: {sorted(d for d in g[m] if _kind_of(d))}"
        if m.startswith("mtpflow.train"):
            assert not kind_branches(MODULES[m]), f"{m} branches on a drafter kind at line(s) {kind_branches(MODULES[m])}"
    for thin in ("mtpflow.train.loop", "mtpflow.train.kinds", "mtpflow.train.mtp"):
        assert not [m for m, deps in g.items() if thin in deps], f"{thin} is imported inside mtpflow"


def test_the_kind_branch_finder_finds_one(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('if cfg.kind != "assistant":\n    pass\nif kind in ("eagle3", "dflash"):\n    pass\n'
                 'if kind == "gpu":\n    pass\n')
    assert kind_branches(f) == [1, 3]


def long_functions() -> list[tuple[int, str]]:
    out = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append((n, f"{name}:{node.name}"))
    return sorted(out, reverse=True)


def long_modules() -> list[tuple[int, str]]:
    sizes = ((len(p.read_text().splitlines()), n) for n, p in MODULES.items())
    return sorted(((n, m) for n, m in sizes if n > MAX_MODULE_LINES), reverse=True)


if __name__ == "__main__":
    for c in sorted(cycles(import_graph())):
        print("cycle:", " -> ".join(c))
    for n, f in long_functions():
        print(f"function {n:5d}  {f}")
    for n, m in long_modules():
        print(f"module   {n:5d}  {m}")
