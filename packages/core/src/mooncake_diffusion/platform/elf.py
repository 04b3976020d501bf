"""The ``DT_NEEDED`` entries of an ELF shared library, read without loading it.

A CUDA build of Mooncake cannot even be imported on a machine without the CUDA
driver (``libcuda.so.1``), so what a wheel links against is read from its files:

    needed("/site-packages/mooncake/engine.so")  # -> ["libcudart.so.13", ...]

Pure Python, 64- and 32-bit, either byte order. Raises ``ValueError`` for a file
that is not an ELF shared object with a dynamic section.
"""

from __future__ import annotations

import struct
from pathlib import Path

__all__ = ["needed"]

_DT_NULL, _DT_NEEDED, _DT_STRTAB = 0, 1, 5
_PT_LOAD, _PT_DYNAMIC = 1, 2


def needed(path: str | Path) -> list[str]:
    """The libraries ``path`` names in ``DT_NEEDED``, in file order."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF":
        raise ValueError(f"{path}: not an ELF file")
    wide = {1: False, 2: True}.get(data[4])
    order = {1: "<", 2: ">"}.get(data[5])
    if wide is None or order is None:
        raise ValueError(f"{path}: unknown ELF class or byte order")
    if wide:
        phoff = _unpack(data, order + "Q", 0x20)[0]
        phentsize, phnum = _unpack(data, order + "HH", 0x36)
        ph_fmt, dyn_fmt = order + "IIQQQQQQ", order + "qQ"
    else:
        phoff = _unpack(data, order + "I", 0x1C)[0]
        phentsize, phnum = _unpack(data, order + "HH", 0x2A)
        ph_fmt, dyn_fmt = order + "IIIIIIII", order + "iI"
    loads: list[tuple[int, int, int]] = []  # (vaddr, offset, filesz)
    dynamic: tuple[int, int] | None = None  # (offset, filesz)
    for i in range(phnum):
        fields = _unpack(data, ph_fmt, phoff + i * phentsize)
        if wide:
            p_type, _flags, offset, vaddr, _paddr, filesz = fields[:6]
        else:
            p_type, offset, vaddr, _paddr, filesz = fields[:5]
        if p_type == _PT_LOAD:
            loads.append((vaddr, offset, filesz))
        elif p_type == _PT_DYNAMIC:
            dynamic = (offset, filesz)
    if dynamic is None:
        raise ValueError(f"{path}: no dynamic section (a static binary?)")
    entry = struct.calcsize(dyn_fmt)
    names: list[int] = []
    strtab = None
    for pos in range(dynamic[0], dynamic[0] + dynamic[1], entry):
        tag, value = _unpack(data, dyn_fmt, pos)
        if tag == _DT_NULL:
            break
        if tag == _DT_NEEDED:
            names.append(value)
        elif tag == _DT_STRTAB:
            strtab = value
    if strtab is None:
        raise ValueError(f"{path}: dynamic section without a string table")
    base = _file_offset(loads, strtab, path)
    return [_cstring(data, base + n) for n in names]


def _unpack(data: bytes, fmt: str, pos: int) -> tuple[int, ...]:
    try:
        return struct.unpack_from(fmt, data, pos)
    except struct.error:
        raise ValueError(f"truncated ELF header or table at offset {pos}") from None


def _file_offset(loads: list[tuple[int, int, int]], vaddr: int, path: str | Path) -> int:
    for start, offset, size in loads:
        if start <= vaddr < start + size:
            return offset + vaddr - start
    raise ValueError(f"{path}: string table address {vaddr:#x} outside every loaded segment")


def _cstring(data: bytes, pos: int) -> str:
    end = data.find(b"\0", pos)
    if end < 0:
        raise ValueError("unterminated string in the ELF string table")
    return data[pos:end].decode("utf-8", "replace")
