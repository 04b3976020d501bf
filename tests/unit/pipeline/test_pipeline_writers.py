"""PNG and GIF writers: what is written reads back."""

import numpy as np
import pytest
from PIL import Image

from mooncake_diffusion.pipeline import write_frames

pytestmark = pytest.mark.unit


def frames(n, h=16, w=24):
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(n, h, w, 3), dtype=np.uint8)


def test_one_frame_is_a_lossless_png(tmp_path):
    f = frames(1)
    path = write_frames(f, tmp_path / "img")
    assert path.name == "img.png"
    with Image.open(path) as im:
        assert np.array_equal(np.asarray(im.convert("RGB")), f[0])


def test_several_frames_are_a_gif(tmp_path):
    path = write_frames(frames(5), tmp_path / "vid", fps=10)
    assert path.name == "vid.gif"
    with Image.open(path) as im:
        assert (im.n_frames, im.size) == (5, (24, 16))


def test_bad_frames_raise(tmp_path):
    with pytest.raises(ValueError, match="uint8"):
        write_frames(frames(1).astype(np.float32), tmp_path / "x")
    with pytest.raises(ValueError, match="uint8"):
        write_frames(np.zeros((2, 4, 4), np.uint8), tmp_path / "x")
