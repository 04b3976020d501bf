"""Classes a keyed handoff carries by type tag and rebuilds on the other side, no pickle.

An engine's stage outputs are often its own classes (vLLM's ``RequestOutput``,
vLLM-Omni's ``OmniRequestOutput``, ``PIL.Image``), and the next stage reads them by
attribute. A registered class travels as a type tag plus its state (a dict of
attribute names to values, which may hold tensors, arrays and other registered
objects); the receiver looks the tag up in its own registry and rebuilds the
class. Only registered classes are ever built from the wire: an unknown tag is a
``HandleError``, never an import.

Call sequence (registrations are process-wide; each process that sends or
receives a class registers it, e.g. an adapter's plugin on import):

    register_type(cls)                       # state = the instance's attributes
    register_type(cls, to_state=f, from_state=g, subclasses=True)
    register_lazy(tag, module, loader)       # registered once ``module`` is imported
    entry = carried_for(obj)                 # encoder: the entry for obj's class, or None
    entry = by_tag(tag)                      # decoder: the entry, or HandleError
    native_carried()                         # any registered class msgspec encodes itself?

Built in: ``slice`` (start, stop, step) and, once ``PIL.Image`` is imported anywhere
in the process, ``PIL.Image.Image`` and its subclasses (mode, size, palette and the
pixel bytes as a uint8 array, which moves like any array: raw bytes, zero-copy
above the inline threshold; rebuilt as a plain ``PIL.Image.Image``).

The default state of an instance is its ``__dict__`` (all attributes, including ones
set after construction) or, for msgspec Structs and ``__slots__`` classes, its
fields; the default rebuild makes the instance without calling ``__init__`` and
sets those attributes (a Struct is built through its constructor, which checks
them). Registration is exact by default: a subclass of a registered class is not
carried as it unless ``subclasses=True`` (it would come back as the base class).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, is_dataclass
from typing import Any

import msgspec

from mooncake_diffusion.errors import HandleError

__all__ = [
    "CarriedType",
    "by_tag",
    "carried_for",
    "native_carried",
    "register_lazy",
    "register_type",
    "registered_tags",
]

_MAX_TAG = 256


@dataclass(frozen=True)
class CarriedType:
    """How one class travels: ``tag`` names it on the wire; ``to_state(obj)`` returns a
    ``dict[str, Any]`` of what rebuilds it; ``from_state(cls, state)`` rebuilds it."""

    tag: str
    cls: type
    to_state: Callable[[Any], dict[str, Any]]
    from_state: Callable[[type, dict[str, Any]], Any]
    subclasses: bool = False

    @property
    def native(self) -> bool:
        """msgspec encodes instances itself (dataclass, Struct): the hook never sees them."""
        return is_dataclass(self.cls) or issubclass(self.cls, msgspec.Struct)


_lock = threading.Lock()
_by_type: dict[type, CarriedType] = {}
_by_tag: dict[str, CarriedType] = {}
_subclass_entries: list[CarriedType] = []
_lazy: dict[str, tuple[str, Callable[[], None]]] = {}  # tag -> (module, loader)


def _slot_names(cls: type) -> list[str]:
    names: list[str] = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names.extend([slots] if isinstance(slots, str) else slots)
    return [n for n in names if n not in ("__dict__", "__weakref__")]


def attributes(obj: Any) -> dict[str, Any]:
    """The default state: a Struct's fields, else ``__dict__`` plus any slots that are set."""
    if isinstance(obj, msgspec.Struct):
        return {f: getattr(obj, f) for f in obj.__struct_fields__}
    state = dict(getattr(obj, "__dict__", {}))
    for name in _slot_names(type(obj)):
        if hasattr(obj, name):
            state[name] = getattr(obj, name)
    return state


def rebuild(cls: type, state: dict[str, Any]) -> Any:
    """The default rebuild: a Struct through its constructor; anything else made
    without ``__init__`` and given ``state`` as its attributes."""
    if issubclass(cls, msgspec.Struct):
        try:
            return cls(**state)
        except (TypeError, msgspec.ValidationError) as e:
            raise HandleError(f"cannot rebuild {cls.__qualname__}: {e}") from None
    obj = cls.__new__(cls)
    for name, value in state.items():
        object.__setattr__(obj, name, value)
    return obj


