"""Tests of axlearn.common.kernels.rms_norm: RMSNorm's backward kernel, interpreted on
the CPU, against NumPy and autodiff, alone and inside transformer layers."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import attention, layers
from axlearn.common.kernels import dispatch
from axlearn.common.kernels.rms_norm import rms_norm_backward, rms_norm_supported
from axlearn.common.module import functional as F
from axlearn.common.param_init import default_initializer_config
from tests.fresh_python import assert_prints_ok

RNG = np.random.default_rng(0)


def _np_prenorm_grads(x, scale, dys, dresidual, eps):
    """dx and dscale of (x, x * r * scale, ...) with r = 1/sqrt(mean(x^2) + eps), in float64,
    derived by hand: y_j = x_j r s_j, dr/dx_k = -r^3 x_k / D."""
    x, scale, dresidual = (np.asarray(t, np.float64) for t in (x, scale, dresidual))
    dy = sum(np.asarray(t, np.float64) for t in dys)
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    g = dy * scale
    dx = dresidual + r * g - x * r**3 * np.mean(g * x, axis=-1, keepdims=True)
    return dx, np.sum(dy * x * r, axis=0)


@pytest.mark.parametrize("rows,hidden,consumers", [(64, 256, 1), (48, 256, 2), (8, 2048, 2)])
def test_norm_kernel_matches_numpy(rows, hidden, consumers):
    # 48 rows: fewer than a program walks, which then takes the largest share that divides.
    x, dresidual, *dys = (RNG.normal(size=(rows, hidden)) for _ in range(2 + consumers))
    scale = 1 + 0.1 * RNG.normal(size=(hidden,))
    as32 = lambda t: jnp.asarray(t, jnp.float32)  # noqa: E731
    dx, dscale = rms_norm_backward(
        as32(x), as32(scale), [as32(t) for t in dys], as32(dresidual), eps=1e-5, interpret=True
    )
    want_dx, want_dscale = _np_prenorm_grads(x, scale, dys, dresidual, 1e-5)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dscale, want_dscale, rtol=1e-5, atol=1e-4)


def _transformer_layer(structure: str, hidden: int = 256, remat: bool = False):
    """A pre-norm layer with RMSNorms and a gated MLP (two consumers of its norm); with
    `remat`, under the GPU rule's policy (projections and context saved, the rest recomputed)."""
    norm = layers.RMSNorm.default_config().set(eps=1e-5, forward_dtype=None)
    cfg = attention.TransformerLayer.default_config().set(name="layer", input_dim=hidden)
    if remat:
        cfg.remat_spec = dict(attention.build_remat_spec(), prevent_cse=True)
    cfg.self_attention.set(norm=norm, structure=structure)
    cfg.self_attention.attention.num_heads = 4
    cfg.feed_forward.set(hidden_dim=512, activation=("nn.silu", "linear"), norm=norm, structure=structure)
    layer = cfg.set(param_init=default_initializer_config()).instantiate(parent=None)
    params = layer.initialize_parameters_recursively(jax.random.PRNGKey(0))
    # Scales away from 1, so that a wrong scale gradient or a scale left out shows.
    params = jax.tree.map(lambda p: p + 0.1 * jnp.asarray(RNG.normal(size=p.shape), p.dtype), params)
    return layer, params


