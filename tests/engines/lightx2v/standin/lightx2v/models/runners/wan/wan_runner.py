"""Stand-in for ``lightx2v.models.runners.wan.wan_runner.WanRunner``: LightX2V's
disaggregated control flow (``init_modules``, ``run_pipeline`` and the three
``_run_pipeline_disagg_*`` roles) around deterministic fake models.

Shapes follow LightX2V's Wan I2V/T2V at the configured size: ``context`` and
``context_null`` ``[1, text_len, text_encoder_dim]``, ``clip_encoder_out``
``[257, 1280]``, ``vae_encoder_out`` ``[z + 4, T', H', W']``, latents
``[z, T', H', W']`` in fp32 (the scheduler's dtype). Every value is a function
of the request's seed (encoder) or of the received inputs (transformer), so a
corrupted byte anywhere changes what the decoder returns.

Test hooks: ``standin_load_until`` (see ``load_model``); and a slow DiT: with
``standin_hold_until`` in the config (a request may set it through
``set_config``), ``run_segment`` reports progress, then waits until that file
exists, so a test can kill a Transformer mid-item.
"""

import hashlib
import math
import os
import time

import torch

from lightx2v.disagg.disagg_mixin import DisaggMixin
from lightx2v.utils.envs import GET_DTYPE

IMAGE_TASKS = ("i2v", "flf2v", "animate", "s2v", "rs2v", "i2i")


def latent_dims(config) -> tuple[int, int, int, int]:
    """``[z, T', H', W']`` of LightX2V's Wan latent for the configured video size."""
    stride = config.get("vae_stride", (4, 8, 8))
    t = 1 + (int(config.get("target_video_length", 81)) - 1) // int(stride[0])
    h = math.ceil(int(config.get("target_height", 480)) / int(stride[1]))
    w = math.ceil(int(config.get("target_width", 832)) / int(stride[2]))
    return int(config.get("vae_z_dim", 16)), t, h, w


def _digest_seed(tensors) -> int:
    h = hashlib.sha256()
    for t in tensors:
        if t is not None:
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little")


class WanRunner(DisaggMixin):
    def __init__(self, config):
        self.config = config
        self.input_info = None
        self.inputs = None
        self.progress_callback = None

    def set_config(self, config_modify):
        """As ``DefaultRunner.set_config``: a server merges each request's task data."""
        self.config.update(config_modify)

    def set_progress_callback(self, callback):
        self.progress_callback = callback

    def init_modules(self):
        if self.config.get("disagg_mode"):
            self.init_disagg(self.config)
        self.load_model()

    def load_model(self):
        """Models load after ``init_disagg``, as in LightX2V. Test hook (a slow load):
        with ``standin_load_until`` in the config, wait until that file exists."""
        hold = self.config.get("standin_load_until")
        while hold and not os.path.exists(hold):
            time.sleep(0.02)
        self.loaded = True

    # fake models ------------------------------------------------------------
    def run_input_encoder(self) -> dict:
        c = self.config
        g = torch.Generator().manual_seed(int(self.input_info.seed))
        dtype = GET_DTYPE()
        shape = (1, int(c.get("text_len", 512)), int(c.get("text_encoder_dim", 4096)))
        text = {"context": torch.randn(shape, generator=g).to(dtype)}
        text["context_null"] = (
            torch.randn(shape, generator=g).to(dtype) if c.get("enable_cfg") else None
        )
        image = None
        if c.get("task") in IMAGE_TASKS:
            z, t, h, w = latent_dims(c)
            image = {
                "clip_encoder_out": torch.randn((257, 1280), generator=g).to(dtype),
                "vae_encoder_out": torch.randn((z + 4, t, h, w), generator=g).to(dtype),
            }
        return {"text_encoder_output": text, "image_encoder_output": image}

    def run_segment(self, segment_idx=0) -> torch.Tensor:
        text = self.inputs["text_encoder_output"]
        image = self.inputs.get("image_encoder_output") or {}
        seed = _digest_seed([text.get("context"), text.get("context_null"), *image.values()])
        g = torch.Generator().manual_seed(seed % (1 << 63))
        hold = self.config.get("standin_hold_until")
        if hold:
            if self.progress_callback is not None:
                self.progress_callback(1, 2)
            while not os.path.exists(hold):
                time.sleep(0.02)
        return torch.randn(tuple(self.input_info.latent_shape), generator=g)

    def run_vae_decoder(self, latents):
        return latents

    # LightX2V's disaggregated control flow ----------------------------------
    def _run_pipeline_disagg_encoder(self):
        self.inputs = self.run_input_encoder()
        # LightX2V's encoder derives the latent shape from the configured video size
        latent_shape = list(self.input_info.latent_shape or latent_dims(self.config))
        self.send_encoder_outputs(self.inputs, latent_shape)
        return None

    def _run_pipeline_disagg_transformer(self):
        self.inputs = self.receive_encoder_outputs()
        latent_shape = self.inputs.get("latent_shape")
        if latent_shape:
            self.input_info.latent_shape = latent_shape
        latents = self.run_segment(0)
        if self._disagg_p2_sender is not None:
            self.send_transformer_outputs(latents)
            return None
        return self.run_vae_decoder(latents)

    def _run_pipeline_disagg_decode(self):
        latents = self.receive_transformer_outputs()
        self.gen_video = self.run_vae_decoder(latents)
        return self.gen_video

    def run_pipeline(self, input_info):
        if not getattr(self, "loaded", False):
            raise RuntimeError("run_pipeline before the models were loaded")
        self.input_info = input_info
        mode = self.config.get("disagg_mode")
        if mode == "encoder":
            return self._run_pipeline_disagg_encoder()
        if mode == "transformer":
            return self._run_pipeline_disagg_transformer()
        if mode == "decode":
            return self._run_pipeline_disagg_decode()
        raise NotImplementedError("the stand-in runs disaggregated roles only")
