"""Mooncake's listeners on the configured host: an ``LD_PRELOAD`` shim for ``bind()``.

Mooncake 0.3.13's Transfer Engine binds its handshake and TCP data listeners to
the any-address (``0.0.0.0`` and ``::``), with no setting to change it
(``MC_TCP_BIND_ADDRESS`` only changes the address it announces). ``bindshim.c``,
beside this file, rewrites such binds of stream sockets to ``MCD_BIND_HOST``
(the process's ``local_hostname``, the address peers reach it at; see the C
file for the exact rule). It is compiled once per user with the system C
compiler (``$CC``, else ``cc``, ``gcc``, ``clang``) into
``$XDG_CACHE_HOME/mooncake-diffusion`` (default ``~/.cache``), named by a hash
of its source, and can only work when loaded at exec time:

    env = bindshim.env(settings.local_hostname)    # {} without a compiler
    subprocess.Popen(argv, env={**os.environ, **env})   # a child that runs a TE
    bindshim.check(settings.local_hostname)        # in an entry point: warns if not

Who calls it: ``LocalCluster`` (the store host), the demo's workers and
``childproc.JsonLinesChild`` (and the tests' stacks) start their children with
``env``; the ``worker`` command and the store host's ``main`` call ``check``, so
one started by hand says how to start it under the shim. (A worker re-executing
itself under the shim was tried: so re-executed, it never recycled its store
client once its store host was replaced, the recycle stalled; the cause was not
found, so the processes are started under it instead.) Without a compiler, or with
``MCD_BIND_SHIM=0``, nothing is preloaded and one warning per process says that
the Transfer Engine listens on every interface and what to do.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import logging
import os
import platform
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

__all__ = ["HOST_ENV", "OFF_ENV", "check", "env", "library"]

HOST_ENV = "MCD_BIND_HOST"
OFF_ENV = "MCD_BIND_SHIM"
_SOURCE = Path(__file__).with_name("bindshim.c")
log = logging.getLogger("mooncake_diffusion.bindshim")
_EVERYWHERE = (
    "Mooncake's Transfer Engine listens on every interface of this host (ports "
    "15000-17000), not only on the configured host: %s; or firewall those ports"
)
_NO_CC = "install a C compiler (e.g. `apt-get install gcc`, or set CC) for the bind shim"


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(root) / "mooncake-diffusion"


@functools.cache
def library() -> Path | None:
    """The compiled shim (built on first use, then reused), or ``None`` with one
    warning when it cannot be built. Safe when several processes build it at once
    (each writes a file of its own and renames it into place)."""
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    path = _cache_dir() / f"bindshim-{digest}-{platform.machine()}.so"
    if path.exists():
        return path
    names = [os.environ.get("CC"), "cc", "gcc", "clang"]
    cc = next((found for n in names if n and (found := shutil.which(n))), None)
    if cc is None:
        log.warning(_EVERYWHERE, f"no C compiler found (tried $CC, cc, gcc, clang): {_NO_CC}")
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
        os.close(fd)
        try:
            argv = [cc, "-shared", "-fPIC", "-O2", "-o", tmp, str(_SOURCE), "-ldl"]
            subprocess.run(argv, check=True, capture_output=True, timeout=120)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except (OSError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", b"") or b""
        log.warning(_EVERYWHERE, f"building the bind shim with {cc} failed ({e} {err[-500:]!r})")
        return None
    return path


def _literal(host: str) -> str | None:
    """``host`` as an IP literal (a name resolved to its first IPv4 address), or None."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except OSError:
        return None


def env(host: str) -> dict[str, str]:
    """The environment that makes a child's any-address binds go to ``host``:
    ``LD_PRELOAD`` (this process's, plus the shim) and ``MCD_BIND_HOST``; ``{}`` when
    the shim is off (``MCD_BIND_SHIM=0``), cannot be built, or ``host`` does not
    resolve (each said once in a warning)."""
    if os.environ.get(OFF_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        _warn_once(f"{OFF_ENV}=0 turns the bind shim off")
        return {}
    lib = library()
    ip = _literal(host)
    if lib is None:
        return {}
    if ip is None:
        _warn_once(f"the configured host {host!r} does not resolve to an address")
        return {}
    preload = [p for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split() if p]
    if str(lib) not in preload:
        preload.append(str(lib))
    return {"LD_PRELOAD": " ".join(preload), HOST_ENV: ip}


@functools.cache
def _warn_once(why: str) -> None:
    log.warning(_EVERYWHERE, why)


def _loaded(lib: str) -> bool:
    try:
        return lib in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def check(host: str) -> bool:
    """Whether this process runs under the shim for ``host``; if not (and the shim
    could be had), one warning says how to start it so. For entry points (the
    ``worker`` command, the store host) that someone else may have started."""
    extra = env(host)
    if not extra:
        return False
    if _loaded(str(library())) and os.environ.get(HOST_ENV) == extra[HOST_ENV]:
        return True
    how = " ".join(f"{k}={v!r}" for k, v in extra.items())
    _warn_once(f"this process was not started under the bind shim: start it with {how}")
    return False