@pytest.mark.slow
@pytest.mark.parametrize("structure,remat", [("prenorm", False), ("hybridnorm", False), ("prenorm", True)])
def test_prenorm_layers_take_the_norm_kernel_and_keep_their_gradients(structure, remat):
    layer, params = _transformer_layer(structure, remat=remat)
    x = jnp.asarray(RNG.normal(size=(2, 8, 256)), jnp.float32)
    w = jnp.asarray(RNG.normal(size=(2, 8, 256)), jnp.float32)

    def loss(params_, x_):
        y, _ = F(layer, inputs=dict(data=x_), state=params_, is_training=True, prng_key=None)
        return jnp.sum(y * w), y

    (_, xla_out), xla_grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(params, x)
    with dispatch.interpreted():
        jaxpr = str(jax.make_jaxpr(jax.grad(loss, (0, 1), has_aux=True))(params, x))
        (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(params, x)
    # Both blocks' norms, the feed-forward's with its two input projections' gradients,
    # and the gated product's kernel; under remat the recomputed forward feeds them.
    assert jaxpr.count("name=rms_norm_backward") == 2, jaxpr
    assert "name=gated_product_backward" in jaxpr, jaxpr
    assert ("remat" in jaxpr) is remat, jaxpr
    np.testing.assert_array_equal(out, xla_out)  # The forward is XLA's either way.
    # float32 sums in another order: equal to a few ulps of the largest gradient.
    atol = 1e-5 * max(float(np.max(np.abs(g))) for g in jax.tree.leaves(xla_grads))
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(xla_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=atol, err_msg=jax.tree_util.keystr(path))


def test_norm_kernel_is_skipped_where_it_does_not_apply():
    assert rms_norm_supported((16, 2048))
    assert not rms_norm_supported((16, 1000))  # Rows of a power of two only.
    assert not rms_norm_supported((16, 16384))  # Wider than a program holds.
    assert not rms_norm_supported((3, 256))  # Not whole blocks of rows.
    on_gpu = jax.devices()[0].platform == "gpu"
    norm = layers.RMSNorm.default_config().set(name="norm", input_dim=1000).instantiate(parent=None)
    scale = dict(scale=jnp.ones((1000,)))

    def grads(layer, state, x):
        def loss(x_):
            (residual, y), _ = F(layer, inputs=dict(x=x_), state=state, is_training=True,
                                 prng_key=None, method="residual_and_norm")
            return jnp.sum(residual * y)

        return str(jax.make_jaxpr(jax.grad(loss))(x))

    rms = layers.RMSNorm.default_config().set(name="norm", input_dim=256).instantiate(parent=None)
    rms_scale = dict(scale=jnp.ones((256,)))
    rows = jnp.ones((32, 256))  # Two blocks of the 16 rows of 256 a program holds at once.
    with dispatch.interpreted():
        assert "pallas_call" not in grads(norm, scale, jnp.ones((4, 1000)))
        assert "pallas_call" not in grads(rms, rms_scale, jnp.ones((4, 256)))  # Not a block.
        assert "pallas_call" in grads(rms, rms_scale, rows)
        # A LayerNorm keeps autodiff's backward: the kernel is RMSNorm's.
        layer_norm = layers.LayerNorm.default_config().set(name="norm", input_dim=256)
        state = dict(scale=jnp.ones((256,)), bias=jnp.zeros((256,)))
        assert "pallas_call" not in grads(layer_norm.instantiate(parent=None), state, rows)
    # Outside `interpreted()`: the compiled kernel on a GPU, XLA on the CPU.
    assert ("pallas_call" in grads(rms, rms_scale, rows)) is on_gpu


_SHARDED_NORM_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from axlearn.common import layers
    from axlearn.common.kernels import dispatch
    from axlearn.common.module import functional as F
    from axlearn.common.sharding import create_mesh, named_sharding

    spec = (("data", "expert", "fsdp"), "seq", "model")
    rng = np.random.default_rng(0)
    x, w0, w1 = (jnp.asarray(rng.normal(size=(8, 16, 256)), jnp.float32) for _ in range(3))
    state = dict(scale=jnp.asarray(1 + 0.1 * rng.normal(size=(256,)), jnp.float32))
    norm = layers.RMSNorm.default_config().set(name="norm", input_dim=256, eps=1e-5)
    norm = norm.instantiate(parent=None)

    def loss(state_, x_):
        inputs = dict(x=x_, partition_spec=spec, consumers=2)
        (residual, y0, y1), _ = F(norm, inputs=inputs, state=state_, is_training=True,
                                  prng_key=None, method="residual_and_norm")
        return jnp.sum(residual * y0 * w0 + y1 * w1)

    want = jax.grad(loss, (0, 1))(state, x)
    for shape, kernel in (((1, 8, 1, 1), True), ((1, 4, 1, 2), False)):
        mesh = create_mesh(shape, ("data", "fsdp", "seq", "model"))
        with jax.set_mesh(mesh), dispatch.interpreted():
            jaxpr = str(jax.make_jaxpr(jax.grad(loss, (0, 1)))(state, x))
            x_sharded = jax.device_put(x, named_sharding(mesh, spec))
            got = jax.jit(jax.grad(loss, (0, 1)))(state, x_sharded)
        # Rows split over fsdp: the kernel per device, the scale's gradient summed over them.
        # The hidden axis split over model: the norm's sums would span devices, so XLA.
        assert ("pallas_call" in jaxpr and "shard_map" in jaxpr) is kernel, (shape, jaxpr)
        np.testing.assert_allclose(got[0]["scale"], want[0]["scale"], rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
        assert got[1].sharding.is_equivalent_to(named_sharding(mesh, spec), 3), got[1].sharding
    print("OK")
    """
)


@pytest.mark.slow
def test_norm_kernel_runs_per_device_on_a_sharded_mesh():
    assert_prints_ok(_SHARDED_NORM_SCRIPT, devices=8)


_SHARDED_LAYER_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from axlearn.common import attention, layers
    from axlearn.common.kernels import dispatch
    from axlearn.common.module import functional as F
    from axlearn.common.param_init import default_initializer_config
    from axlearn.common.sharding import create_mesh, named_sharding

    spec = (("data", "expert", "fsdp"), "seq", "model")
    norm = layers.RMSNorm.default_config().set(eps=1e-5, forward_dtype=None)
    cfg = attention.TransformerLayer.default_config().set(name="layer", input_dim=256)
    cfg.self_attention.set(norm=norm)
    cfg.self_attention.attention.num_heads = 4
    cfg.feed_forward.set(hidden_dim=512, activation=("nn.silu", "linear"), norm=norm)
    cfg.feed_forward.linear1.output_partition_spec = spec
    cfg.feed_forward.linear2.output_partition_spec = spec
    layer = cfg.set(param_init=default_initializer_config()).instantiate(parent=None)
    params = layer.initialize_parameters_recursively(jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    x, w = (jnp.asarray(rng.normal(size=(8, 16, 256)), jnp.float32) for _ in range(2))

    def loss(params_, x_):
        y, _ = F(layer, inputs=dict(data=x_), state=params_, is_training=True, prng_key=None)
        return jnp.sum(y * w)

    want = jax.grad(loss, (0, 1))(params, x)
    mesh = create_mesh((1, 8, 1, 1), ("data", "fsdp", "seq", "model"))
    with jax.set_mesh(mesh), dispatch.interpreted():
        jaxpr = str(jax.make_jaxpr(jax.grad(loss, (0, 1)))(params, x))
        got = jax.jit(jax.grad(loss, (0, 1)))(params, jax.device_put(x, named_sharding(mesh, spec)))
    # The attention block's norm takes the stream's split from the layer, as the
    # feed-forward's does from its own config: both run per device.
    assert jaxpr.count("name=rms_norm_backward") == 2, jaxpr
    assert jaxpr.count("shard_map") == 3, jaxpr  # The two norms and the gated product.
    atol = 1e-5 * max(float(np.max(np.abs(g))) for g in jax.tree.leaves(want))
    for got_leaf, want_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(got_leaf, want_leaf, rtol=1e-4, atol=atol)
    print("OK")
    """
)


@pytest.mark.slow
def test_both_norms_of_a_layer_run_per_device_on_a_sharded_mesh():
    assert_prints_ok(_SHARDED_LAYER_SCRIPT, devices=8)
