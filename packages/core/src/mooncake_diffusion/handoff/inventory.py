"""What the store holds of ours, by kind: the data of ``mooncake-diffusion store ls``.

    entries = inventory(settings)        # one listing of the master's keys, a size each
    print(render(summarise(entries)))    # a table by kind; render_keys(entries) per key

Kinds, from the key alone (the layouts are those of ``transports/store.py``,
``mailbox.py``, ``transfer/leases.py`` and ``caches/``):

    payload   mcd/<request_id>/<kind>/<nonce>[@<expires_ms>]/<tensor>.<chunk>[.<part>]
    record    mcd-mbox/<name>                  a keyed handoff's record, not yet taken
    anchor    mcd-mbox-anchor/<name>/<nonce>   one byte beside each record (its commit)
    claimed   mcd-mbox-lease/<name>/<nonce>/<g>  a consumer's lease on a record
    marker    mcd-ttl/<expires_ms>[.<tag>]/<key>  one byte: <key> expires then
    cache     mcd-cache/...                    condition-embedding, CFG, checkpoints
    other     anything else (not ours)

Keys carry their expiry, not their birth: each entry has ``expires_in_s`` (``None``
without a TTL), and ``age_s`` when the caller says which ``ttl_s`` wrote them. An
entry whose expiry has passed is still listed (the reaper had not come by yet).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass

from mooncake_diffusion._mooncake.master import admin_get
from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.handoff.mailbox import MAILBOX_ROOT
from mooncake_diffusion.platform.settings import MooncakeSettings
from mooncake_diffusion.transfer.leases import TTL_ROOT, expiry_of
from mooncake_diffusion.transfer.transports.store import KEY_ROOT

__all__ = ["KINDS", "Entry", "inventory", "kind_of", "render", "render_keys", "summarise"]

KINDS = ("payload", "record", "anchor", "claimed", "marker", "cache", "other")
_LEASE_ROOT = MAILBOX_ROOT.rstrip("/") + "-lease/"
_ANCHOR_ROOT = MAILBOX_ROOT.rstrip("/") + "-anchor/"
_ROOTS = (
    (_LEASE_ROOT, "claimed"),
    (_ANCHOR_ROOT, "anchor"),
    (MAILBOX_ROOT, "record"),
    (TTL_ROOT, "marker"),
    ("mcd-cache/", "cache"),
    (KEY_ROOT, "payload"),
)


@dataclass(frozen=True)
class Entry:
    """One store key: its kind, size (``None``: gone or mid-put while listed), the
    seconds until it expires (``None``: no TTL; negative: overdue) and, when the TTL
    that wrote it is known, its age."""

    key: str
    kind: str
    size: int | None
    expires_in_s: float | None
    age_s: float | None = None


def kind_of(key: str) -> str:
    """The kind of ``key`` (one of ``KINDS``)."""
    for root, kind in _ROOTS:
        if key.startswith(root):
            return kind
    return "other"


def inventory(
    settings: MooncakeSettings, *, ttl_s: float | None = None, now: float | None = None
) -> list[Entry]:
    """Every key the master holds, classified and sized (one listing through the admin
    API, ``settings.admin_address``, and one size query per key)."""
    text = admin_get(settings.admin_address, "/get_all_keys").decode(errors="replace")
    keys = sorted(k for k in text.splitlines() if k)
    client = StoreClient(dataclasses.replace(settings, store_direct_reads=False, store_watch_s=0))
    try:
        sizes = client.sizes_of(keys)
    finally:
        client.close()
    now = time.time() if now is None else now
    out = []
    for key, size in zip(keys, sizes, strict=True):
        expiry = expiry_of(key) if kind_of(key) in ("payload", "marker") else None
        left = None if expiry is None else expiry - now
        age = None if left is None or ttl_s is None else ttl_s - left
        out.append(Entry(key, kind_of(key), size, left, age))
    return out


def summarise(entries: Iterable[Entry]) -> list[tuple[str, int, int, float | None]]:
    """(kind, keys, bytes, soonest expiry in s) for each kind present, in ``KINDS``
    order."""
    rows: dict[str, list] = {}
    for e in entries:
        row = rows.setdefault(e.kind, [e.kind, 0, 0, None])
        row[1] += 1
        row[2] += e.size or 0
        if e.expires_in_s is not None and (row[3] is None or e.expires_in_s < row[3]):
            row[3] = e.expires_in_s
    return [tuple(rows[k]) for k in KINDS if k in rows]  # type: ignore[misc]


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _seconds(s: float | None) -> str:
    return "-" if s is None else f"{s:.0f} s"


def render(rows: list[tuple[str, int, int, float | None]]) -> str:
    """The by-kind table of ``summarise``'s rows."""
    lines = [f"{'kind':<8} {'keys':>6} {'bytes':>11} {'next expiry':>12}"]
    for kind, n, size, soonest in rows:
        lines.append(f"{kind:<8} {n:>6} {_bytes(size):>11} {_seconds(soonest):>12}")
    if not rows:
        lines.append("(the store holds no key)")
    return "\n".join(lines)


def render_keys(entries: Iterable[Entry]) -> str:
    """One line per key: kind, size, expiry, age (when known) and the key."""
    lines = [f"{'kind':<8} {'bytes':>11} {'expires in':>11} {'age':>8}  key"]
    for e in entries:
        lines.append(
            f"{e.kind:<8} {_bytes(e.size):>11} {_seconds(e.expires_in_s):>11} "
            f"{_seconds(e.age_s):>8}  {e.key}"
        )
    return "\n".join(lines)
