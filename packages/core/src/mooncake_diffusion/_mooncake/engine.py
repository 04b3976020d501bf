"""A Transfer Engine in P2PHANDSHAKE mode (no metadata service) with typed errors.

Peers find each other by segment name ``ip:rpc_port``, which travels in handles.
Transfers block the calling thread and release the GIL inside Mooncake;
``write`` submits asynchronously and polls (paced by ``Pacer`` from the rate
of recent writes), so with a deadline a peer that stops reading cannot hold the
caller past it. Polling rather than ``transfer_sync_write``'s busy wait also
leaves the CPU to Mooncake's own threads (``docs/performance.md``); only small
writes without a deadline stay synchronous. ``read_many`` reads from peers the
same way (a store client's direct reads from a store host's segment).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from mooncake_diffusion._mooncake import gil, import_mooncake
from mooncake_diffusion.errors import (
    ConfigError,
    DeadlineExceededError,
    MooncakeError,
    TransferError,
)
from mooncake_diffusion.memory.registration import Registrations
from mooncake_diffusion.platform.settings import MooncakeSettings

__all__ = ["Engine", "Pacer", "Read"]

#: one read: (peer segment, local dst addresses, peer src addresses, lengths)
Read = tuple[str, Sequence[int], Sequence[int], Sequence[int]]

# polling of an asynchronous write: first pause, longest pause (seconds)
_POLL_MIN_S = 50e-6
_POLL_MAX_S = 5e-4
# a batch id is the address of Mooncake's batch record; transfer_submit_write
# answers a failure with 0 (peer not reachable) or -1 as an unsigned 64-bit id
_BAD_BATCH = 1 << 63


class Pacer:
    """When to check a polled transfer: from how fast recent large ones went.

    Without a rate (no large write yet, or a small one) the pauses start at
    ``_POLL_MIN_S`` and double up to ``_POLL_MAX_S``. For a write of at least
    ``LEARN_BYTES`` with a known rate, the first pause is ``SHARE`` of the time the
    rate predicts (one wake-up instead of a dozen), and the later ones double from
    ``_POLL_MIN_S`` up to a sixteenth of that prediction, so the write is seen done
    within a few percent of its time instead of up to ``_POLL_MAX_S`` late. The rate
    follows a faster write at once and a slower one by ``SLOWER_WEIGHT``, so one
    stalled write does not make the next ones sleep past their end. Not thread-safe
    beyond what a float assignment is: a lost update only costs a worse guess.
    """

    LEARN_BYTES = 1 << 20
    SHARE = 0.7
    SLOWER_WEIGHT = 0.2

    def __init__(self) -> None:
        self.s_per_byte = 0.0  # 0: not known yet

    def predict(self, nbytes: int) -> float:
        """Seconds a write of ``nbytes`` should take; 0.0 when there is no guess."""
        return nbytes * self.s_per_byte if nbytes >= self.LEARN_BYTES else 0.0

    def pauses(self, nbytes: int) -> Iterator[float]:
        """The pauses between checks of one write (endless; the caller stops)."""
        expect = self.predict(nbytes)
        cap = _POLL_MAX_S
        if expect:
            yield self.SHARE * expect
            cap = min(cap, max(_POLL_MIN_S, expect / 16))
        pause = _POLL_MIN_S
        while True:
            yield pause
            pause = min(pause * 2, cap)

    def learn(self, nbytes: int, seconds: float) -> None:
        """Record a completed write of ``nbytes`` that took ``seconds``."""
        if nbytes < self.LEARN_BYTES or seconds <= 0:
            return
        rate = seconds / nbytes
        if not self.s_per_byte or rate < self.s_per_byte:
            self.s_per_byte = rate
        else:
            self.s_per_byte += self.SLOWER_WEIGHT * (rate - self.s_per_byte)


class Engine:
    """One Transfer Engine per process role; ``close()`` when done (about 1 s)."""

    #: writes without a deadline of at least this many bytes are polled, not synchronous
    SYNC_BELOW = 256 << 10

    def __init__(self, settings: MooncakeSettings) -> None:
        mod = import_mooncake("engine")
        self._te = mod.TransferEngine()
        rc = self._te.initialize(
            settings.local_hostname, "P2PHANDSHAKE", settings.protocol, settings.device
        )
        if rc != 0:
            raise ConfigError(
                f"Transfer Engine failed to start on {settings.local_hostname} "
                f"(protocol {settings.protocol!r}, device {settings.device!r}): {rc}"
            )
        self.segment = f"{settings.local_hostname}:{self._te.get_rpc_port()}"
        self.regs = Registrations(self.register_extent, self.unregister_extent)
        self.pacer = Pacer()

    def register_extent(self, ptr: int, nbytes: int, device: str) -> None:
        """Register memory directly (``regs`` is the refcounted way; this is for an
        owner that keeps its own account, such as a store client's reader)."""
        location = "*" if device == "cpu" else device
        rc = self._te.register_memory(ptr, nbytes, location)
        if rc != 0:
            raise MooncakeError(f"Transfer Engine register_memory of {nbytes} bytes: {rc}", rc)

    def unregister_extent(self, ptr: int) -> None:
        rc = self._te.unregister_memory(ptr)
        if rc != 0:
            raise MooncakeError(f"Transfer Engine unregister_memory: {rc}", rc)

    def write(
        self,
        peer: str,
        src: Sequence[int],
        dst: Sequence[int],
        lengths: Sequence[int],
        deadline: float | None = None,
    ) -> None:
        """Write local registered ``src[i]`` into ``peer``'s registered ``dst[i]``.

        Every range is submitted with ``transfer_submit_write`` and polled (paced
        by ``pacer``) until each one ended; if one failed, ``TransferError``
        (Mooncake's own transfer timeout is a failure too), raised only once no
        range is in flight. With ``deadline`` (a ``time.monotonic()`` instant) the
        polling also stops there (``DeadlineExceededError`` while a range is still
        in flight, whatever else failed). Mooncake cannot cancel a submitted transfer:
        after a deadline error it may still read ``src`` and write ``dst`` later,
        so the caller keeps ``src`` registered and unchanged and treats ``dst``
        as lost until the engine is closed.

        Without a deadline, writes of less than ``SYNC_BELOW`` bytes in all go
        through ``transfer_sync_write`` (one range) or ``batch_transfer_sync_write``
        instead: no batch bookkeeping, cheaper for small writes. Mooncake's
        synchronous calls busy-wait in the calling thread for the whole transfer,
        which on a small host takes a core from Mooncake's own TCP threads
        (``docs/performance.md``), so larger writes are polled either way.
        """
        if not src:
            return
        if deadline is not None or sum(lengths) >= self.SYNC_BELOW:
            self._write_polled(peer, src, dst, lengths, deadline)
            return
        if len(src) == 1:
            rc = self._te.transfer_sync_write(peer, src[0], dst[0], lengths[0])
        else:
            rc = self._te.batch_transfer_sync_write(peer, list(src), list(dst), list(lengths))
        if rc != 0:
            raise self._failed(peer, lengths, rc)

    def _write_polled(
        self,
        peer: str,
        src: Sequence[int],
        dst: Sequence[int],
        lengths: Sequence[int],
        deadline: float | None,
    ) -> None:
        start = time.monotonic()
        batches = []
        for s, d, n in zip(src, dst, lengths, strict=True):
            batch = self._te.transfer_submit_write(peer, s, d, n)
            if not 0 < batch < _BAD_BATCH:  # never poll these: Mooncake crashes on them
                # the ranges submitted before still read ``src`` and write ``dst``: let
                # them end first (up to ``deadline``: past it, the contract above)
                ends = self._settle(batches, sum(lengths[: len(batches)]), start, deadline)
                self._in_flight(peer, lengths, ends)
                raise self._failed(peer, lengths, -1)
            batches.append(batch)
        ends = self._settle(batches, sum(lengths), start, deadline)
        self._in_flight(peer, lengths, ends)
        if min(ends) < 0:
            raise self._failed(peer, lengths, min(ends))

    @staticmethod
    def _in_flight(peer: str, lengths: Sequence[int], ends: list[int]) -> None:
        """``DeadlineExceededError`` if a range is still in flight (only with a
        deadline): a failure beside it is not the caller's to act on, since the
        range may still read ``src`` and write ``dst`` (the contract of ``write``)."""
        if 0 in ends:
            raise DeadlineExceededError(
                f"write of {sum(lengths)} bytes to {peer}: {ends.count(0)} of "
                f"{len(lengths)} range(s) still in flight at the deadline "
                "(the peer stopped reading, or the link is too slow)"
            )

    def read_many(self, reads: Sequence[Read]) -> list[int]:
        """Run every read at once and return each one's outcome: 0 when it landed,
        else Mooncake's negative code (-1 failed or could not be submitted, -2
        Mooncake's own transfer timeout).

        A read is ``(peer, dst, src, lengths)``: ``peer``'s registered ``src[i]``
        into local registered ``dst[i]``. Each range is a batch of its own
        (``transfer_check_status`` looks at a batch's first range only). All are
        polled (paced by ``pacer``) until each ended: this never returns while one
        is in flight (Mooncake cannot cancel), so every ``dst`` is the caller's
        again."""
        start = time.monotonic()
        batches: list[int] = []
        owner: list[int] = []  # the read of each batch
        ends = [0] * len(reads)
        total = 0  # bytes in flight, what the pacer paces
        for r, (peer, dst, src, lengths) in enumerate(reads):
            for d, s, n in zip(dst, src, lengths, strict=True):
                batch = self._te.batch_transfer_async_read(peer, [d], [s], [n])
                if not 0 < batch < _BAD_BATCH:  # never poll these: Mooncake crashes
                    ends[r] = -1
                    continue
                batches.append(batch)
                owner.append(r)
                total += n
        for r, end in zip(owner, self._settle(batches, total, start, None), strict=True):
            ends[r] = min(ends[r], end, 0)
        return ends

    def _settle(
        self, batches: list[int], total: int, start: float, deadline: float | None
    ) -> list[int]:
        """Poll ``batches`` (submitted at ``start``, ``total`` bytes) until each ended,
        pausing as ``pacer`` says, and return each one's status: 1 done, negative
        failed. With ``deadline`` it returns there, with 0 for those still in flight
        (a failure does not end the wait: the others may still read and write).
        ``pacer`` learns from a clean finish."""
        ends = [0] * len(batches)
        pending = list(range(len(batches)))
        pauses = self.pacer.pauses(total)
        while pending:
            still = []
            for i in pending:
                rc = self._te.transfer_check_status(batches[i])
                if rc == 0:
                    still.append(i)
                else:  # 1 done; -1 failed, -2 Mooncake's own transfer timeout
                    ends[i] = rc
            pending = still
            now = time.monotonic()
            if not pending:
                if min(ends, default=1) > 0:
                    self.pacer.learn(total, now - start)
                return ends
            if deadline is not None and now >= deadline:
                return ends
            pause = next(pauses)
            time.sleep(pause if deadline is None else min(pause, deadline - now))
        return ends

    @staticmethod
    def _failed(peer: str, lengths: Sequence[int], rc: int) -> TransferError:
        return TransferError(
            f"Transfer Engine write of {sum(lengths)} bytes to {peer} failed ({rc}): "
            "peer unreachable or destination not registered there"
        )

    def close(self) -> None:
        """Unregister everything and destroy the engine (about a second inside Mooncake,
        the GIL held: see ``gil``). Idempotent."""
        if self._te is None:
            return
        self.regs.close()
        te, self._te = self._te, None
        with gil.holding("transfer engine close"):
            del te  # the last reference: Mooncake's destructor runs here
