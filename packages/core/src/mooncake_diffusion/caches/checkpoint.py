"""Step-checkpoint cache: a denoise job's latent and sampler state every k steps.

Any denoise worker of the cluster can resume a job from its newest checkpoint
(after its first worker was killed, or when it was preempted at a step
boundary), because the key is a pure function of what determines the
trajectory, never of the worker.

Call sequence (a denoise worker; every call blocks, none starts a thread):

    ckpt = CheckpointCache(settings, model_id="wan2.1-t2v-14b@rev3",
                           sampler="flow-euler-v1", every=4)          # connects
    job = ckpt.job(cond_key=k, seed=7, guidance=5.0, steps=50, shape=latent.shape)
    found = ckpt.latest(job)              # None, or (step, {"latent": ..., ...})
    ...                                   # resume from found, or start at step 0
    if ckpt.due(job, step):               # after each step: step % every == 0
        ckpt.save(job, step, state_tensors)   # best effort; drops the older one (keep=1)
    ...                                   # publish the final latent, then
    ckpt.finish(job)                      # remove every checkpoint of the job
    ckpt.close()

Key recipe, version 1 (``C`` is the canonical JSON of ``keys.py``; ``M`` model
id with its revision and ``A`` the sampler name with its version, both
non-empty strings of at most 256 characters; ``K`` the condition key, a
non-empty string of at most 256 characters that names the conditioning inputs,
e.g. a hash of the prompt's and negative prompt's embedding keys; ``S`` the
seed, an integer >= 0 written as a decimal *string* so 64-bit seeds stay exact;
``G`` the guidance scale, a number; ``N`` the total steps, an integer >= 1;
``X`` the latent shape, an array of integers >= 0; ``I`` the step index, the
number of steps done, 0 <= I <= N)::

    ns    = lowercase_hex(sha256(C({"model": M})))[:16]
    job   = lowercase_hex(sha256(C({"cond": K, "guidance": G, "model": M, "sampler": A,
                                    "seed": S, "shape": X, "steps": N})))[:32]
    entry = lowercase_hex(sha256(C({"cond": K, "guidance": G, "model": M, "sampler": A,
                                    "seed": S, "shape": X, "step": I, "steps": N})))
    key   = "mcd-cache/ckpt/v1/" + ns + "/" + job + "/" + entry

The entry hash covers every field; ``job`` groups one job's checkpoints so
``finish`` removes them with one prefix, and ``ns`` one model's (``clear``). An
entry is two Store objects, ``key + "/data"`` then ``key + "/meta"``
(``entry.py``), the metadata naming kind ``"ckpt"``, the model id and the
sampler. Test vector (pinned in ``tests/unit/test_checkpoint_keys.py``): model
``"mcd-reference@0"``, sampler ``"flow-euler-v1"``, cond ``"c0"``, seed 7,
guidance 4.5, steps 12, shape [1, 4, 3, 8, 8], step 4 hash the UTF-8 bytes of
``{"cond":"c0","guidance":4.5,"model":"mcd-reference@0","sampler":"flow-euler-v1","seed":"7","shape":[1,4,3,8,8],"step":4,"steps":12}``.

Lifecycle. Entries are soft-pinned (evicted last, but evictable): a checkpoint
that is gone costs recomputation from an older one or from step 0, never a
different result. ``save`` keeps the newest ``keep`` checkpoints of a job and
removes the one before; ``finish`` removes the rest once the job's output is
safe (published), so a finished job leaves no key behind. A worker that may
still write after ``finish`` (a zombie) must be fenced by its caller.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_diffusion._mooncake.store import StoreClient
from mooncake_diffusion.caches.base import StoreCache
from mooncake_diffusion.caches.entry import Owner, named_tensors
from mooncake_diffusion.caches.errors import CacheKeyError
from mooncake_diffusion.caches.keys import MAX_ID, canonical_json
from mooncake_diffusion.platform.settings import MooncakeSettings

__all__ = [
    "CKPT_ROOT",
    "CheckpointCache",
    "CheckpointJob",
    "checkpoint_job",
    "checkpoint_namespace",
]

CKPT_ROOT = "mcd-cache/ckpt/v1/"


def _sha256(value: Any) -> str:
    return hashlib.sha256(canonical_json(value, what="checkpoint key").encode("utf-8")).hexdigest()


def _ident(value: object, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID:
        raise CacheKeyError(f"{what} must be a non-empty string of at most {MAX_ID} characters")
    return value


def _int(value: object, what: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise CacheKeyError(f"{what} must be an integer >= {low}, got {value!r}")
    return value


def checkpoint_namespace(model_id: str) -> str:
    """The key prefix of every checkpoint of one model."""
    return CKPT_ROOT + _sha256({"model": _ident(model_id, "model_id")})[:16] + "/"


@dataclass(frozen=True)
class CheckpointJob:
    """One denoise trajectory: the fields of the key recipe except the step index.

    Build it with ``checkpoint_job`` (or ``CheckpointCache.job``), which validates.
    ``prefix`` is the common prefix of its checkpoints' keys.
    """

    model_id: str
    sampler: str
    cond_key: str
    seed: int
    guidance: float
    steps: int
    shape: tuple[int, ...]
    prefix: str

    def fields(self) -> dict[str, Any]:
        """The recipe's object without ``step``."""
        return {
            "cond": self.cond_key,
            "guidance": self.guidance,
            "model": self.model_id,
            "sampler": self.sampler,
            "seed": str(self.seed),
            "shape": list(self.shape),
            "steps": self.steps,
        }

    def key(self, step: int) -> str:
        """The entry key of the checkpoint after ``step`` steps (0 <= step <= steps)."""
        _int(step, "step", 0)
        if step > self.steps:
            raise CacheKeyError(f"step {step} is beyond the job's {self.steps} steps")
        return self.prefix + _sha256({**self.fields(), "step": step})


