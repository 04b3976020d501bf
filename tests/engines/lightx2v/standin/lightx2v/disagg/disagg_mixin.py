"""Stand-in for ``lightx2v.disagg.disagg_mixin``: the runner seam of LightX2V's
disaggregation, method names and parameters as at f8aee98b.

LightX2V's bodies (ZMQ bootstrap, pinned fp32-sized buffers, 1 MiB synchronous
Mooncake writes, SHA-256) cannot run here; these bodies stand for them and
record each call in ``self.builtin_calls``, so tests can tell that a runner
not configured for the adapter went through LightX2V's own path untouched.
Only the six seam methods are public; the queue-mode methods of the real
mixin are left out, as the adapter does not route them.
"""

from lightx2v_platform.base.global_var import AI_DEVICE  # bound at import, as in LightX2V

#: What this module saw as the device when it was imported (None = imported too early).
DEVICE_AT_IMPORT = AI_DEVICE


class DisaggMixin:
    """LightX2V's ``DisaggMixin`` surface (stand-in)."""

    def _builtin(self, name: str) -> None:
        self.__dict__.setdefault("builtin_calls", []).append(name)

    def init_disagg(self, config):
        self._builtin("init_disagg")
        self._disagg_mode = config.get("disagg_mode")
        self._disagg_sender = self._disagg_receiver = None
        self._disagg_p2_sender = self._disagg_p2_receiver = None
        decoder = config.get("disagg_config", {}).get("decoder_engine_rank")
        if self._disagg_mode == "transformer" and decoder is not None:
            self._disagg_p2_sender = "builtin Phase 2 sender"

    def send_encoder_outputs(self, inputs: dict, latent_shape: list):
        self._builtin("send_encoder_outputs")

    def receive_encoder_outputs(self) -> dict:
        self._builtin("receive_encoder_outputs")
        return {}

    def send_transformer_outputs(self, latents):
        self._builtin("send_transformer_outputs")

    def receive_transformer_outputs(self):
        self._builtin("receive_transformer_outputs")

    def release_disagg(self):
        self._builtin("release_disagg")
