"""What the HTTP front admits, before any route runs: the names it answers to
(Host and Origin, against DNS rebinding and cross-site pages), the request ids
and params a caller may choose, and the cost of a generation per SLO class.

    cfg = FrontConfig(hosts=("api.example",), max_cost={"batch": 10**10})
    cfg.check_origin(headers)     -> None, or ApiError 403 / 421
    check_params(params)          -> ApiError 400 on a field that names a path
    check_request_id(rid)         -> ApiError 400 unless the workers' rule holds
    cfg.check_cost(params, cls)   -> ApiError 400 ``too_costly`` above the ceiling

Pure functions of their input (no I/O), used by ``api.py`` and ``openai.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from mooncake_diffusion.orchestrator.http.bodies import ApiError
from mooncake_diffusion.transfer.payload import request_id_problem

__all__ = [
    "DEFAULT_MAX_COST",
    "LOOPBACK_NAMES",
    "FrontConfig",
    "check_params",
    "check_request_id",
    "cost",
]

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
#: Ceilings of ``cost`` (pixels x frames x steps) per SLO class; "*" any other class.
#: 1024x1024 at 100 steps for an image; 129 such frames for a video.
DEFAULT_MAX_COST: Mapping[str, int] = {
    "interactive": 1024 * 1024 * 100,
    "batch": 1024 * 1024 * 129 * 100,
    "*": 1024 * 1024 * 100,
}
#: Request params that would choose a location on a worker: output locations are
#: the workers' configuration (``MCD_OUTPUTS``), never a request's.
PATH_PARAMS = frozenset({"out_dir", "output_dir", "out_path", "output_path", "path", "file"})
_SIZE_DEFAULTS = {"height": 64, "width": 64, "frames": 1, "steps": 12}


def _host_name(hostport: str) -> str:
    """``host`` of ``host[:port]`` / ``[v6][:port]``, lower case."""
    h = hostport.strip().lower()
    if h.startswith("["):
        return h[1 : h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


@dataclass(frozen=True)
class FrontConfig:
    """The front's admission settings.

    ``hosts``: the names clients reach the API by (the Host header must be one; an
    Origin header, which browsers send on cross-site and on POST requests, must name
    the same host and port as Host). Empty: the loopback names, plus the bound
    address when it is a specific one; a wildcard bind with no names checks nothing
    (it needs a token anyway). ``max_cost``: see ``DEFAULT_MAX_COST``.
    ``cancel_on_disconnect``: a client that hangs up while it waits for its images
    cancels them. ``models``: the ids ``/v1/models`` lists and the ``model`` field
    may name (absent: any is the default model)."""

    hosts: tuple[str, ...] = ()
    max_cost: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_MAX_COST))
    cancel_on_disconnect: bool = True
    models: tuple[str, ...] = ("mooncake-diffusion",)

    def allowed_hosts(self, bound: str) -> frozenset[str] | None:
        """The Host names answered for an API bound to ``bound``; None: any."""
        if self.hosts:
            return frozenset(_host_name(h) for h in self.hosts)
        if bound in ("0.0.0.0", "::", ""):
            return None
        return frozenset((*LOOPBACK_NAMES, _host_name(bound)))

    def check_origin(self, headers: Mapping[str, str], allowed: frozenset[str] | None) -> None:
        """403 for a cross-site Origin, 421 for a Host that is not one of ``allowed``."""
        host = headers.get("host", "")
        if allowed is not None and _host_name(host) not in allowed:
            raise ApiError(421, "bad_host", f"this server does not answer to Host {host!r}")
        origin = headers.get("origin")
        if origin is None:
            return
        parts = urlsplit(origin)
        if origin == "null" or parts.netloc.lower() != host.strip().lower():
            raise ApiError(403, "cross_origin", f"requests from origin {origin!r} are refused")

    def check_cost(self, params: Mapping[str, Any], slo_class: str | None) -> None:
        """400 ``too_costly`` when ``cost(params)`` is over the class's ceiling."""
        cls = slo_class or "interactive"
        limit = self.max_cost.get(cls, self.max_cost.get("*"))
        c = cost(params)
        if limit is not None and c is not None and c > limit:
            raise ApiError(
                400,
                "too_costly",
                f"height x width x frames x steps = {c:,} is over the {cls} class's "
                f"ceiling of {limit:,}; ask for fewer pixels, frames or steps",
                "params",
            )


def cost(params: Mapping[str, Any]) -> int | None:
    """pixels x frames x steps of reference-pipeline ``params`` (defaults for absent
    keys); None when a size is not an integer (the pipeline refuses those itself)."""
    out = 1
    for key, default in _SIZE_DEFAULTS.items():
        v = params.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool):
            return None
        out *= max(v, 0)
    return out


def check_params(params: Mapping[str, Any]) -> None:
    """400 when ``params`` carries a key that would choose a path on a worker."""
    for key in params:
        if key in PATH_PARAMS:
            raise ApiError(
                400,
                "forbidden_param",
                f"params.{key} is not accepted: output locations are the server's "
                "configuration (the decode workers' MCD_OUTPUTS), never a request's",
                f"params.{key}",
            )


def check_request_id(rid: str) -> None:
    """400 unless ``rid`` passes the rule every worker applies (``request_id_problem``)."""
    problem = request_id_problem(rid)
    if problem is not None:
        raise ApiError(400, "bad_request_id", problem, "request_id")
