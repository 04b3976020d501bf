"""Import only the LightX2V runner a role process needs (test role processes only).

At f8aee98b ``import lightx2v`` imports ``lightx2v.pipeline``, and the server
worker imports ``lightx2v.infer``; between them they import every runner module
(``lightx2v.models.runners.<family>.<name>_runner``, ~40 of them, each with its
networks, encoders and their third-party libraries). A role process runs one
runner. ``install(keep)`` puts a finder in front of ``sys.meta_path`` that
answers every *other* runner module with an empty placeholder module; the
modules in ``keep`` (and everything they import) load from the real source as
usual.

What a placeholder is: a module whose every attribute is a class that refuses
to be instantiated (``PlaceholderRunnerError`` naming it). ``from ... import
XRunner`` in ``lightx2v/infer.py`` and ``lightx2v/pipeline.py`` therefore
succeeds, and their ``@RUNNER_REGISTER`` decorators never run, so
``RUNNER_REGISTER`` holds only the kept runners: asking ``init_runner`` for
another ``model_cls`` fails with LightX2V's own ``KeyError``.

Obligation of the caller: call ``install`` before the first ``import lightx2v``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import re
import sys
from collections.abc import Iterable
from types import ModuleType
from typing import Any

__all__ = ["RUNNER_MODULES", "LeanRunnerFinder", "PlaceholderRunnerError", "install"]

#: the runner module a role needs, by its ``--model_cls``
RUNNER_MODULES = {
    "wan2.1": "lightx2v.models.runners.wan.wan_runner",
    "qwen_image": "lightx2v.models.runners.qwen_image.qwen_image_runner",
}

_RUNNER = re.compile(r"^lightx2v\.models\.runners\.[A-Za-z0-9_]+\.[A-Za-z0-9_]+_runner$")


class PlaceholderRunnerError(RuntimeError):
    """A runner class this role process did not import was used."""


class _Placeholder(ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        module = self.__name__

        def refuse(cls: type, *args: Any, **kwargs: Any) -> Any:
            raise PlaceholderRunnerError(f"{module}.{name} was not imported in this role process")

        return type(name, (), {"__new__": refuse, "__module__": module})


class LeanRunnerFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers runner modules outside ``keep`` with placeholders; defers the rest."""

    def __init__(self, keep: Iterable[str]) -> None:
        self.keep = frozenset(keep)
        self.placed: list[str] = []

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not _RUNNER.match(fullname) or fullname in self.keep:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        self.placed.append(spec.name)
        return _Placeholder(spec.name)

    def exec_module(self, module: ModuleType) -> None:
        pass


def install(keep: Iterable[str]) -> LeanRunnerFinder:
    """Put the finder first on ``sys.meta_path``; refuses once LightX2V is imported."""
    if "lightx2v" in sys.modules:
        raise RuntimeError("lean_import.install must run before the first `import lightx2v`")
    finder = LeanRunnerFinder(keep)
    sys.meta_path.insert(0, finder)
    return finder
