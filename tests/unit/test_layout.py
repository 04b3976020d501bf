"""The tree's shape: no import cycles between our modules, no import from a lower
layer to a higher one, every package folder captioned in docs/layout.md, no pytest
plugin forced on environments that install the library, and module names that
match commands."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "mooncake_diffusion": ROOT / "packages/core/src/mooncake_diffusion",
    "mooncake_diffusion_vllm_omni": ROOT
    / "packages/vllm_omni_adapter/src/mooncake_diffusion_vllm_omni",
    "mooncake_diffusion_sglang": ROOT / "packages/sglang_adapter/src/mooncake_diffusion_sglang",
    "mooncake_diffusion_lightx2v": ROOT
    / "packages/lightx2v_adapter/src/mooncake_diffusion_lightx2v",
}


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for top, path in PACKAGES.items():
        for f in path.rglob("*.py"):
            parts = [top, *f.relative_to(path).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = f
    return mods


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of ours that ``name`` imports, anywhere in its body (lazy imports
    included: a cycle through a function-level import is still a cycle)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            # `from pkg import mod` reaches mod; the package's face only for a name it defines
            subs = [f"{base}.{a.name}" for a in node.names]
            targets = [s for s in subs if s in known]
            if len(targets) < len(subs):
                targets.append(base)
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected components of more than
    one module (Tarjan's algorithm). A module's import of a package it lies in is left
    out: importing a submodule always runs its package's ``__init__`` first, so that
    edge closes no circle of its own."""
    edges = {a: {b for b in deps if not a.startswith(b + ".")} for a, deps in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_circle():
    mods = _modules()
    assert _circles({m: _imports(m, p, set(mods)) for m, p in mods.items()}) == []


def test_a_circle_of_three_is_found():
    # the check itself: a circle longer than a pair, and a submodule importing its face
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "p": {"p.x"}, "p.x": {"p"}}
    assert _circles(graph) == [["a", "b", "c"]]


# The layers, bottom first. A module belongs to the longest prefix listed here; it
# may import its own layer and the layers below it, never one above. A package's
# face (its ``__init__``) is a layer of its own, above what it hands on.
LAYERS = (
    "mooncake_diffusion.errors",
    "mooncake_diffusion.wire",
    "mooncake_diffusion.platform",
    "mooncake_diffusion.memory",
    "mooncake_diffusion._mooncake",
    "mooncake_diffusion.transfer",
    "mooncake_diffusion.handoff",
    "mooncake_diffusion.caches",
    "mooncake_diffusion.pipeline",
    "mooncake_diffusion.orchestrator.errors",
    "mooncake_diffusion.orchestrator.core",
    "mooncake_diffusion.orchestrator.elastic",
    "mooncake_diffusion.orchestrator.link",
    "mooncake_diffusion.orchestrator.worker",
    "mooncake_diffusion.orchestrator.service",
    "mooncake_diffusion.orchestrator.ha",
    "mooncake_diffusion.orchestrator.http",
    "mooncake_diffusion.orchestrator.commands",
    "mooncake_diffusion.orchestrator",
    "mooncake_diffusion.simulate",
    "mooncake_diffusion.testing",
    "mooncake_diffusion.demo",
    "mooncake_diffusion.cli",
    "mooncake_diffusion",
    # adapters only translate: core never imports one, and none imports another
    "mooncake_diffusion_vllm_omni",
    "mooncake_diffusion_sglang",
    "mooncake_diffusion_lightx2v",
)
ADAPTERS = LAYERS[-3:]


def _layer(module: str) -> int:
    """The layer of ``module``: the longest prefix of it that LAYERS names."""
    return max(
        (i for i, p in enumerate(LAYERS) if module == p or module.startswith(p + ".")),
        key=lambda i: len(LAYERS[i]),
    )


def test_every_module_has_a_layer_and_no_import_runs_up_or_across_adapters():
    mods = _modules()
    upward = []
    for name, path in sorted(mods.items()):
        here = _layer(name)
        for dep in _imports(name, path, set(mods)):
            there = _layer(dep)
            across = LAYERS[here] in ADAPTERS and LAYERS[there] in ADAPTERS and here != there
            if there > here or across:
                upward.append(f"{name} ({LAYERS[here]}) -> {dep} ({LAYERS[there]})")
    assert upward == []


def test_the_layer_list_names_only_what_exists():
    mods = set(_modules())
    assert [p for p in LAYERS if p not in mods] == []


def test_docs_layout_lists_every_package_folder_and_only_those():
    folders = {
        (
            d.parent.relative_to(ROOT / "packages/core/src")
            if top == "mooncake_diffusion"
            else d.parent.relative_to(ROOT)
        ).as_posix()
        + "/"
        for top, path in PACKAGES.items()
        for d in path.rglob("__init__.py")
    }
    text = (ROOT / "docs/layout.md").read_text()
    listed = set(re.findall(r"^### `([\w/.]+/)`$", text, re.M))
    assert sorted(folders - listed) == [], "package folders missing from docs/layout.md"
    assert sorted(listed - folders) == [], "docs/layout.md lists folders that do not exist"


def test_docs_layout_is_what_the_tree_says():
    # tools/layout.py writes it; a caption or first line changed since says so here
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools/layout.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_installing_the_library_adds_no_pytest_plugin():
    for dist in ("mooncake-diffusion", "mooncake-diffusion-lightx2v"):
        eps = importlib.metadata.distribution(dist).entry_points
        assert [ep for ep in eps if ep.group == "pytest11"] == [], dist


def test_modules_are_named_after_their_commands():
    from mooncake_diffusion import cli

    commands = set(cli.build_parser()._subparsers._group_actions[0].choices)
    mods = _modules()
    for command, module in (("demo", "demo"), ("handoff", "handoff.demo")):
        assert command in commands
        assert f"mooncake_diffusion.{module}" in mods
    assert "mooncake_diffusion.system_demo" not in mods
    assert "mooncake_diffusion.orchestrator.sim" not in mods