def register_type(
    cls: type,
    *,
    tag: str | None = None,
    to_state: Callable[[Any], dict[str, Any]] | None = None,
    from_state: Callable[[type, dict[str, Any]], Any] | None = None,
    subclasses: bool = False,
) -> CarriedType:
    """Carry ``cls`` by ``tag`` (default ``f"{module}.{qualname}"``). Idempotent for the
    same class and tag; raises ``ValueError`` when the tag names another class or the
    class is registered under another tag."""
    if not isinstance(cls, type):
        raise ValueError(f"register_type needs a class, got {cls!r}")
    tag = tag or f"{cls.__module__}.{cls.__qualname__}"
    if not 0 < len(tag) <= _MAX_TAG:
        raise ValueError(f"a type tag is 1..{_MAX_TAG} characters, got {len(tag)}")
    entry = CarriedType(tag, cls, to_state or attributes, from_state or rebuild, subclasses)
    with _lock:
        old = _by_tag.get(tag) or _by_type.get(cls)
        if old is not None:
            if old.cls is cls and old.tag == tag:
                return old
            raise ValueError(f"type tag {tag!r} / class {cls!r} already registered as {old}")
        _by_tag[tag] = entry
        _by_type[cls] = entry
        if subclasses:
            _subclass_entries.append(entry)
    return entry


def register_lazy(tag: str, module: str, loader: Callable[[], None]) -> None:
    """Register ``tag`` by calling ``loader()`` (which calls ``register_type``) once
    ``module`` is imported in this process, or when a record names ``tag``: keeps
    heavy imports (PIL) out of processes that never carry the class."""
    with _lock:
        _lazy.setdefault(tag, (module, loader))


def _load_lazy(only_tag: str | None = None) -> None:
    with _lock:
        due = [
            (tag, loader)
            for tag, (module, loader) in _lazy.items()
            if (only_tag is None and module in sys.modules) or tag == only_tag
        ]
        for tag, _ in due:
            del _lazy[tag]
    for _, loader in due:
        loader()


def carried_for(obj: Any) -> CarriedType | None:
    """The entry that carries ``obj``: its exact class, else a ``subclasses=True`` base."""
    cls = type(obj)
    entry = _by_type.get(cls)
    if entry is not None:
        return entry
    if _lazy:
        _load_lazy()
        entry = _by_type.get(cls)
        if entry is not None:
            return entry
    for base in _subclass_entries:
        if isinstance(obj, base.cls):
            return base
    return None


def by_tag(tag: str) -> CarriedType:
    """The entry registered as ``tag``; ``HandleError`` when this process has none."""
    entry = _by_tag.get(tag)
    if entry is None and tag in _lazy:
        _load_lazy(tag)
        entry = _by_tag.get(tag)
    if entry is None:
        raise HandleError(
            f"keyed record carries a {tag!r}, a type this process has not registered "
            "(register_type it here too, e.g. by loading the engine adapter's plugin)"
        )
    return entry


def native_carried() -> bool:
    """Whether a registered class is one msgspec encodes by itself (so a sender has to
    find its instances before msgspec does)."""
    if _lazy:
        _load_lazy()
    return any(entry.native for entry in _by_type.values())


def registered_tags() -> list[str]:
    """Every tag registered so far (lazy ones not yet loaded excluded)."""
    return sorted(_by_tag)


# ------------------------------------------------------------------ built-ins
def _slice_state(s: slice) -> dict[str, Any]:
    return {"start": s.start, "stop": s.stop, "step": s.step}


def _slice_from(_cls: type, st: dict[str, Any]) -> slice:
    return slice(st.get("start"), st.get("stop"), st.get("step"))


def _register_pil() -> None:
    import numpy as np
    from PIL import Image

    def to_state(img: Any) -> dict[str, Any]:
        palette = None
        if img.palette is not None and img.mode in ("P", "PA"):
            rawmode = img.palette.mode
            palette = {"rawmode": rawmode, "data": bytes(img.getpalette(rawmode) or [])}
        return {
            "mode": img.mode,
            "size": list(img.size),
            "palette": palette,
            "pixels": np.frombuffer(img.tobytes(), dtype=np.uint8),
        }

    def from_state(_cls: type, st: dict[str, Any]) -> Any:
        try:
            pixels = st["pixels"]
            img = Image.frombytes(st["mode"], tuple(st["size"]), memoryview(pixels).tobytes())
            if st.get("palette"):
                img.putpalette(st["palette"]["data"], st["palette"]["rawmode"])
        except (KeyError, TypeError, ValueError) as e:
            raise HandleError(f"keyed record: a PIL image that cannot be rebuilt: {e}") from None
        return img

    register_type(
        Image.Image, tag="PIL.Image", to_state=to_state, from_state=from_state, subclasses=True
    )


register_type(slice, tag="slice", to_state=_slice_state, from_state=_slice_from)
register_lazy("PIL.Image", "PIL.Image", _register_pil)
