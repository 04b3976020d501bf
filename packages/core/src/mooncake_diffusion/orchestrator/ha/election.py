"""Orchestrator leader election on etcd: a lease, a fenced leader, a journal it
alone can append to.

    with Candidate(EtcdClient(endpoints), "/mcd/orch", "host-a", ttl_s=2) as me:
        me.campaign(timeout=30)           # blocks until this candidate leads
        me.append([b"event1", b"event2"]) # one txn; False once deposed: stop acting
        me.renew()                        # call every ttl/3; False: stop acting

The recipe (etcd's, as Kubernetes controllers use it): a lease of ``ttl_s``; to
lead, one transaction puts ``<prefix>/leader`` bound to the lease if and only if
the key does not exist (``create_revision == 0``). The key's create revision is
the **fencing token** (the term): unique per term and increasing. Every journal
append is one transaction guarded by ``create_revision(leader) == token``, so a
leader that lost its lease (its key expired, another took it) cannot append
anything: its write fails and it must stop acting. The journal entries live
under ``<prefix>/journal/<revision-ordered key>``; a standby reads them
(``entries``) to follow. etcd 3.4 rounds a TTL below its election timeout up to
2 s, so a crashed leader is replaced within about ``ttl_s`` plus one poll.

The service runs on it in ``ha/service.py`` (``mooncake-diffusion orchestrator
--etcd``): the leader announces its addresses in the leader key's value
(``announce``), workers and clients read them there (``link/follow.py``).
"""

from __future__ import annotations

import base64
import contextlib
import time
from collections.abc import Sequence

from mooncake_diffusion.platform.etcd import EtcdClient, EtcdUnavailableError, prefix_end

__all__ = ["Candidate"]


def _b64(raw: str | bytes) -> str:
    return base64.b64encode(raw.encode() if isinstance(raw, str) else raw).decode()


