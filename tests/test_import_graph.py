"""lossagg's imports go one way.

* The import graph of lossagg's modules, read from their source (the imports a module runs
  when it is imported: module level, class bodies and ``try``/``if`` blocks included, ``if
  TYPE_CHECKING:`` blocks left out), has no cycle; a cycle fails the test, naming it with the
  lines that make it.
* The modules form the layers listed in ``lossagg/__init__.py``'s docstring: every module is
  in one, and imports only from its own layer or the ones before it.
* An import inside a function defers an optional heavy dependency (torch, a peer, the
  demo's training) and says so in a comment; of lossagg's own modules only those in
  :data:`FUNCTION_LEVEL_IMPORTS`, each with its reason.
* Every lossagg module imports as the first import of a fresh interpreter, and all of them
  in a few shuffled orders (a module of an optional peer is skipped when the peer is absent).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import random
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from tiers import FULL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "lossagg")

#: Imports of lossagg modules inside a function, (importer, imported) -> why it is deferred.
#: Only an optional heavy dependency may be deferred, never a cycle dodged.
FUNCTION_LEVEL_IMPORTS = {
    ("lossagg.totals", "lossagg.validate"): (
        "lossagg.validate imports torch, and the step totals are part of the configuration (config -> modes -> totals), which imports "
        "without torch: their checks reach it when a plan is built"
    ),
    ("lossagg.demo", "lossagg.demo.train"): (
        "the demo's training imports torch; the demo's options (this module) are built by `lossagg --help` and `lossagg check`, which work without it"
    ),
}
#: Modules that need an optional peer package, and the peer.
OPTIONAL_PEERS = {"lossagg.integrations.trl": "trl"}
#: Modules the build writes (not in a fresh checkout).
GENERATED = {"lossagg._build_info"}
SHUFFLED_ORDERS = 3 if FULL else 1  # the full tier (tests/tiers.py) tries three orders


# ------------------------------------------------------------------ reading the source
@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    path: str  # relative to the repository
    line: int
    in_function: bool
    commented: bool  # a comment on its line or the line above

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def module_files(package_dir: str = PACKAGE) -> dict[str, str]:
    """lossagg's modules: dotted name -> file."""
    found = {}
    for folder, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and os.path.exists(os.path.join(folder, d, "__init__.py")))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(folder, name), os.path.dirname(package_dir))[: -len(".py")]
            parts = rel.split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = os.path.join(folder, name)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules) -> list[str]:
    """The lossagg modules an import statement runs (the nearest module for a name that is not one)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = importer.split(".") if is_package else importer.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            base = ".".join(base + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules or f"{base}.{alias.name}" in GENERATED else base for alias in node.names]
    out: list[str] = []
    for name in names:
        if name != "lossagg" and not name.startswith("lossagg."):
            continue
        while name not in modules and name not in GENERATED and "." in name:
            name = name.rsplit(".", 1)[0]
        # importing lossagg.a.b runs lossagg.a's __init__ first: an edge to it too, unless the
        # importer is inside lossagg.a (then lossagg.a is already being imported)
        parts = name.split(".")
        for i in range(2, len(parts)):
            package = ".".join(parts[:i])
            if not (importer == package or importer.startswith(package + ".")):
                out.append(package)
        out.append(name)
    return list(dict.fromkeys(out))


def _other_imports(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] != "lossagg"]
    return [] if node.level or (node.module or "").split(".")[0] == "lossagg" else [node.module or ""]


def _read_module(name: str, path: str, files: dict[str, str]) -> tuple[list[Import], list[Import]]:
    """(imports of lossagg modules, imports of anything else made inside a function) of one module."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    lines = source.splitlines()
    rel = os.path.relpath(path, ROOT)
    is_package = path.endswith("__init__.py")
    ours: list[Import] = []
    others: list[Import] = []

    def commented(line: int) -> bool:
        return "#" in lines[line - 1] or (line >= 2 and lines[line - 2].strip().startswith("#"))

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:  # the body runs only under a type checker
                visit(child, in_function)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in _targets(node, name, is_package, files):
                ours.append(Import(name, target, rel, node.lineno, in_function, commented(node.lineno)))
            if in_function:
                for target in _other_imports(node):
                    others.append(Import(name, target, rel, node.lineno, True, commented(node.lineno)))
            return
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(source, filename=path), False)
    return ours, others


