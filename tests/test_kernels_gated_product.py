"""Tests of axlearn.common.kernels.gated_product: the gated MLP's backward kernel,
interpreted on the CPU, against autodiff."""

import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import layers
from axlearn.common.kernels import dispatch
from axlearn.common.kernels.gated_product import gated_product_backward, gated_product_supported
from tests.fresh_python import assert_prints_ok

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("names", [("nn.silu", "linear"), ("nn.gelu", "nn.gelu"), ("squared_relu", "nn.sigmoid")])
def test_kernel_matches_autodiff_of_the_product(names):
    act0, act1 = (layers.get_activation_fn(n) for n in names)
    a, b, dh = (jnp.asarray(RNG.normal(size=(16, 2048)), jnp.float32) for _ in range(3))
    cotangents = functools.partial(layers.gated_product_cotangents, act0, act1)
    da, db = gated_product_backward(cotangents, a, b, dh, interpret=True)
    _, vjp = jax.vjp(lambda a_, b_: act0(a_) * act1(b_), a, b)
    want_da, want_db = vjp(dh)
    np.testing.assert_allclose(da, want_da, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, want_db, rtol=1e-5, atol=1e-5)


def test_gated_product_takes_the_kernel_when_asked_and_keeps_its_gradients():
    silu, linear = layers.get_activation_fn("nn.silu"), layers.get_activation_fn("linear")
    a, b = (jnp.asarray(RNG.normal(size=(2, 8, 1024)), jnp.bfloat16) for _ in range(2))
    w = jnp.asarray(RNG.normal(size=(2, 8, 1024)), jnp.float32)

    def loss(a_, b_):
        return jnp.sum(layers.gated_product(silu, linear, a_, b_).astype(jnp.float32) * w)

    xla_grads = jax.grad(loss, (0, 1))(a, b)
    with dispatch.interpreted():
        jaxpr = str(jax.make_jaxpr(jax.grad(loss, (0, 1)))(a, b))
        kernel_grads = jax.jit(jax.grad(loss, (0, 1)))(a, b)
    assert "pallas_call" in jaxpr
    for got, want in zip(kernel_grads, xla_grads):
        assert got.dtype == jnp.bfloat16
        # The kernel works in float32, XLA in bf16: equal to bf16 precision.
        np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=2e-2, atol=4e-2)


def test_kernel_is_skipped_where_it_does_not_apply():
    assert not gated_product_supported((3, 1000))  # No power-of-two block tiles 1000 units.
    assert dispatch.kernel_mode(jnp.zeros((3, 1000)), fits=gated_product_supported) is None
    # Outside `interpreted()` a supported shape takes the compiled kernel on a GPU and
    # stays on XLA on the CPU (this suite runs on both).
    assert gated_product_supported((8, 1024))
    on_gpu = jax.devices()[0].platform == "gpu"
    mode = dispatch.kernel_mode(jnp.zeros((8, 1024)), fits=gated_product_supported)
    assert mode is (False if on_gpu else None)
    # exact_gelu needs erf, which the kernel does not lower: the layer keeps XLA.
    gelu = layers.get_activation_fn("exact_gelu")
    with dispatch.interpreted():
        jaxpr = jax.make_jaxpr(jax.grad(lambda a_: jnp.sum(layers.gated_product(gelu, gelu, a_, a_))))(
            jnp.zeros((8, 1024))
        )
    assert "pallas_call" not in str(jaxpr)


_SHARDED_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from axlearn.common import layers
    from axlearn.common.kernels import dispatch
    from axlearn.common.sharding import create_mesh, named_sharding

    silu, linear = layers.get_activation_fn("nn.silu"), layers.get_activation_fn("linear")
    spec = (("data", "expert", "fsdp"), "seq", "model")
    rng = np.random.default_rng(0)
    a, b, w = (jnp.asarray(rng.normal(size=(8, 16, 2048)), jnp.float32) for _ in range(3))

    def loss(a_, b_):
        return jnp.sum(layers.gated_product(silu, linear, a_, b_, spec) * w)

    want = jax.grad(loss, (0, 1))(a, b)
    mesh = create_mesh((1, 4, 1, 2), ("data", "fsdp", "seq", "model"))
    with jax.set_mesh(mesh), dispatch.interpreted():
        shard = lambda t: jax.device_put(t, named_sharding(mesh, spec))
        jaxpr = str(jax.make_jaxpr(jax.grad(loss, (0, 1)))(a, b))
        got = jax.jit(jax.grad(loss, (0, 1)))(shard(a), shard(b))
        # Without a partition spec the kernel cannot run per device: XLA takes it.
        no_spec = str(jax.make_jaxpr(jax.grad(
            lambda a_, b_: jnp.sum(layers.gated_product(silu, linear, a_, b_) * w), (0, 1)))(a, b))
    assert "shard_map" in jaxpr and "pallas_call" in jaxpr, jaxpr
    assert "pallas_call" not in no_spec
    for g, ref in zip(got, want):
        assert g.sharding.spec == named_sharding(mesh, spec).spec, g.sharding
        np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-5)
    print("OK")
    """
)


@pytest.mark.slow
def test_kernel_runs_per_device_on_a_sharded_mesh():
    # A fresh process: the fake 8-device CPU platform must be set before jax starts.
    assert_prints_ok(_SHARDED_SCRIPT, devices=8)

