"""Choosing the Mooncake wheel and reading what a build links against, on CPU."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from elfwriter import write_so

from mooncake_diffusion.platform.deployment import (
    WHEELS,
    inspect_build,
    main,
    torch_cuda,
    wheel_for,
)
from mooncake_diffusion.platform.elf import needed

pytestmark = pytest.mark.unit

CUDA13 = ["libcudart.so.13", "libcuda.so.1", "libc.so.6"]


@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("big", [False, True])
def test_needed_reads_every_class_and_byte_order(tmp_path: Path, wide: bool, big: bool) -> None:
    f = write_so(tmp_path / "x.so", ["liba.so.1", "libcudart.so.12"], wide=wide, big=big)
    assert needed(f) == ["liba.so.1", "libcudart.so.12"]


def test_needed_matches_readelf_on_the_installed_wheel() -> None:
    build = inspect_build()
    assert build is not None, "no mooncake installed in the test environment"
    engine = Path(build.root) / "engine.so"
    ours = needed(engine)
    assert "libibverbs.so.1" in ours  # the CPU wheel links the system libibverbs
    readelf = shutil.which("readelf")
    if readelf:
        out = subprocess.run([readelf, "-d", str(engine)], capture_output=True, text=True).stdout
        theirs = [ln.split("[", 1)[1].rstrip("]") for ln in out.splitlines() if "(NEEDED)" in ln]
        assert ours == theirs


def test_needed_rejects_what_is_not_a_shared_library(tmp_path: Path) -> None:
    (tmp_path / "t.so").write_bytes(b"not an elf")
    with pytest.raises(ValueError, match="not an ELF"):
        needed(tmp_path / "t.so")
    (tmp_path / "short.so").write_bytes(b"\x7fELF\x02\x01\x01")
    with pytest.raises(ValueError, match="truncated"):
        needed(tmp_path / "short.so")


def test_wheel_for_follows_the_cuda_major() -> None:
    assert wheel_for(None).distribution == "mooncake-transfer-engine-non-cuda"
    assert wheel_for("12.8").extra == "cuda12"
    assert wheel_for("13.0").distribution == "mooncake-transfer-engine-cuda13"
    with pytest.raises(ValueError, match="CUDA 11"):
        wheel_for("11.8")
    assert len({w.requirement.split("==")[1] for w in WHEELS}) == 1  # one release everywhere


def _package(tmp_path: Path, engine: list[str], store: list[str], store_name="store.so") -> Path:
    pkg = tmp_path / "mooncake"
    pkg.mkdir()
    write_so(pkg / "engine.so", engine)
    write_so(pkg / store_name, store)
    return pkg


def test_a_cuda13_build_is_found_by_its_links_whatever_its_name(tmp_path: Path) -> None:
    pkg = _package(tmp_path, CUDA13, CUDA13, "_store.cpython-311-x86_64-linux-gnu.so")
    build = inspect_build(pkg)
    assert build is not None
    assert (build.cuda_major, build.device_memory, build.needs_driver) == (13, True, True)
    assert build.distribution == ""  # no dist-info: detection never needed the name


def test_a_cpu_build_cannot_hold_device_memory(tmp_path: Path) -> None:
    build = inspect_build(_package(tmp_path, ["libibverbs.so.1"], ["libibverbs.so.1"]))
    assert build is not None
    assert (build.cuda_major, build.device_memory, build.needs_driver) == (None, False, False)


def test_mixed_cuda_runtimes_are_an_error(tmp_path: Path) -> None:
    pkg = _package(tmp_path, ["libcudart.so.12"], ["libcudart.so.13"])
    with pytest.raises(ValueError, match="mixes CUDA runtimes"):
        inspect_build(pkg)


def test_an_empty_folder_is_no_build(tmp_path: Path) -> None:
    assert inspect_build(tmp_path) is None


def test_the_command_prints_the_requirement(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["requirement"]) == 0
    assert capsys.readouterr().out.strip() == wheel_for(torch_cuda()).requirement
