"""The package's layering, checked: a module imports only from its own layer or lower ones (imports inside
functions count), no modules import each other in a cycle, and the planner stays torch-free. A new module must be
placed in LAYERS."""

from __future__ import annotations

import ast
import os
import sys
from collections import deque

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megatron_bmw")

# Lowest first. Keys are top-level modules or subpackages of megatron_bmw.
LAYERS = [
    ("errors", "paths"),
    ("units", "strategy", "config"),          # numbers only
    ("device", "fused", "safe_load"),           # torch leaves
    ("parallel", "data"),
    ("models",),
    ("pipeline",),
    ("planner",),                               # torch-free
    ("flag_rules",),                            # values argparse lets through
    ("arguments", "planner_args", "plan_overlay", "run_parts"),  # flags (and a plan) -> configs
    ("training", "convert"),
    ("trials",),
    ("cli",),
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _top(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "megatron_bmw" else None


def _package(module: str, path: str) -> str:
    return module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]


def _from(node: ast.ImportFrom, package: str) -> str:
    """The module `from X import ...` names, a relative X resolved against `package`."""
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))
    return node.module or ""


def _imports(module: str, path: str) -> list[tuple[str, int]]:
    tree = ast.parse(open(path).read(), path)
    package = _package(module, path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            name = _from(node, package)
            if name == "megatron_bmw":  # `from megatron_bmw import x`
                out += [(f"megatron_bmw.{a.name}", node.lineno) for a in node.names]
            else:
                out.append((name, node.lineno))
    return [(n, line) for n, line in out if n.startswith("megatron_bmw.")]


def violations(modules: dict[str, str]) -> list[str]:
    bad = []
    for module, path in sorted(modules.items()):
        mine = _top(module)
        if mine is None:
            continue
        for target, line in _imports(module, path):
            theirs = _top(target)
            if theirs is None or theirs == mine:
                continue
            if LAYER[theirs] > LAYER[mine]:
                bad.append(f"{os.path.relpath(path, ROOT)}:{line}: {module} (layer {LAYER[mine]}, {mine}) imports "
                           f"{target} (layer {LAYER[theirs]}, {theirs})")
    return bad


def _at_import(tree: ast.Module) -> list[ast.stmt]:
    """The import statements run when the module is imported: not those in a function, nor under TYPE_CHECKING."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo += [c for c in ast.iter_child_nodes(node) if isinstance(c, (ast.stmt, ast.excepthandler))]
    return out


def _dependencies(module: str, path: str, modules, at_import: bool = False) -> set[str]:
    """What `module` imports, everywhere in it (functions too) or only when it is imported: modules of the package
    (`from a import b` names a, and a.b where that is a module) and, with at_import, other top-level packages."""
    tree = ast.parse(open(path).read(), path)
    everywhere = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    nodes = _at_import(tree) if at_import else everywhere
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        else:
            base = _from(node, _package(module, path))
            names |= {base} | {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
    out = {n for n in names if n in modules}
    if at_import:
        out |= {n.split(".")[0] for n in names if n.split(".")[0] != "megatron_bmw"}
    return out - {module}


def import_cycles(modules: dict[str, str]) -> list[str]:
    """One chain `a -> b -> a` for each set of modules that import each other (imports inside functions count)."""
    graph = {m: sorted(_dependencies(m, path, modules)) for m, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):  # Tarjan's strongly connected components, without recursion
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(graph[root]))]
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while node not in component:
                        component.add(stack.pop())
                    on_stack -= component
                    components.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(graph[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(" -> ".join(_shortest_cycle(min(c), c, graph)) for c in components if len(c) > 1)


def _shortest_cycle(start: str, component: set[str], graph: dict[str, list[str]]) -> list[str]:
    """start, the modules of a shortest import chain from it back to it inside `component`, start again."""
    came_from = {start: None}
    todo = deque([start])
    while todo:
        node = todo.popleft()
        for child in graph[node]:
            if child == start:
                chain = [node]
                while came_from[chain[-1]] is not None:
                    chain.append(came_from[chain[-1]])
                return chain[::-1] + [start]
            if child in component and child not in came_from:
                came_from[child] = node
                todo.append(child)
    raise AssertionError(f"{start} is in no cycle of {sorted(component)}")


def test_every_module_has_a_layer():
    unplaced = sorted({_top(m) for m in _modules()} - set(LAYER) - {None})
    assert not unplaced, f"place these in tests/test_layering.py LAYERS: {unplaced}"


def test_no_module_imports_a_higher_layer():
    bad = violations(_modules())
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def _fake_package(tmp_path, files: dict[str, str]) -> dict[str, str]:
    """Write megatron_bmw/<name>.py for each name (a path like planner/a) under tmp_path: the modules, as _modules."""
    modules = {}
    for name, text in files.items():
        path = tmp_path / "megatron_bmw" / f"{name}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        dotted = f"megatron_bmw.{name.replace('/', '.')}".removesuffix(".__init__")
        modules[dotted] = str(path)
    return modules


def test_the_check_sees_a_forbidden_import(tmp_path):
    fake = tmp_path / "megatron_bmw" / "models"
    fake.mkdir(parents=True)
    (fake / "leak.py").write_text("def f():\n    from ..training.loop import Trainer\n")
    bad = violations({"megatron_bmw.models.leak": str(fake / "leak.py")})
    assert len(bad) == 1 and "imports megatron_bmw.training.loop" in bad[0]


def test_no_modules_import_each_other():
    cycles = import_cycles(_modules())
    assert not cycles, ("modules importing each other (imports inside functions count): move the piece they share "
                        "down, or pass it in\n" + "\n".join(cycles))


def test_the_check_sees_an_import_cycle(tmp_path):
    modules = _fake_package(tmp_path, {"models/__init__": "", "models/a": "from .b import f\n",
                                       "models/b": "def f():\n    from . import c\n",
                                       "models/c": "from megatron_bmw.models.a import f\n",
                                       "models/d": "from . import a\n"})
    assert import_cycles(modules) == ["megatron_bmw.models.a -> megatron_bmw.models.b -> megatron_bmw.models.c -> "
                                      "megatron_bmw.models.a"]


def loaded_on_import(modules: dict[str, str], roots: list[str]) -> dict[str, list[str]]:
    """Each top-level package outside megatron_bmw that importing `roots` loads, with a chain of imports to it:
    the imports run on import, followed through the package's modules and the packages holding them."""
    came_from: dict[str, str | None] = {r: None for r in roots}
    todo = deque(roots)
    loaded = {}
    while todo:
        module = todo.popleft()
        parents = [module.rsplit(".", k)[0] for k in range(module.count("."), 0, -1)]
        for dep in sorted(_dependencies(module, modules[module], modules, at_import=True)) + parents:
            if dep in came_from:
                continue
            came_from[dep] = module
            if dep in modules:
                todo.append(dep)
            else:
                chain = [dep]
                while came_from[chain[-1]] is not None:
                    chain.append(came_from[chain[-1]])
                loaded[dep] = chain[::-1]
    return loaded


# What the planner may load besides the standard library: packages that do not load torch.
PLANNER_PACKAGES = {"numpy", "yaml"}


def _beyond(loaded: dict[str, list[str]]) -> list[str]:
    return [" -> ".join(chain) for p, chain in sorted(loaded.items())
            if p not in sys.stdlib_module_names and p not in PLANNER_PACKAGES]


def test_the_planner_does_not_load_torch():
    """Read from the imports each module runs on import (a fresh interpreter to import them in costs seconds)."""
    modules = _modules()
    beyond = _beyond(loaded_on_import(modules, sorted(m for m in modules if _top(m) == "planner")))
    assert not beyond, ("importing the planner loads more than the standard library and PLANNER_PACKAGES (torch "
                        "must not be among them):\n" + "\n".join(beyond))


def test_the_torch_check_sees_an_import_time_load(tmp_path):
    modules = _fake_package(tmp_path, {"__init__": "", "planner/__init__": "",
                                       "planner/a": "import json\nfrom ..units import n\n",
                                       "units": "try:\n    import torch.nn\nexcept ImportError:\n    pass\n",
                                       "planner/b": "def f():\n    import torch\n"})
    assert _beyond(loaded_on_import(modules, ["megatron_bmw.planner.a", "megatron_bmw.planner.b"])) == [
        "megatron_bmw.planner.a -> megatron_bmw.units -> torch"]
