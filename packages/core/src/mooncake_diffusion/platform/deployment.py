"""Which Mooncake wheel fits this environment, and what the installed one provides.

Mooncake ships one wheel per build, all providing the ``mooncake`` module:

    extra    distribution                        links
    cpu      mooncake-transfer-engine-non-cuda   no CUDA (TCP / RDMA on host memory)
    cuda12   mooncake-transfer-engine            libcudart.so.12, libcuda.so.1
    cuda13   mooncake-transfer-engine-cuda13     libcudart.so.13, libcuda.so.1

A CUDA build only loads next to a torch of the same CUDA major, and it needs the
driver (``libcuda.so.1``) even to be imported. So what the installed build can do
is read from its shared libraries (``elf.needed``), never by importing it and
never by its distribution name:

    wheel_for(torch_cuda())     # the wheel (and extra) this environment needs
    inspect_build()             # what the installed ``mooncake`` links against
    inspect_build().device_memory   # True: it can register CUDA memory

``python -m mooncake_diffusion.platform.deployment`` prints both; ``... requirement`` prints
only the pip requirement of the matching wheel (``./dev`` uses it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from mooncake_diffusion.platform.elf import needed

__all__ = [
    "MOONCAKE_VERSION",
    "WHEELS",
    "MooncakeBuild",
    "Wheel",
    "cuda_build",
    "inspect_build",
    "torch_cuda",
    "wheel_for",
]

#: One Mooncake release for every environment: the newest the CPU wheel has
#: (0.3.13.post1); the CUDA 12 and CUDA 13 wheels exist at it too.
MOONCAKE_VERSION = "0.3.13.post1"

#: The native modules whose links tell the build apart (0.3.14 renamed
#: ``store.so`` to ``_store.cpython-*.so`` behind a ``store`` package).
_NATIVE = ("engine.so", "store.so", "_store.*.so")
_CUDART = re.compile(r"^libcudart\.so\.(\d+)$")


@dataclass(frozen=True)
class Wheel:
    """One Mooncake build on PyPI and the extra of ``mooncake-diffusion`` that pulls it."""

    extra: str
    distribution: str
    cuda_major: int | None

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={MOONCAKE_VERSION}"


WHEELS = (
    Wheel("cpu", "mooncake-transfer-engine-non-cuda", None),
    Wheel("cuda12", "mooncake-transfer-engine", 12),
    Wheel("cuda13", "mooncake-transfer-engine-cuda13", 13),
)


def wheel_for(cuda_version: str | None) -> Wheel:
    """The wheel for a torch built against ``cuda_version`` (``"13.0"``; ``None`` = CPU).

    Raises ``ValueError`` for a CUDA major no Mooncake wheel is built for.
    """
    if cuda_version is None:
        return WHEELS[0]
    major = int(str(cuda_version).split(".")[0])
    for wheel in WHEELS:
        if wheel.cuda_major == major:
            return wheel
    built = ", ".join(str(w.cuda_major) for w in WHEELS if w.cuda_major)
    raise ValueError(f"no Mooncake wheel for CUDA {cuda_version}; wheels exist for CUDA {built}")


def torch_cuda() -> str | None:
    """``torch.version.cuda`` of the installed torch; ``None`` for a CPU build or no torch."""
    try:
        import torch
    except ImportError:
        return None
    return torch.version.cuda


@dataclass(frozen=True)
class MooncakeBuild:
    """What one installed ``mooncake`` package links against (read, not imported)."""

    root: str
    #: distribution name and version from the ``*.dist-info`` beside it ("" if none)
    distribution: str
    version: str
    #: DT_NEEDED of each native module, by file name
    libraries: dict[str, list[str]]
    #: the CUDA runtime major every native module needs; None for a CPU build
    cuda_major: int | None

    @property
    def device_memory(self) -> bool:
        """Built with CUDA: its engine registers device memory and its store reads it."""
        return self.cuda_major is not None

    @property
    def needs_driver(self) -> bool:
        """Links ``libcuda.so.1``: importing it fails where no NVIDIA driver is installed."""
        return any("libcuda.so.1" in libs for libs in self.libraries.values())


def inspect_build(package_dir: str | Path | None = None) -> MooncakeBuild | None:
    """Read the build in ``package_dir`` (a ``mooncake`` folder), by default the
    importable one; ``None`` if there is none. Imports nothing from Mooncake.

    Raises ``ValueError`` if its native modules disagree on the CUDA major.
    """
    if package_dir is None:
        spec = importlib.util.find_spec("mooncake")
        if spec is None or not spec.submodule_search_locations:
            return None
        package_dir = next(iter(spec.submodule_search_locations))
    root = Path(package_dir)
    libraries = {
        f.name: needed(f) for pattern in _NATIVE for f in sorted(root.glob(pattern)) if f.is_file()
    }
    if not libraries:
        return None
    majors = {
        name: {int(m.group(1)) for lib in libs if (m := _CUDART.match(lib))}
        for name, libs in libraries.items()
    }
    found = set().union(*majors.values())
    if len(found) > 1 or (found and not all(majors.values())):
        raise ValueError(f"Mooncake in {root} mixes CUDA runtimes: {majors}")
    distribution, version = _dist_info(root)
    major = found.pop() if found else None
    return MooncakeBuild(str(root), distribution, version, libraries, major)


def cuda_build() -> bool:
    """Whether the importable Mooncake is a CUDA build (registers device memory)."""
    build = inspect_build()
    return build is not None and build.device_memory


def _dist_info(root: Path) -> tuple[str, str]:
    for meta in sorted(root.parent.glob("mooncake_transfer_engine*.dist-info/METADATA")):
        fields = dict(
            line.split(": ", 1)
            for line in meta.read_text(errors="replace").splitlines()[:20]
            if ": " in line
        )
        if (meta.parent / "RECORD").exists() and _owns(meta.parent / "RECORD"):
            return fields.get("Name", ""), fields.get("Version", "")
    return "", ""


def _owns(record: Path) -> bool:
    return any(line.startswith("mooncake/engine.so,") for line in record.read_text().splitlines())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mooncake_diffusion.platform.deployment",
        description="Show which Mooncake wheel matches this environment's torch and what the "
        "installed Mooncake build links against (read from its ELF files, not imported).",
    )
    parser.add_argument(
        "what",
        nargs="?",
        choices=("report", "requirement", "extra"),
        default="report",
        help="report: JSON of both (default); requirement: the pip requirement of the "
        "matching wheel; extra: the mooncake-diffusion extra that pulls it",
    )
    args = parser.parse_args(argv)
    try:
        wheel = wheel_for(torch_cuda())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.what == "requirement":
        print(wheel.requirement)
    elif args.what == "extra":
        print(wheel.extra)
    else:
        build = inspect_build()
        report = {
            "torch_cuda": torch_cuda(),
            "wheel": {**asdict(wheel), "requirement": wheel.requirement},
            "installed": None
            if build is None
            else {**asdict(build), "device_memory": build.device_memory},
        }
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
