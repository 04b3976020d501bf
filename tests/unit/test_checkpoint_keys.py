"""Step-checkpoint key recipe: pure logic, no Mooncake.

The vectors were computed outside Python (``printf '%s' TEXT | sha256sum``) from
the canonical text written here, so they pin the recipe, not this code.
"""

import hashlib
import subprocess
import sys

import pytest

from mooncake_diffusion.caches import CacheKeyError, checkpoint_job
from mooncake_diffusion.caches.checkpoint import CKPT_ROOT, checkpoint_namespace

pytestmark = pytest.mark.unit

MODEL, SAMPLER = "mcd-reference@0", "flow-euler-v1"
NS = "ed5f1260d761433d"
ENTRY = "70beaa63ca120a6f37b23a3210100adc12b9609fef496ece1aeb62b1df0e8d80"


def job(**kw):
    args = dict(cond_key="c0", seed=7, guidance=4.5, steps=12, shape=[1, 4, 3, 8, 8])
    return checkpoint_job(MODEL, SAMPLER, **{**args, **kw})


def test_import_loads_neither_mooncake_nor_torch():
    code = (
        "import sys, mooncake_diffusion.caches.checkpoint; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mooncake', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_vector():
    text = (
        '{"cond":"c0","guidance":4.5,"model":"mcd-reference@0","sampler":"flow-euler-v1",'
        '"seed":"7","shape":[1,4,3,8,8],"step":4,"steps":12}'
    )
    assert hashlib.sha256(text.encode()).hexdigest() == ENTRY
    j = job()
    assert checkpoint_namespace(MODEL) == CKPT_ROOT + NS + "/"
    assert j.prefix == f"{CKPT_ROOT}{NS}/99f0618665266603055c4c1e12ef699c/"
    assert j.key(4) == j.prefix + ENTRY


def test_vector_64_bit_seed_and_integral_guidance():
    j = checkpoint_job(
        MODEL, SAMPLER, cond_key="c0", seed=2**64 - 1, guidance=4.0, steps=1, shape=(1, 4, 1, 8, 8)
    )
    assert j.prefix.endswith("/f4e64fe3eee628fc0291454d029dff7c/")
    assert j.key(0).endswith("/dda5b5050f9090fedec2ec78baf085b138dddeb07c1f89d178ba7881f82aef3b")


def test_every_field_changes_the_key():
    base = job().key(4)
    others = {
        job(cond_key="c1").key(4),
        job(seed=8).key(4),
        job(guidance=4.0).key(4),
        job(steps=13).key(4),
        job(shape=[1, 4, 3, 8, 16]).key(4),
        job().key(5),
        checkpoint_job(
            "mcd-reference@1",
            SAMPLER,
            cond_key="c0",
            seed=7,
            guidance=4.5,
            steps=12,
            shape=[1, 4, 3, 8, 8],
        ).key(4),
        checkpoint_job(
            MODEL,
            "flow-euler-v2",
            cond_key="c0",
            seed=7,
            guidance=4.5,
            steps=12,
            shape=[1, 4, 3, 8, 8],
        ).key(4),
    }
    assert base not in others and len(others) == 8
    # one job's steps share its prefix; another job's do not
    assert all(job().key(s).startswith(job().prefix) for s in range(13))
    assert not job(seed=8).key(4).startswith(job().prefix)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"cond_key": ""}, "cond_key"),
        ({"seed": -1}, "seed"),
        ({"seed": True}, "seed"),
        ({"steps": 0}, "steps"),
        ({"guidance": float("nan")}, "finite"),
        ({"guidance": "4"}, "guidance"),
        ({"shape": [1, -4]}, "shape"),
        ({"shape": "1x4"}, "shape"),
    ],
)
def test_bad_fields_raise(kw, match):
    with pytest.raises(CacheKeyError, match=match):
        job(**kw).key(1)


def test_bad_step_and_ids_raise():
    with pytest.raises(CacheKeyError, match="beyond"):
        job().key(13)
    with pytest.raises(CacheKeyError, match="step"):
        job().key(-1)
    with pytest.raises(CacheKeyError, match="model_id"):
        checkpoint_job("", SAMPLER, cond_key="c", seed=0, guidance=1.0, steps=1, shape=[1])
    with pytest.raises(CacheKeyError, match="sampler"):
        checkpoint_job(MODEL, "x" * 300, cond_key="c", seed=0, guidance=1.0, steps=1, shape=[1])
