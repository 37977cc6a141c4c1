"""The package's shape, checked: no module over 600 lines, no function over 80, the parsed flags passed only
inside the layer that turns flags into configs and the command lines above it, and a README a newcomer reads in
one sitting (under 450 lines). Measurements and lab notes go in docs/."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megatron_bmw")
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_README_LINES = 600, 80, 450
# Where the parsed flags may be passed: flags -> configs, and the command lines (tools' mains and their helpers)
FLAG_LAYER = {"arguments", "plan_overlay", "run_parts", "flag_rules", "planner_args", "cli.autoconfig",
              "cli.profile_commands", "cli.tune", "trials.cli", "trials.grid", "convert.hf_files"}
# Parameters named like the flags that are something else (a hook's or a dispatch's positional arguments)
NOT_FLAGS = {("training.param_gather", "pre_hook"), ("models.op_count", "__torch_dispatch__"),
             ("parallel.recompute", "_accelerator")}


def _modules():
    for dirpath, _, files in os.walk(PACKAGE):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, PACKAGE)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                yield name, path, open(path).read()


def test_no_module_over_600_lines():
    big = [f"{name}: {src.count(chr(10))}" for name, _, src in _modules() if src.count("\n") > MAX_MODULE_LINES]
    assert not big, f"modules over {MAX_MODULE_LINES} lines (split them by meaning): {big}"


def test_no_function_over_80_lines():
    long = []
    for name, _, src in _modules():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {n}")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (name their steps): {long}"


def _takes_flags(node: ast.FunctionDef) -> bool:
    for a in node.args.args + node.args.kwonlyargs:
        annotation = ast.unparse(a.annotation) if a.annotation else ""
        if "Namespace" in annotation or (a.arg in ("args", "opts") and not annotation):
            return True
    return False


def test_library_functions_take_configs_not_the_parsed_flags():
    found = [f"{name}.{node.name}" for name, _, src in _modules() if name not in FLAG_LAYER
             for node in ast.walk(ast.parse(src))
             if isinstance(node, ast.FunctionDef) and _takes_flags(node) and (name, node.name) not in NOT_FLAGS]
    assert not found, f"library functions taking the parsed flags (pass a config dataclass): {found}"


def test_the_readme_is_short():
    lines = open(os.path.join(ROOT, "README.md")).read().count("\n")
    assert lines < MAX_README_LINES, f"README.md has {lines} lines; measurements and notes belong in docs/"
