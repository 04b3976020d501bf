"""Verify the adapter against the LightX2V installed here:
``python -m mooncake_diffusion_lightx2v.check``.

Checks, in order: ``import lightx2v`` works (with ``SKIP_PLATFORM_CHECK=1`` set
when unset, so it runs on a machine without a GPU); this package's entry point
is in ``lightx2v.platform_plugins``; ``DisaggMixin`` has the six methods with
the parameters the adapter expects, and all six are routed by the plugin;
the Wan and Qwen runners inherit them; for queue mode, that the runners have
``set_config`` and ``run_pipeline(input_info)`` and that
``lightx2v.utils.input_info`` has ``init_empty_input_info(task, ...)`` and
``update_input_info_from_dict(input_info, data)`` (how LightX2V's server builds
a request's input info); LightX2V's version and source folder, and which commit
that source is at (``f8aee98b`` is the one the adapter targets): a git checkout
of its own says it; an unpacked archive says it by its name
(``lightx2v-<commit>.tar.gz``, unpacked into ``lightx2v-<commit>/``; ``./dev``
leaves the archive's name and verified sha256 in ``ARCHIVE_STAMP`` there).
Prints one line per check and exits 1 if any failed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

from mooncake_diffusion_lightx2v import TARGET_COMMIT
from mooncake_diffusion_lightx2v.plugin import MIXIN_MODULE, PATCHED, patched

__all__ = [
    "ARCHIVE_STAMP",
    "EXPECTED_PARAMS",
    "archive_commit",
    "main",
    "run_checks",
    "source_commit",
]

#: The file ``./dev`` writes in an unpacked source archive's top folder: one line,
#: ``<archive name> <its sha256>`` (checked against ``engine/source.txt`` before
#: unpacking).
ARCHIVE_STAMP = ".mcd-archive"
#: An archive's top folder (and, less ``.tar.gz``, its name): ``lightx2v-<commit>``.
_ARCHIVE_TOP = re.compile(r"lightx2v-([0-9a-f]{7,40})")

#: The parameters of each routed method at f8aee98b (``self`` first).
EXPECTED_PARAMS = {
    "init_disagg": ["self", "config"],
    "send_encoder_outputs": ["self", "inputs", "latent_shape"],
    "receive_encoder_outputs": ["self"],
    "send_transformer_outputs": ["self", "latents"],
    "receive_transformer_outputs": ["self"],
    "release_disagg": ["self"],
}
_RUNNERS = (
    ("lightx2v.models.runners.wan.wan_runner", "WanRunner"),
    ("lightx2v.models.runners.qwen_image.qwen_image_runner", "QwenImageRunner"),
)


def _git(where: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def source_commit(package_dir: Path) -> str | None:
    """The git commit of the LightX2V source that holds ``package_dir`` (its
    ``lightx2v`` package): only when the source's root, the folder above it, is
    the top of a git checkout. An unpacked archive has none of its own, and the
    repository around it (a project that unpacked it in an ignored folder) is not
    LightX2V's: its commit is never reported as the source's."""
    root = package_dir.resolve().parent
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root:
        return None
    return _git(root, "rev-parse", "HEAD")


def archive_commit(package_dir: Path) -> tuple[str, str] | None:
    """``(commit, where it was read)`` for a LightX2V source unpacked from an archive
    (``package_dir``'s parent named ``lightx2v-<commit>``, as the archive's top
    folder is): ``where`` names the archive and its sha256 when ``./dev`` left its
    ``ARCHIVE_STAMP`` there, else the folder. ``None`` for any other folder. The
    commit is as long as the name has it (``f8aee98b``)."""
    root = package_dir.resolve().parent
    m = _ARCHIVE_TOP.fullmatch(root.name)
    if m is None:
        return None
    try:
        name, sha256 = (root / ARCHIVE_STAMP).read_text().split()[:2]
    except (OSError, ValueError):
        return m.group(1), f"the folder {root.name}/ (an unpacked archive)"
    named = _ARCHIVE_TOP.fullmatch(name.removesuffix(".tar.gz"))
    if named is None:  # a stamp for an archive of another name: the folder says it
        return m.group(1), f"the folder {root.name}/ (an unpacked archive)"
    return named.group(1), f"the archive {name} (sha256 {sha256[:16]}...)"


def _commit_line(package_dir: Path) -> str:
    """The check's line for the source's commit (never fails: unknown says why)."""
    commit = source_commit(package_dir)
    if commit is not None:
        where = "its git checkout"
    else:
        found = archive_commit(package_dir)
        if found is None:
            return "source commit: unknown (neither a git checkout nor an unpacked archive)"
        commit, where = found
    same = commit.startswith(TARGET_COMMIT[:8]) or TARGET_COMMIT.startswith(commit)
    note = "the targeted commit" if same else f"differs from {TARGET_COMMIT[:8]}"
    return f"source commit: {commit[:12]} ({note}), from {where}"


def _version() -> str:
    try:
        return importlib.metadata.version("lightx2v")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (no installed distribution)"


#: What queue mode calls to build a request's input info (as LightX2V's server
#: worker does), with the leading parameters it passes.
INPUT_INFO_CALLS = {
    "init_empty_input_info": ["task"],
    "update_input_info_from_dict": ["input_info", "data"],
}


def _input_info_checks() -> list[tuple[bool, str]]:
    where = "lightx2v.utils.input_info"
    try:
        module = importlib.import_module(where)
    except Exception as e:
        return [(False, f"{where}: {type(e).__name__}: {e}")]
    results = []
    for name, want in INPUT_INFO_CALLS.items():
        fn = getattr(module, name, None)
        if not callable(fn):
            results.append((False, f"{where}.{name}: missing (queue mode needs it)"))
            continue
        got = list(inspect.signature(fn).parameters)
        ok = got[: len(want)] == want
        results.append((ok, f"{where}.{name}{tuple(got)} (expected {tuple(want)} first)"))
    return results


def run_checks() -> list[tuple[bool, str]]:
    """Run every check; returns ``(passed, line)`` pairs (never raises)."""
    results: list[tuple[bool, str]] = []
    os.environ.setdefault("SKIP_PLATFORM_CHECK", "1")
    try:
        lightx2v = importlib.import_module("lightx2v")
    except Exception as e:
        return [(False, f"import lightx2v failed: {type(e).__name__}: {e}")]
    results.append((True, f"import lightx2v: {lightx2v.__file__}"))
    eps = importlib.metadata.entry_points(group="lightx2v.platform_plugins")
    ours = [ep for ep in eps if ep.value == "mooncake_diffusion_lightx2v.plugin:register"]
    results.append((bool(ours), f"entry point lightx2v.platform_plugins: {[e.name for e in ours]}"))
    try:
        mixin = importlib.import_module(MIXIN_MODULE).DisaggMixin
    except Exception as e:
        results.append((False, f"{MIXIN_MODULE}.DisaggMixin: {type(e).__name__}: {e}"))
        return results
    for name, want in EXPECTED_PARAMS.items():
        method = getattr(mixin, name, None)
        if method is None:
            results.append((False, f"DisaggMixin.{name}: missing"))
            continue
        original = getattr(method, "__mooncake_diffusion_original__", method)
        got = list(inspect.signature(original).parameters)
        results.append((got == want, f"DisaggMixin.{name}{tuple(got)} (expected {tuple(want)})"))
    routed = patched(mixin)
    results.append((routed == list(PATCHED), f"routed by the plugin: {len(routed)} of 6"))
    for module, cls in _RUNNERS:
        try:
            runner = getattr(importlib.import_module(module), cls)
        except ModuleNotFoundError as e:
            if e.name and module.startswith(e.name):  # the runner module itself is absent
                results.append((True, f"{cls}: not in this LightX2V ({module})"))
            else:  # it exists but needs something not installed (zmq, say)
                results.append((False, f"{cls}: {e}"))
            continue
        except Exception as e:
            results.append((False, f"{cls}: {type(e).__name__}: {e}"))
            continue
        results.append((issubclass(runner, mixin), f"{cls} inherits DisaggMixin"))
        queue_surface = [
            n for n in ("set_config", "run_pipeline") if callable(getattr(runner, n, None))
        ]
        results.append(
            (
                queue_surface == ["set_config", "run_pipeline"],
                f"{cls} has {queue_surface} (queue mode)",
            )
        )
    results.extend(_input_info_checks())
    package_dir = Path(lightx2v.__file__).resolve().parent
    results.append((True, f"lightx2v version {_version()}, source {package_dir.parent}"))
    results.append((True, _commit_line(package_dir)))
    return results


def main() -> int:
    results = run_checks()
    for ok, line in results:
        print(("ok    " if ok else "FAIL  ") + line)
    failed = sum(not ok for ok, _ in results)
    print("all checks passed" if not failed else f"{failed} check(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