def read_imports(files: dict[str, str]) -> tuple[list[Import], list[Import]]:
    """(imports of lossagg modules, imports of anything else made inside a function), of every module."""
    ours: list[Import] = []
    others: list[Import] = []
    for name, path in files.items():
        found, other = _read_module(name, path, files)
        ours += found
        others += other
    return ours, others


def module_graph(imports: list[Import]) -> dict[str, dict[str, list[Import]]]:
    """importer -> imported -> the module-level imports that make the edge (self-imports left out)."""
    graph: dict[str, dict[str, list[Import]]] = {}
    for imp in imports:
        if not imp.in_function and imp.imported != imp.importer:
            graph.setdefault(imp.importer, {}).setdefault(imp.imported, []).append(imp)
    return graph


def find_cycles(graph: dict[str, dict[str, list[Import]]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan):
    the shortest one through the component's first module (by name), closed (first == last)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, {})):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)

    cycles = []
    for component in components:
        members = set(component)
        start = component[0]
        # the shortest way back to start, breadth first inside the component
        paths = {start: [start]}
        queue = [start]
        cycle = None
        while queue and cycle is None:
            v = queue.pop(0)
            for w in sorted(graph.get(v, {})):
                if w == start:
                    cycle = [*paths[v], start]
                    break
                if w in members and w not in paths:
                    paths[w] = [*paths[v], w]
                    queue.append(w)
        cycles.append(cycle)
    return cycles


def strongly_connected(graph, start: str) -> list[str]:
    """The modules that import ``start`` and are imported by it, directly or not (its circle)."""

    def reach(edges) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for w in edges.get(todo.pop(), ()):
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen

    backward: dict[str, set[str]] = {}
    for v, targets in graph.items():
        for w in targets:
            backward.setdefault(w, set()).add(v)
    return sorted(reach(graph) & reach(backward))


def describe_cycle(cycle: list[str], graph) -> str:
    steps = [f"  {a} -> {b}  ({', '.join(imp.where() for imp in graph[a][b])})" for a, b in zip(cycle, cycle[1:], strict=False)]
    circle = strongly_connected(graph, cycle[0])
    return " -> ".join(cycle) + "\n" + "\n".join(steps) + f"\n  (the circle holds {len(circle)} modules: {', '.join(circle)})"


def layers(init_path: str = os.path.join(PACKAGE, "__init__.py")) -> dict[str, tuple[int, str]]:
    """module -> (layer number, layer name), from the list in lossagg/__init__.py's docstring."""
    with open(init_path, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    out: dict[str, tuple[int, str]] = {}
    # a layer's list may go on over indented lines
    for number, title, names in re.findall(r"^(\d+)\. ([^:\n]+): (.+(?:\n {3,}\S.*)*)$", doc, flags=re.M):
        for short in (n.strip() for n in names.split(",")):
            module = "lossagg" if short == "lossagg" else f"lossagg.{short}"
            assert module not in out, f"{module} is listed in two layers of lossagg/__init__.py's docstring"
            out[module] = (int(number), title)
    return out


# ---------------------------------------------------------------------------- the tests
FILES = module_files()
IMPORTS, OTHER_FUNCTION_IMPORTS = read_imports(FILES)
GRAPH = module_graph(IMPORTS)


def test_the_reader_sees_lossaggs_modules_and_their_imports():
    expected = {"lossagg", "lossagg.modes", "lossagg.config", "lossagg.config.model", "lossagg.ops", "lossagg.step", "lossagg.integrations.verl"}
    assert expected <= set(FILES)
    assert "lossagg.modes" in GRAPH["lossagg.config.model"]
    assert "lossagg.ops" in GRAPH["lossagg"]
    # if TYPE_CHECKING: blocks are left out (lossagg/__init__.py names every module in one)
    assert "lossagg.step" not in GRAPH["lossagg"]


def test_no_import_cycle():
    cycles = find_cycles(GRAPH)
    assert not cycles, "import cycle(s) among lossagg's modules (module-level imports):\n" + "\n".join(describe_cycle(c, GRAPH) for c in cycles)


def test_every_module_is_in_a_layer_and_imports_only_from_its_own_or_earlier_ones():
    table = layers()
    assert table, "lossagg/__init__.py's docstring lists no layers ('1. name: module, module')"
    unlisted = sorted(set(FILES) - set(table))
    assert not unlisted, f"modules in no layer of lossagg/__init__.py's docstring: {', '.join(unlisted)}"
    missing = sorted(set(table) - set(FILES) - GENERATED)
    assert not missing, f"lossagg/__init__.py's docstring lists modules that do not exist: {', '.join(missing)}"
    upward = [
        f"{imp.where()}: {a} (layer {table[a][0]}, {table[a][1]}) imports {b} (layer {table[b][0]}, {table[b][1]})"
        for a, targets in GRAPH.items()
        for b, found in targets.items()
        for imp in found
        if table[b][0] > table[a][0]
    ]
    assert not upward, "imports that go up the layers:\n" + "\n".join(upward)


def test_imports_inside_functions_only_defer_an_optional_dependency_and_say_so():
    ours = [imp for imp in IMPORTS if imp.in_function]
    not_allowed = [
        f"{imp.where()}: {imp.importer} imports {imp.imported}" for imp in ours if (imp.importer, imp.imported) not in FUNCTION_LEVEL_IMPORTS
    ]
    assert not not_allowed, (
        "imports of lossagg modules inside functions (move them to module level; if one defers an optional heavy dependency, add it to "
        "FUNCTION_LEVEL_IMPORTS with the reason):\n" + "\n".join(not_allowed)
    )
    stale = sorted(set(FUNCTION_LEVEL_IMPORTS) - {(imp.importer, imp.imported) for imp in ours})
    assert not stale, f"FUNCTION_LEVEL_IMPORTS lists imports that no longer exist: {stale}"
    silent = [f"{imp.where()}: {imp.importer} imports {imp.imported}" for imp in [*ours, *OTHER_FUNCTION_IMPORTS] if not imp.commented]
    assert not silent, "imports inside functions without a comment saying what they defer:\n" + "\n".join(silent)


def test_a_planted_cycle_is_found_and_named(tmp_path):
    """The check fails when a cycle is added: a copy of lossagg with one import planted."""
    import shutil

    copy = tmp_path / "lossagg"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    validate = copy / "validate.py"
    validate.write_text(validate.read_text() + "\nfrom lossagg.step import StepPlan  # planted\n")
    files = module_files(str(copy))
    graph = module_graph(read_imports(files)[0])
    cycles = find_cycles(graph)
    assert cycles
    text = "\n".join(describe_cycle(c, graph) for c in cycles)
    assert "lossagg.validate -> lossagg.step" in text or "lossagg.step -> lossagg.validate" in text, text


# --------------------------------------------------------------- fresh interpreters
CHILD = textwrap.dedent(
    """
    import importlib
    import sys

    sys.argv = ["lossagg", "--help"]  # lossagg.__main__ runs the command: let it print its help
    for name in sys.stdin.read().split():
        try:
            importlib.import_module(name)
        except SystemExit as exc:  # lossagg.__main__
            if name != "lossagg.__main__" or exc.code not in (0, None):
                raise
        print("imported", name, flush=True)
    """
)
#: The same, once per order, each in a child forked from an interpreter that has imported torch and
#: nothing of lossagg: each order's lossagg imports start from nothing, and the ~2 s import of torch,
#: which every module but the configuration's makes first, is paid once instead of once per module.
#: Each order is a line of stdin; each child's lines are prefixed with the order's index, then
#: ``exit INDEX STATUS``. Where fork is missing, one interpreter per order (``CHILD``).
ZYGOTE = textwrap.dedent(
    """
    import importlib
    import os
    import sys
    import traceback

    import torch  # noqa: F401

    sys.argv = ["lossagg", "--help"]
    orders = [line.split() for line in sys.stdin.read().splitlines() if line.strip()]
    for index, names in enumerate(orders):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                for name in names:
                    try:
                        importlib.import_module(name)
                    except SystemExit as exc:  # lossagg.__main__
                        if name != "lossagg.__main__" or exc.code not in (0, None):
                            raise
                    print(index, "imported", name, flush=True)
            except BaseException:
                print(index, "failed", flush=True)
                sys.stderr.write(f"@@{index}\\n" + traceback.format_exc())
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        print("exit", index, os.waitstatus_to_exitcode(status), flush=True)
    """
)


def _importable_modules() -> tuple[list[str], list[str]]:
    usable, skipped = [], []
    for name in sorted(FILES):
        peer = OPTIONAL_PEERS.get(name)
        (skipped if peer is not None and importlib.util.find_spec(peer) is None else usable).append(name)
    return usable, skipped


def _import_in_fresh_interpreter(names: list[str]) -> tuple[list[str], subprocess.CompletedProcess]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", CHILD], input=" ".join(names), capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    return names, done


def _import_orders(orders: list[list[str]]) -> list[tuple[list[str], subprocess.CompletedProcess]]:
    """Each order of imports from nothing of lossagg (:data:`ZYGOTE`); as ``_import_in_fresh_interpreter`` gives them."""
    if not hasattr(os, "fork"):
        with ThreadPoolExecutor(max_workers=2) as pool:
            return list(pool.map(_import_in_fresh_interpreter, orders))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    text = "\n".join(" ".join(names) for names in orders)
    done = subprocess.run([sys.executable, "-c", ZYGOTE], input=text, capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200)
    errors = {}
    for chunk in done.stderr.split("@@")[1:]:
        index, _, rest = chunk.partition("\n")
        errors[int(index)] = rest
    lines = done.stdout.splitlines()
    out = []
    for i, names in enumerate(orders):
        imported = [f"imported {ln.split()[2]}" for ln in lines if ln.startswith(f"{i} imported ")]
        code = next((int(ln.split()[2]) for ln in lines if ln.startswith(f"exit {i} ")), done.returncode or 1)
        stderr = errors.get(i, "" if code == 0 else done.stderr[-3000:])
        out.append((names, subprocess.CompletedProcess(done.args, code, "\n".join(imported), stderr)))
    return out


def _failures(runs) -> list[str]:
    out = []
    for names, done in runs:
        imported = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("imported ")]
        if done.returncode != 0 or imported != names:
            failed = names[len(imported)] if len(imported) < len(names) else "?"
            out.append(f"importing {failed} (order: {', '.join(names)}):\n{done.stderr[-3000:]}")
    return out


def test_every_module_imports_first_in_a_fresh_interpreter():
    usable, skipped = _importable_modules()
    runs = _import_orders([[name] for name in usable])
    failures = _failures(runs)
    assert not failures, "\n\n".join(failures)
    if skipped:
        pytest.skip(f"imported {len(usable)} modules; skipped (optional peer absent): {', '.join(skipped)}")


def test_every_module_imports_in_shuffled_orders():
    usable, _ = _importable_modules()
    orders = []
    for seed in range(SHUFFLED_ORDERS):
        order = list(usable)
        random.Random(seed).shuffle(order)
        orders.append(order)
    runs = _import_orders(orders)
    failures = _failures(runs)
    assert not failures, "\n\n".join(failures)


def test_the_configs_check_of_new_modes_is_in_place_whatever_is_imported_first():
    """The registry sits below the configuration, which adds its check of a new mode's
    example_settings to it (lossagg.modes.add_registration_check); lossagg/__init__.py imports
    the configuration, so the check runs even when the registry is the first thing imported."""
    child = textwrap.dedent(
        """
        from lossagg.modes import ModeSpec, register_mode, MODES

        spec = ModeSpec(name="needs_l", summary="s", formula="f", denom_formula="d", totals=("num_samples",),
                        denoms=len, reference=len, needs_divisor=True)
        try:
            register_mode(spec)
        except ValueError as exc:
            print("refused:", exc)
        assert "needs_l" not in MODES
        """
    )
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused: ModeSpec.example_settings of mode 'needs_l' do not make a valid config" in done.stdout, done.stdout


def test_the_type_checking_names_are_the_exports():
    """``lossagg/__init__.py``'s ``if TYPE_CHECKING:`` block imports every public name of ``_EXPORTS``,
    each from the module ``_EXPORTS`` names, and nothing else: what an IDE sees is what
    ``lossagg.<name>`` gives."""
    import lossagg

    tree = ast.parse(open(os.path.join(PACKAGE, "__init__.py"), encoding="utf-8").read())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    seen = {alias.asname or alias.name: node.module for node in ast.walk(block) if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert seen == dict(lossagg._EXPORTS)


def test_no_public_name_is_also_a_module_of_the_package():
    """``lossagg.<name>`` is the export whatever was imported before: a submodule of the same name
    would replace the lazily exported function on the package once something imports it (``from
    lossagg.aggregate import ...`` made ``lossagg.aggregate(...)`` a call of a module)."""
    import lossagg

    clashes = [name for name in lossagg._EXPORTS if f"lossagg.{name}" in FILES]
    assert not clashes, f"exports named like a module of lossagg: {clashes}"
