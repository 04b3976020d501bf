"""Output writers: PNG for an image, GIF for a video (Pillow; no torch needed).

path = write_frames(frames, "out/r1")   # frames uint8 [F, H, W, 3] (tensor or ndarray)
                                        # -> out/r1.png (F == 1) or out/r1.gif
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["write_frames", "write_gif", "write_png"]


def _array(frames: Any) -> np.ndarray:
    arr = np.asarray(frames.numpy() if hasattr(frames, "numpy") else frames)
    if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[-1] != 3 or arr.shape[0] < 1:
        raise ValueError(f"frames must be uint8 [F >= 1, H, W, 3], got {arr.dtype} {arr.shape}")
    return arr


def write_png(frames: Any, path: str | Path) -> Path:
    """The first frame as a PNG at ``path``."""
    from PIL import Image

    p = Path(path)
    Image.fromarray(_array(frames)[0]).save(p, format="PNG")
    return p


def write_gif(frames: Any, path: str | Path, *, fps: int = 8) -> Path:
    """Every frame as a looping GIF at ``path`` (``fps`` frames per second)."""
    from PIL import Image

    p = Path(path)
    imgs = [Image.fromarray(f) for f in _array(frames)]
    imgs[0].save(
        p, format="GIF", save_all=True, append_images=imgs[1:], duration=1000 // fps, loop=0
    )
    return p


def write_frames(frames: Any, stem: str | Path, *, fps: int = 8) -> Path:
    """``stem + ".png"`` for one frame, ``stem + ".gif"`` for more; returns the path."""
    arr = _array(frames)
    stem = Path(stem)
    if arr.shape[0] == 1:
        return write_png(arr, stem.with_name(stem.name + ".png"))
    return write_gif(arr, stem.with_name(stem.name + ".gif"), fps=fps)
