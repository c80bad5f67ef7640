"""Tests of axlearn.common.sharding's batch and matmul helpers, on 8 fake CPU devices."""

import pytest

from axlearn.common.sharding import indivisible_dim, microbatch_count
from tests.fresh_python import assert_prints_ok

_SCRIPT = """
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from axlearn.common.sharding import (
    batch_axes, batch_shards, create_mesh, global_batch, global_batch_spec
)

assert len(jax.devices()) == 8
mesh = create_mesh((2, 4), ("data", "fsdp"))
names = ("data", "expert", "fsdp")  # The mesh has no 'expert' axis: it is ignored.
assert batch_axes(mesh, names) == ("data", "fsdp")
assert batch_shards(mesh, names) == 8
assert batch_shards(mesh, "fsdp") == 4 and batch_axes(mesh, None) == ()

rows = np.arange(16 * 3, dtype=np.int32).reshape(16, 3)
batch = global_batch({"ids": rows, "step": np.int32(7)}, mesh, names, path="trainer")
assert batch["ids"].sharding.spec == P(("data", "fsdp"), None), batch["ids"].sharding
np.testing.assert_array_equal(np.asarray(batch["ids"]), rows)
# Each device holds two consecutive rows, in the mesh's device order.
for i, device in enumerate(mesh.devices.flat):
    shard = [s for s in batch["ids"].addressable_shards if s.device == device][0]
    np.testing.assert_array_equal(np.asarray(shard.data), rows[2 * i : 2 * i + 2])
assert batch["step"].sharding.spec == P() and int(batch["step"]) == 7
# Without a batch: what global_batch gives one of those shapes and dtypes.
element_spec = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for k, v in
                {"ids": rows, "step": np.int32(7)}.items()}
for key, want in global_batch_spec(element_spec, mesh, names).items():
    got = batch[key]
    assert (want.shape, want.dtype) == (got.shape, got.dtype), key
    assert want.sharding == got.sharding, (key, want.sharding, got.sharding)

# Over the 'fsdp' axis alone the rows repeat over 'data'.
half = global_batch({"ids": rows[:4]}, mesh, "fsdp", path="trainer")
assert half["ids"].sharding.spec == P(("fsdp",), None), half["ids"].sharding
np.testing.assert_array_equal(np.asarray(half["ids"]), rows[:4])

with pytest.raises(ValueError) as e:
    global_batch({"ids": rows[:12]}, mesh, names, path="trainer.evalers['val']")
message = str(e.value)
assert "trainer.evalers['val']: a batch of 12 rows cannot be split" in message, message
assert "('data', 'fsdp') (8 shards)" in message, message
assert "trainer.evalers['val'].batch_axis_names" in message, message
print("OK")
"""


@pytest.mark.slow
def test_global_batch_splits_rows_over_the_batch_axes_and_names_the_config_on_error():
    # Also: global_batch_spec gives the shapes, dtypes and shardings without a batch.
    assert_prints_ok(_SCRIPT, devices=8)


_GATHER_SCRIPT = """
import jax
import jax.numpy as jnp
import numpy as np
from axlearn.common.base_layer import WeightWithCopy, weight_einsum
from axlearn.common.sharding import (
    create_mesh, gathered_for_matmul, maybe_shard, named_sharding, whole_heads_if_uneven
)

rng = np.random.default_rng(0)
x = rng.normal(size=(8, 8, 48)).astype(np.float32)
w = rng.normal(size=(48, 32)).astype(np.float32)
x_spec, w_spec = (("data", "fsdp"), None, "model"), ("model", "fsdp")
want = np.einsum("btd,dk->btk", x, w)
r = rng.normal(size=want.shape).astype(np.float32)
# Which meshes gather the weight: only 'model' and two other axes above 1.
meshes = (((2, 2, 2), True), ((1, 4, 2), False), ((2, 4, 1), False), ((1, 1, 8), False))
for shape, gathers in meshes:
    mesh = create_mesh(shape, ("data", "fsdp", "model"))
    seen = []

    def matmul(x_, w_):
        gathered = gathered_for_matmul(w_, w_spec)
        seen.append(gathered is not w_)
        assert gathered_for_matmul(w_, None) is w_
        # 2 key/value heads: kept whole only where 'model' (here 8) does not divide them.
        kv = x_.reshape(8, 8, 2, 24)
        assert (whole_heads_if_uneven(kv, axis=-2) is not kv) == (shape[2] == 8), shape
        return maybe_shard(jnp.einsum("btd,dk->btk", x_, gathered), x_spec)

    with jax.set_mesh(mesh):
        xs, ws = (jax.device_put(a, named_sharding(mesh, s)) for a, s in ((x, x_spec), (w, w_spec)))
        got = jax.jit(matmul)(xs, ws)
        # A weight with its train-dtype copy (here the weight itself) multiplies the copy;
        # the gradients of <product, r> reach x and the weight.
        def paired(x_, w_):
            y = weight_einsum("btd,dk->btk", x_, WeightWithCopy(w_, w_), partition_spec=w_spec)
            return maybe_shard(y, x_spec)

        paired_out = jax.jit(paired)(xs, ws)
        dx, dw = jax.jit(jax.grad(lambda x_, w_: jnp.sum(paired(x_, w_) * r), (0, 1)))(xs, ws)
    assert seen == [gathers], (shape, seen)
    for name, value, expected in (
        ("product", got, want),
        ("product with a copy", paired_out, want),
        ("dx", dx, np.einsum("btk,dk->btd", r, w)),
        ("dw", dw, np.einsum("btd,btk->dk", x, r)),
    ):
        np.testing.assert_allclose(
            np.asarray(value), expected, rtol=1e-4, atol=1e-4, err_msg=f"{shape} {name}"
        )
print("OK")
"""


@pytest.mark.slow
def test_weights_are_gathered_and_kv_heads_kept_whole_only_on_meshes_xla_partitions_wrong():
    assert_prints_ok(_GATHER_SCRIPT, devices=8)


def test_indivisible_dim_names_the_first_dim_a_mesh_cannot_split_evenly():
    sizes = dict(data=2, fsdp=4, model=8)
    spec = (None, ("fsdp", "seq"), "model")  # The mesh has no 'seq': it splits nothing.
    assert indivisible_dim((3, 8, 16), spec, sizes) is None
    assert indivisible_dim((3, 6, 16), spec, sizes) == "dim 1 (6) over fsdp (4 parts)"
    assert indivisible_dim((3, 8, 4), spec, sizes) == "dim 2 (4) over model (8 parts)"
    want = "dim 0 (6) over data x fsdp (8 parts)"
    assert indivisible_dim((6, 12), (("data", "fsdp"), None), sizes) == want


@pytest.mark.parametrize(
    "rows,microbatch,expected", [(8, 2, 4), (8, 8, 1), (4, 8, 1), (8, 3, None), (6, 4, None)]
)
def test_microbatch_count_splits_a_device_s_rows_only_when_the_microbatch_divides_them(
    rows, microbatch, expected
):
    assert microbatch_count(rows, microbatch) == expected
