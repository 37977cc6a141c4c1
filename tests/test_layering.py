"""The package's layering, checked: a module imports only from its own layer or lower ones (imports inside
functions count), and the planner stays torch-free. A new module must be placed in LAYERS."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

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


def _imports(module: str, path: str) -> list[tuple[str, int]]:
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
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


def test_every_module_has_a_layer():
    unplaced = sorted({_top(m) for m in _modules()} - set(LAYER) - {None})
    assert not unplaced, f"place these in tests/test_layering.py LAYERS: {unplaced}"


def test_no_module_imports_a_higher_layer():
    bad = violations(_modules())
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_the_check_sees_a_forbidden_import(tmp_path):
    fake = tmp_path / "megatron_bmw" / "models"
    fake.mkdir(parents=True)
    (fake / "leak.py").write_text("def f():\n    from ..training.loop import Trainer\n")
    bad = violations({"megatron_bmw.models.leak": str(fake / "leak.py")})
    assert len(bad) == 1 and "imports megatron_bmw.training.loop" in bad[0]


@pytest.mark.slow
def test_the_planner_does_not_load_torch():
    planner = sorted(m for m in _modules() if _top(m) == "planner")
    code = ("import importlib, sys\n"
            f"for m in {planner!r}:\n    importlib.import_module(m)\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "print(' '.join(loaded[:3]))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing the planner loads {out.stdout.strip()}"