class Candidate:
    """One orchestrator process's side of the election on ``prefix``."""

    def __init__(self, etcd: EtcdClient, prefix: str, name: str, *, ttl_s: int = 2) -> None:
        self.etcd = etcd
        self.name = name
        self.ttl_s = ttl_s
        self.leader_key = f"{prefix}/leader"
        self.journal_prefix = f"{prefix}/journal/"
        self.lease_id: str | None = None
        #: the fencing token (the leader key's create revision) while leading, else 0
        self.token = 0
        self._seq = 0

    def _grant(self) -> str:
        out = self.etcd.call("lease/grant", {"TTL": self.ttl_s})
        return str(out["ID"])

    def campaign(self, timeout: float, poll_s: float = 0.1) -> int:
        """Block until this candidate leads; returns its fencing token. Raises
        ``TimeoutError`` after ``timeout`` (another leader kept its lease)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.lease_id is None:
                    self.lease_id = self._grant()
                if self._try_lead():
                    return self.token
                self.renew_lease()
            except EtcdUnavailableError:
                pass  # quorum lost for a while: keep trying to the deadline
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not become leader within {timeout:.0f}s")
            time.sleep(poll_s)

    def _try_lead(self) -> bool:
        key = _b64(self.leader_key)
        out = self.etcd.call(
            "kv/txn",
            {
                "compare": [
                    {"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
                ],
                "success": [
                    {"request_put": {"key": key, "value": _b64(self.name), "lease": self.lease_id}}
                ],
            },
        )
        if not out.get("succeeded"):
            return False
        header = out.get("header") or {}
        assert isinstance(header, dict)
        self.token = int(header["revision"])
        return True

    def renew_lease(self) -> bool:
        """One lease keep-alive; ``False`` when the lease is gone (expired)."""
        if self.lease_id is None:
            return False
        out = self.etcd.call("lease/keepalive", {"ID": self.lease_id})
        result = out.get("result") or {}
        assert isinstance(result, dict)
        if int(result.get("TTL", 0)) <= 0:
            self.lease_id = None
            return False
        return True

    def renew(self) -> bool:
        """Keep leading: refresh the lease and check the key is still ours. ``False``
        (and ``token`` 0) once deposed or unreachable: the caller stops acting."""
        try:
            if self.token and self.renew_lease() and self.leads():
                return True
        except EtcdUnavailableError:
            pass
        self.token = 0
        return False

    def leads(self) -> bool:
        """Whether the leader key exists with this term's create revision."""
        kvs = self.etcd.call("kv/range", {"key": _b64(self.leader_key)}).get("kvs") or []
        assert isinstance(kvs, list)
        return bool(kvs) and int(kvs[0].get("create_revision", 0)) == self.token

    def _guard(self) -> dict[str, str]:
        """The transaction condition: the leader key has this term's create revision."""
        return {
            "key": _b64(self.leader_key),
            "target": "CREATE",
            "result": "EQUAL",
            "create_revision": str(self.token),
        }

    def append(self, events: Sequence[bytes]) -> bool:
        """Commit ``events`` to the journal in one transaction, only while this term
        holds the leader key. ``True``: committed (in order, after every earlier
        entry). ``False``: deposed, nothing written, act on none of them."""
        if not self.token:
            return False
        puts = []
        for ev in events:
            self._seq += 1
            key = f"{self.journal_prefix}{self.token:020d}-{self._seq:012d}"
            puts.append({"request_put": {"key": _b64(key), "value": _b64(ev)}})
        try:
            out = self.etcd.call("kv/txn", {"compare": [self._guard()], "success": puts})
        except EtcdUnavailableError:
            return False  # unknown: treated as not committed; the caller must not act
        if not out.get("succeeded"):
            self.token = 0
            return False
        return True

    def next_key(self) -> str:
        """A journal key of this term after every earlier one (for ``put_entry``)."""
        self._seq += 1
        return f"{self.journal_prefix}{self.token:020d}-{self._seq:012d}"

    def put_entry(self, key: str, value: bytes) -> bool:
        """Write one journal entry at ``key`` (from ``next_key``) in one transaction,
        only while this term holds the leader key and only if ``key`` is absent, so a
        retry after an unknown outcome never writes it twice. ``True``: the entry is
        there (now, or from an earlier try). ``False``: deposed, nothing written.
        Raises ``EtcdUnavailableError`` (outcome unknown: retry with the same key)."""
        if not self.token:
            return False
        k = _b64(key)
        absent = {"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        out = self.etcd.call(
            "kv/txn",
            {
                "compare": [self._guard(), absent],
                "success": [{"request_put": {"key": k, "value": _b64(value)}}],
                "failure": [{"request_range": {"key": k}}],
            },
        )
        if out.get("succeeded"):
            return True
        responses = out.get("responses") or [{}]
        assert isinstance(responses, list)
        found = (responses[0].get("response_range") or {}).get("kvs")
        if found:  # an earlier try of this key went through (only this term writes it)
            return True
        self.token = 0
        return False

    def announce(self, value: bytes) -> bool:
        """Set the leader key's value (where this leader serves), keeping its lease and
        create revision (the token). ``False``: deposed or unreachable."""
        if not self.token or self.lease_id is None:
            return False
        key, lease = _b64(self.leader_key), self.lease_id
        put = {"request_put": {"key": key, "value": _b64(value), "lease": lease}}
        try:
            out = self.etcd.call("kv/txn", {"compare": [self._guard()], "success": [put]})
        except EtcdUnavailableError:
            return False
        return bool(out.get("succeeded"))

    def entries(self) -> list[bytes]:
        """Every journal entry, in commit order (what a standby replays)."""
        prefix = self.journal_prefix
        body = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        kvs = self.etcd.call("kv/range", body).get("kvs") or []
        assert isinstance(kvs, list)
        return [base64.b64decode(kv.get("value", "")) for kv in kvs]

    def resign(self) -> None:
        """Give the lease back (the key goes with it): a clean hand-over, no wait."""
        lease, self.lease_id, self.token = self.lease_id, None, 0
        if lease is not None:
            with contextlib.suppress(EtcdUnavailableError):  # else it lapses within ttl_s
                self.etcd.call("lease/revoke", {"ID": lease})

    def __enter__(self) -> Candidate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.resign()