def checkpoint_job(
    model_id: str,
    sampler: str,
    *,
    cond_key: str,
    seed: int,
    guidance: float,
    steps: int,
    shape: Sequence[int],
) -> CheckpointJob:
    """Validate the fields and build the job (pure, no I/O); ``CacheKeyError`` names
    the first bad field."""
    ns = checkpoint_namespace(model_id)
    _ident(sampler, "sampler")
    _ident(cond_key, "cond_key")
    _int(seed, "seed", 0)
    _int(steps, "steps", 1)
    if isinstance(guidance, bool) or not isinstance(guidance, int | float):
        raise CacheKeyError(f"guidance must be a Python int or float, got {guidance!r}")
    dims = tuple(shape) if isinstance(shape, Sequence) and not isinstance(shape, str) else None
    if dims is None or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims
    ):
        raise CacheKeyError(f"shape must be a sequence of integers >= 0, got {shape!r}")
    job = CheckpointJob(model_id, sampler, cond_key, seed, guidance, steps, dims, "")
    prefix = ns + _sha256(job.fields())[:32] + "/"
    return CheckpointJob(model_id, sampler, cond_key, seed, guidance, steps, dims, prefix)


class CheckpointCache(StoreCache):
    """Checkpoints of one model and sampler, shared through Mooncake Store.

    ``every``: a checkpoint is due after every ``every`` steps (never after the
    last step, which is the output, nor at step 0, which the seed recreates);
    every worker of a deployment must use the same value, as ``latest`` probes
    only due steps. ``keep``: how many of a job's newest checkpoints ``save``
    keeps (>= 1). See ``EmbeddingCache`` for ``device`` and ``client``.
    Thread-safe.
    """

    def __init__(
        self,
        settings: MooncakeSettings,
        *,
        model_id: str,
        sampler: str,
        every: int = 1,
        keep: int = 1,
        device: str = "cpu",
        client: StoreClient | None = None,
    ) -> None:
        namespace = checkpoint_namespace(model_id)  # validates model_id
        _ident(sampler, "sampler")
        self.every = _int(every, "every", 1)
        self.keep = _int(keep, "keep", 1)
        super().__init__(
            settings, Owner("ckpt", model_id, sampler), namespace, device=device, client=client
        )
        self.model_id = model_id
        self.sampler = sampler

    def job(
        self, *, cond_key: str, seed: int, guidance: float, steps: int, shape: Sequence[int]
    ) -> CheckpointJob:
        """``checkpoint_job`` for this cache's model and sampler. No I/O."""
        return checkpoint_job(
            self.model_id,
            self.sampler,
            cond_key=cond_key,
            seed=seed,
            guidance=guidance,
            steps=steps,
            shape=shape,
        )

    def _check(self, job: CheckpointJob) -> None:
        if (job.model_id, job.sampler) != (self.model_id, self.sampler):
            raise CacheKeyError(
                f"job of model {job.model_id!r} sampler {job.sampler!r} given to the cache of "
                f"model {self.model_id!r} sampler {self.sampler!r}"
            )

    def due(self, job: CheckpointJob, step: int) -> bool:
        """Whether a checkpoint is due after ``step`` steps of ``job``."""
        return 0 < step < job.steps and step % self.every == 0

    def due_steps(self, job: CheckpointJob) -> list[int]:
        """Every step a checkpoint may exist for, newest first (what ``latest`` probes)."""
        return [s for s in range(job.steps - 1, 0, -1) if s % self.every == 0]

    def save(self, job: CheckpointJob, step: int, tensors: Any) -> bool:
        """Store ``tensors`` (a contiguous tensor or a dict of them: the latent and
        whatever sampler state resumes it) as the checkpoint after ``step`` steps,
        then remove the checkpoint ``keep`` saves back. Returns whether it is stored.
        Never fails for the store's sake (a full store is a skipped save, counted in
        ``stats().errors``); raises on bad input (``CacheKeyError``, ``PayloadError``)."""
        self._check(job)
        key = job.key(step)
        stored = self._store(key, named_tensors(tensors), absorb=True, stale=None)
        older = step - self.keep * self.every
        if stored and older > 0:
            self._entries.remove(job.key(older))
        return stored

    def load(self, job: CheckpointJob, step: int, *, dst: Any = None) -> dict[str, Any] | None:
        """The checkpoint after ``step`` steps, or ``None`` (never saved, evicted,
        removed, being written, or the store unreachable)."""
        self._check(job)
        return self._lookup(job.key(step), dst, absorb=True)[1]

    def latest(self, job: CheckpointJob) -> tuple[int, dict[str, Any]] | None:
        """``(step, tensors)`` of the newest checkpoint of ``job`` that can be read, or
        ``None``. Probes the due steps newest first (one metadata read each, counted as
        a miss when absent); the tensors are in a new buffer the caller owns."""
        self._check(job)
        for step in self.due_steps(job):
            found = self._lookup(job.key(step), None, absorb=True)[1]
            if found is not None:
                return step, found
        return None

    def finish(self, job: CheckpointJob) -> int:
        """Remove every checkpoint of ``job`` (any step, written by any process); returns
        how many store objects went. Call once the job's output is published."""
        self._check(job)
        return self.client.remove_prefix(job.prefix)
