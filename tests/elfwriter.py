"""A minimal ELF shared-object writer for tests: a dynamic section naming given
libraries, nothing else. Lets the ELF reader and build detection be checked on
CUDA builds without having those wheels installed."""

from __future__ import annotations

import struct
from pathlib import Path


def write_so(path: Path, libs: list[str], *, wide: bool = True, big: bool = False) -> Path:
    """Write an ELF file whose ``DT_NEEDED`` entries are ``libs``; returns ``path``."""
    o = ">" if big else "<"
    strtab = b"\0" + b"".join(lib.encode() + b"\0" for lib in libs)
    offsets, pos = [], 1
    for lib in libs:
        offsets.append(pos)
        pos += len(lib) + 1
    ehsize, phentsize = (64, 56) if wide else (52, 32)
    phoff, vaddr_base = ehsize, 0x1000
    str_off = phoff + 2 * phentsize
    dyn_off = str_off + len(strtab)
    dyn_fmt = o + ("qQ" if wide else "iI")
    dyn = b"".join(struct.pack(dyn_fmt, 1, n) for n in offsets)
    dyn += struct.pack(dyn_fmt, 5, vaddr_base + str_off) + struct.pack(dyn_fmt, 0, 0)
    total = dyn_off + len(dyn)
    ident = b"\x7fELF" + bytes([2 if wide else 1, 2 if big else 1, 1]) + b"\0" * 9
    if wide:
        header = ident + struct.pack(
            o + "HHIQQQIHHHHHH", 3, 62, 1, 0, phoff, 0, 0, ehsize, phentsize, 2, 0, 0, 0
        )
        ph = struct.pack(o + "IIQQQQQQ", 1, 5, 0, vaddr_base, vaddr_base, total, total, 0x1000)
        ph += struct.pack(
            o + "IIQQQQQQ", 2, 6, dyn_off, vaddr_base + dyn_off, 0, len(dyn), len(dyn), 8
        )
    else:
        header = ident + struct.pack(
            o + "HHIIIIIHHHHHH", 3, 3, 1, 0, phoff, 0, 0, ehsize, phentsize, 2, 0, 0, 0
        )
        ph = struct.pack(o + "IIIIIIII", 1, 0, vaddr_base, vaddr_base, total, total, 5, 0x1000)
        ph += struct.pack(
            o + "IIIIIIII", 2, dyn_off, vaddr_base + dyn_off, 0, len(dyn), len(dyn), 6, 4
        )
    path.write_bytes(header + ph + strtab + dyn)
    return path
