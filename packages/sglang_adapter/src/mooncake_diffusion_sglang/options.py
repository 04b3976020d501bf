"""The adapter's own settings: flags, an optional config file, and how they reach workers.

``sglang serve`` drops arguments that are not ``ServerArgs`` fields before it
spawns its scheduler processes, so the serve process resolves the adapter's
flags once (``Options.from_cli``) and exports them as JSON in the environment
variable ``MOONCAKE_DIFFUSION_SGLANG`` (``Options.export``); every spawned
process inherits it and reads it back with ``Options.from_env``. Precedence:
flag > config file > default.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

import msgspec

__all__ = ["BACKEND", "ENV", "FLAGS", "Options", "OptionsError"]

#: the value of ``--disagg-transfer-backend`` that selects this adapter
BACKEND = "mooncake-diffusion"
#: the environment variable that carries resolved options into spawned workers
ENV = "MOONCAKE_DIFFUSION_SGLANG"


class OptionsError(ValueError):
    """An adapter flag or config file entry is invalid; the message names it."""


class Options(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Resolved adapter settings (the keys of ``--mooncake-diffusion-config``).

    protocol   Transfer Engine protocol: ``tcp``, ``rdma``, or ``auto`` (``rdma``
               when ``--disagg-ib-device`` is given, else ``tcp``).
    same_host  ``auto``: write directly into the peer's memory when both ends share
               a host (memcpy into a shared pool, or process_vm_writev); ``off``:
               always the Transfer Engine.
    pool       where sglang's staging pool lives: ``host`` (a shared memfd, pinned
               with cudaHostRegister when CUDA is present), ``device`` (GPU memory,
               GPUDirect RDMA), or ``auto`` (``device`` when CUDA and a CUDA build
               of Mooncake are present, else ``host``).
    retries    attempts per network write (at least 1).
    timeout_s  deadline of one write, retries included.
    """

    protocol: Literal["auto", "tcp", "rdma"] = "auto"
    same_host: Literal["auto", "off"] = "auto"
    pool: Literal["auto", "host", "device"] = "auto"
    retries: int = 3
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.retries < 1:
            raise OptionsError(f"retries must be at least 1, got {self.retries}")
        if self.timeout_s <= 0:
            raise OptionsError(f"timeout_s must be positive, got {self.timeout_s}")

    @classmethod
    def from_mapping(cls, values: dict[str, Any], where: str) -> Options:
        """Validate ``values`` (unknown keys and bad values raise ``OptionsError``).

        YAML reads a bare ``off``/``on`` as a boolean: ``same_host: off`` means "off".
        """
        if isinstance(values.get("same_host"), bool):
            values = {**values, "same_host": "auto" if values["same_host"] else "off"}
        try:
            return msgspec.convert(values, cls, strict=False)
        except msgspec.ValidationError as e:
            known = ", ".join(cls.__struct_fields__)
            raise OptionsError(f"{where}: {e} (known keys: {known})") from None

    @classmethod
    def load(cls, path: str) -> dict[str, Any]:
        """The mapping in a YAML or JSON config file; raises ``OptionsError``."""
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise OptionsError(f"--mooncake-diffusion-config {path!r}: {e.strerror}") from None
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise OptionsError(f"--mooncake-diffusion-config {path!r}: expected a mapping")
        return data

    @classmethod
    def from_cli(cls, namespace: Any) -> Options:
        """Options from a parsed ``sglang serve`` namespace (flags over the file)."""
        values: dict[str, Any] = {}
        path = getattr(namespace, "mooncake_diffusion_config", None)
        if path:
            values.update(cls.load(path))
        for name, _flag in FLAGS.items():
            given = getattr(namespace, f"mooncake_diffusion_{name}", None)
            if given is not None:
                values[name] = given
        return cls.from_mapping(
            values, f"--mooncake-diffusion-config {path!r}" if path else "flags"
        )

    def export(self) -> None:
        """Put these options where spawned workers find them (``ENV``)."""
        os.environ[ENV] = msgspec.json.encode(self).decode()

    @classmethod
    def from_env(cls) -> Options:
        """Options exported by the serve process, or the defaults."""
        raw = os.environ.get(ENV)
        if not raw:
            return cls()
        try:
            return msgspec.json.decode(raw, type=cls)
        except msgspec.ValidationError as e:
            raise OptionsError(f"${ENV}: {e}") from None


#: option name -> (flag, argparse keywords); every flag defaults to None ("not given")
FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "protocol": (
        "--mooncake-diffusion-protocol",
        {"choices": ["auto", "tcp", "rdma"], "help": "Transfer Engine protocol (default auto)."},
    ),
    "same_host": (
        "--mooncake-diffusion-same-host",
        {
            "choices": ["auto", "off"],
            "help": "Direct memory writes between processes of one host (default auto).",
        },
    ),
    "pool": (
        "--mooncake-diffusion-pool",
        {
            "choices": ["auto", "host", "device"],
            "help": "Where the staging pool lives: shared host memory or GPU (default auto).",
        },
    ),
    "retries": (
        "--mooncake-diffusion-retries",
        {"type": int, "help": "Attempts per network write (default 3)."},
    ),
    "timeout_s": (
        "--mooncake-diffusion-timeout",
        {"type": float, "help": "Deadline of one write in seconds, retries included (30)."},
    ),
}
