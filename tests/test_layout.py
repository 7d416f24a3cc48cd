"""The package layout follows the flow: specs -> planning -> models -> profiling -> runtime -> commands.

Imports run down that list only, planning never loads torch, modules stay readable in size, and
every declared dependency is used by the project's own code.
"""

from __future__ import annotations

import ast
import configparser
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "memx_launch"
# Lower layers first; a module may import from its own layer and the ones before it.
LAYERS = ["base", "specs", "planning", "models", "profiling", "runtime", "commands"]
BASE_MODULES = {"errors", "files", "lazy"}
COMMAND_MODULES = {"cli", "__init__"}
MAX_LINES = 450


def _layer(module: str) -> str:
    parts = module.split(".")[1:]  # drop "memx_launch"
    if not parts or parts[0] in COMMAND_MODULES:
        return "commands"
    if parts[0] in BASE_MODULES:
        return "base"
    return parts[0]


def _imports(path: pathlib.Path) -> list[str]:
    """memx_launch modules imported anywhere in the file (function-level imports included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("memx_launch"):
            out += [node.module] if node.module != "memx_launch" else [f"memx_launch.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("memx_launch")]
    return out


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        yield ".".join(rel.parts).removesuffix(".__init__"), path


# Entry modules of commands: run by a launcher or console script, imported by nothing.
ENTRY_MODULES = {"memx_launch.runtime.launcher"}


def _package(module: str) -> str:
    return module.rsplit(".", 1)[0]


def _module_imports() -> dict[str, set[str]]:
    """Each module's imports of other memx_launch modules (a package import stands for its __init__)."""
    modules = dict(_modules())
    return {m: {i for i in _imports(path) if i in modules and i != m} for m, path in modules.items()}


def test_no_import_circle_inside_a_package():
    graph = _module_imports()
    inside = {m: {i for i in deps if _package(i) == _package(m) and i != _package(m)} for m, deps in graph.items()}
    done, on_path = set(), []

    def visit(m):
        if m in on_path:
            return on_path[on_path.index(m):] + [m]
        if m in done:
            return None
        on_path.append(m)
        for dep in sorted(inside[m]):
            circle = visit(dep)
            if circle:
                return circle
        on_path.pop()
        done.add(m)
        return None

    for module in sorted(inside):
        circle = visit(module)
        assert circle is None, f"import circle: {' -> '.join(circle)}"


def test_entry_modules_are_imported_by_nothing():
    importers = {m for m, deps in _module_imports().items() if deps & ENTRY_MODULES}
    assert not importers, f"{sorted(importers)} import an entry module"


def test_every_module_belongs_to_a_known_layer():
    assert {_layer(m) for m, _ in _modules()} <= set(LAYERS)


@pytest.mark.parametrize("module,path", list(_modules()), ids=lambda x: str(x) if isinstance(x, str) else "")
def test_imports_run_down_the_flow(module, path):
    own = LAYERS.index(_layer(module))
    upward = [imp for imp in _imports(path) if LAYERS.index(_layer(imp)) > own]
    assert not upward, f"{module} ({_layer(module)}) imports from later layers: {upward}"


def test_planning_and_specs_never_load_torch():
    code = ("import sys, memx_launch.planning, memx_launch.planning.replan, memx_launch.planning.exporters, "
            "memx_launch.planning.baselines, memx_launch.specs, memx_launch.cli; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_no_module_is_too_long_and_package_inits_hold_no_logic():
    for module, path in _modules():
        lines = path.read_text().count("\n")
        assert lines <= MAX_LINES, f"{module}: {lines} lines"
        if path.name == "__init__.py" and module != "memx_launch":
            tree = ast.parse(path.read_text())
            logic = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.If, ast.For))]
            assert not logic, f"{module}/__init__.py defines {[getattr(n, 'name', type(n).__name__) for n in logic]}"


@pytest.mark.parametrize("package", ["memx_launch", "memx_launch.runtime", "memx_launch.profiling"])
def test_public_surface_resolves(package):
    import importlib

    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    with pytest.raises(AttributeError, match="not_a_name"):
        module.not_a_name  # noqa: B018


# Distribution name -> the module it ships, where they differ.
_MODULE_OF = {"pyyaml": "yaml", "nvidia-ml-py": "pynvml", "xgboost-cpu": "xgboost", "megatron-core": "megatron"}


def _requirements() -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = [line.split("#")[0].strip() for line in cfg["options"]["install_requires"].splitlines()]
    return sorted({re.split(r"[<>=!;~ ]", line)[0].lower() for line in lines if line})


def test_every_declared_dependency_is_imported_by_the_project():
    sources = [p for d in ("memx_launch", "callbacks") for p in (ROOT / d).rglob("*.py")]
    imported = set()
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
    unused = [r for r in _requirements() if _MODULE_OF.get(r, r.replace("-", "_")) not in imported]
    assert not unused, f"declared in setup.cfg but never imported: {unused}"
