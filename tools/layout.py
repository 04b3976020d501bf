"""Write docs/layout.md from the tree: every package folder with its caption, every
module with the first sentence of its docstring, in the layer order that
tests/unit/test_layout.py enforces.

    python tools/layout.py            # rewrite docs/layout.md
    python tools/layout.py --check    # exit 1 if docs/layout.md is not what the tree says

Reads files as text (``ast``); imports nothing of the project.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "packages/core/src"
ADAPTERS = sorted(ROOT.glob("packages/*_adapter/src/*/__init__.py"))
OUT = ROOT / "docs/layout.md"
KINDS = {".c": "C source, compiled on first use", ".html": "page the app serves"}

HEAD = """\
# Layout

Where the code lives. Back to the [README](../README.md). Generated from the tree
by `python tools/layout.py` (each folder's caption is its `__init__.py` docstring,
each module's line the first sentence of its own); `./dev docs` rewrites it and a
unit test fails when it is stale.

## Layers

Bottom first. A module may import its own layer and the ones below it, never one
above (`tests/unit/test_layout.py` reads every import and fails on one that runs
up, or on an import circle). A package's face, its `__init__.py`, stands above
what it hands on.

"""

TAIL = """\
## Around the package

- `packages/*_adapter/`: the engine adapters, each with a README (their folders are
  listed above); they import core, core never imports them.
- `tests/`: `unit/`, `integration/`, `faults/`, `chaos/`, `gpu/`, `engines/NAME/`
  and the contract suite. Test tiers are pytest markers: `unit`, `integration`,
  `faults`, `engines`; `./dev test -m unit` runs the fast tier alone, `./dev engines
  sglang` one adapter.
- `bench/`: the benches, each a command (`python bench/NAME.py --help`) that writes
  JSON under `docs/results/`, from which `bench/report.py` writes
  [benchmarks.md](benchmarks.md); the two largest keep their parts beside them
  (`sim_model`, `sim_search`, `sim_report` for `sim.py`; `orch_load`,
  `orch_measure`, `orch_report` for `orchestrator.py`), and `_common.py` serves all.
- `tools/`: this generator.
"""


def layers() -> list[str]:
    """LAYERS as written in tests/unit/test_layout.py (read, not imported)."""
    tree = ast.parse((ROOT / "tests/unit/test_layout.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "LAYERS" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise SystemExit("tests/unit/test_layout.py defines no LAYERS")


def caption(path: Path) -> str:
    """The first paragraph of ``path``'s module docstring, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def first_sentence(path: Path) -> str:
    """The caption's first sentence, without its full stop."""
    para = caption(path)
    cut = para.find(". ")
    return (para if cut < 0 else para[:cut]).rstrip(".")


def render() -> str:
    order = layers()
    folders = {p.parent for p in CORE.rglob("__init__.py")} | {p.parent for p in ADAPTERS}

    def name(d: Path) -> str:
        return ".".join(d.relative_to(CORE if d.is_relative_to(CORE) else d.parents[1]).parts)

    def layer(n: str) -> int:
        hits = [i for i, p in enumerate(order) if n == p or n.startswith(p + ".")]
        return max(hits, key=lambda i: len(order[i])) if hits else len(order)

    def lowest(d: Path) -> int:
        """The lowest layer of anything in ``d``: where it stands among its siblings."""
        n = name(d)
        inside = [layer(p) for p in order if p == n or p.startswith(n + ".")]
        return min(inside, default=layer(n))

    def key(d: Path) -> tuple[int, ...]:
        """A folder, then its subfolders; siblings bottom layer first. The core's root
        comes first (where a reader starts), the adapters after it all."""
        chain = [a for a in reversed(d.parents) if a in folders] + [d]
        return tuple(-1 if name(a) == "mooncake_diffusion" else lowest(a) for a in chain)

    def described(n: str) -> str:
        """A layer's one line: its folder's caption, or its module's first sentence."""
        path = CORE / n.replace(".", "/")
        for f in (path / "__init__.py", path.with_suffix(".py")):
            if f.is_file():
                return first_sentence(f)
        return next((first_sentence(a) for a in ADAPTERS if a.parent.name == n), "")

    out = [HEAD]
    out += [f"{i + 1}. `{p}`: {described(p)}\n" for i, p in enumerate(order)]
    out.append("\n## Package folders\n")
    for d in sorted(folders, key=lambda d: (key(d), str(d))):
        rel = (d.relative_to(CORE) if d.is_relative_to(CORE) else d.relative_to(ROOT)).as_posix()
        out.append(f"\n### `{rel}/`\n\n{caption(d / '__init__.py')}\n\n")
        mods = sorted(p for p in d.iterdir() if p.suffix == ".py" and p.name != "__init__.py")
        subs = sorted(p for p in d.iterdir() if (p / "__init__.py").is_file())
        others = sorted(
            p
            for p in d.iterdir()
            if p.is_file() and p.suffix not in (".py", ".pyc") and not p.name.startswith(".")
        )
        if mods or subs or others:
            out.append("| file | what it is |\n|---|---|\n")
        out += [f"| `{m.name}` | {first_sentence(m).replace('|', '/')} |\n" for m in mods]
        out += [f"| `{s.name}/` | {first_sentence(s / '__init__.py')} |\n" for s in subs]
        out += [f"| `{o.name}` | {KINDS.get(o.suffix, 'data')} |\n" for o in others]
    out.append("\n" + TAIL)
    return "".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 if stale")
    args = ap.parse_args()
    text = render()
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python tools/layout.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
