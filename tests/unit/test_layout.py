"""The tree's shape: no import cycles between our modules, no pytest plugin forced
on environments that install the library, and module names that match commands."""

from __future__ import annotations

import ast
import importlib.metadata
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
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _is_package_init(module: str, other: str) -> bool:
    # importing a submodule always runs its package's __init__; that edge is not a cycle
    return module.startswith(other + ".")


def test_no_module_imports_a_module_that_imports_it_back():
    mods = _modules()
    graph = {m: _imports(m, p, set(mods)) for m, p in mods.items()}
    pairs = sorted(
        (a, b)
        for a, deps in graph.items()
        for b in deps
        if a < b
        and a in graph.get(b, set())
        and not _is_package_init(a, b)
        and not _is_package_init(b, a)
    )
    assert pairs == []


def test_installing_the_library_adds_no_pytest_plugin():
    for dist in ("mooncake-diffusion", "mooncake-diffusion-lightx2v"):
        eps = importlib.metadata.distribution(dist).entry_points
        assert [ep for ep in eps if ep.group == "pytest11"] == [], dist


def test_modules_are_named_after_their_commands():
    from mooncake_diffusion import cli

    commands = set(cli.build_parser()._subparsers._group_actions[0].choices)
    mods = _modules()
    for command in ("demo", "handoff"):
        assert command in commands
        assert f"mooncake_diffusion.{command}" in mods
    assert "mooncake_diffusion.system_demo" not in mods
    assert "mooncake_diffusion.orchestrator.sim" not in mods
