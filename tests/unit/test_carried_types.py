"""Registered classes through the keyed skeleton: rebuilt as their class, no pickle."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

from mooncake_diffusion.errors import HandleError, PayloadError
from mooncake_diffusion.handoff.keyed import EXT_OBJECT, pack, unpack
from mooncake_diffusion.wire import carried

pytestmark = pytest.mark.unit


def roundtrip(obj, inline_bytes=1024):
    skeleton, moved = pack(obj, inline_bytes)
    received = {
        i: t.clone() if isinstance(t, torch.Tensor) else t.copy() for i, (_, t) in enumerate(moved)
    }
    return unpack(skeleton, received), moved


class Output:
    """Like vLLM's RequestOutput: a plain class, attributes set after construction too."""

    def __init__(self, request_id: str, outputs: list) -> None:
        self.request_id = request_id
        self.outputs = outputs


@dataclasses.dataclass
class Completion:
    """Like vLLM's CompletionOutput: a dataclass (msgspec would send it as a map)."""

    index: int
    token_ids: list[int]
    _private: str = "p"


@dataclasses.dataclass
class Unregistered:
    inner: Completion
    n: int = 0


class Frozen(msgspec.Struct, frozen=True):
    a: int
    t: torch.Tensor | None = None


@pytest.fixture(scope="module", autouse=True)
def registered():
    for cls in (Output, Completion, Frozen):
        carried.register_type(cls)


def test_registered_classes_come_back_as_themselves_with_every_attribute():
    out = Output("r1", [Completion(0, [1, 2, 3]), Completion(1, [4])])
    out.multimodal_output = {"latent": torch.randn(64, 64)}  # set after construction
    got, moved = roundtrip({"o": out, "s": Frozen(2, torch.arange(3))})
    o = got["o"]
    assert type(o) is Output and o.request_id == "r1"
    assert [type(c) for c in o.outputs] == [Completion, Completion]
    assert o.outputs[0] == Completion(0, [1, 2, 3]) and o.outputs[1].token_ids == [4]
    assert [k for k, _ in moved] == ["torch"]  # the latent moved as raw bytes
    assert torch.equal(o.multimodal_output["latent"], out.multimodal_output["latent"])
    assert type(got["s"]) is Frozen and got["s"].a == 2 and torch.equal(got["s"].t, torch.arange(3))


def test_registered_dataclass_is_found_inside_an_unregistered_one_and_tuples():
    got, _ = roundtrip([Unregistered(Completion(3, [9])), (Completion(4, []),)])
    assert got[0] == {"inner": Completion(3, [9]), "n": 0}  # unregistered: a dict, as before
    assert got[1] == [Completion(4, [])]


def test_slice_is_built_in():
    got, _ = roundtrip({"s": [slice(1, None, 2), slice(5)]})
    assert got == {"s": [slice(1, None, 2), slice(None, 5, None)]}


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P", "I;16", "F"])
def test_pil_images_of_every_common_mode(mode):
    rng = np.random.default_rng(1)
    img = Image.new(mode, (40, 30))
    img.frombytes(rng.integers(0, 256, len(img.tobytes()), dtype=np.uint8).tobytes())
    if mode == "P":
        img.putpalette(rng.integers(0, 256, 768, dtype=np.uint8).tolist())
    got, moved = roundtrip([img], inline_bytes=1024)
    back = got[0]
    assert isinstance(back, Image.Image) and back.mode == mode and back.size == (40, 30)
    assert back.tobytes() == img.tobytes()
    assert back.getpalette() == img.getpalette()
    assert [k for k, _ in moved] == (["numpy"] if len(img.tobytes()) >= 1024 else [])


def test_a_subclass_of_a_registered_class_is_not_carried_as_it():
    class Sub(Output):
        pass

    with pytest.raises(PayloadError, match="without pickle"):
        pack(Sub("x", []), 1024)


def test_an_unknown_tag_is_a_handle_error_and_nothing_is_imported():
    ext = msgspec.msgpack.Ext(EXT_OBJECT, msgspec.msgpack.encode(("os.system", {"x": 1})))
    with pytest.raises(HandleError, match="has not registered"):
        unpack(msgspec.msgpack.encode([ext]), {})


def test_a_state_that_does_not_rebuild_is_a_handle_error():
    ext = msgspec.msgpack.Ext(
        EXT_OBJECT, msgspec.msgpack.encode((f"{__name__}.Frozen", {"zzz": 1}))
    )
    with pytest.raises(HandleError, match="Frozen"):
        unpack(msgspec.msgpack.encode(ext), {})
    bad = msgspec.msgpack.Ext(EXT_OBJECT, msgspec.msgpack.encode([1, 2, 3]))
    with pytest.raises(HandleError, match="corrupt"):
        unpack(msgspec.msgpack.encode(bad), {})


def test_registration_is_idempotent_and_conflicts_are_refused():
    assert carried.register_type(Output) is carried.register_type(Output)
    with pytest.raises(ValueError, match="already registered"):
        carried.register_type(Completion, tag=f"{__name__}.Output")
    with pytest.raises(ValueError, match="needs a class"):
        carried.register_type(Output("a", []))  # type: ignore[arg-type]
