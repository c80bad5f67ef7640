"""Tests of axlearn.common.kernels.dispatch: the layers load no Pallas module, and
without Pallas's Triton backend they keep plain XLA while the kernels still run
interpreted."""

import textwrap

import pytest

from tests.fresh_python import assert_prints_ok

_NO_TRITON_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["jax.experimental.pallas.triton"] = None  # Importing it now raises ImportError.
    import jax, jax.numpy as jnp, numpy as np
    from axlearn.common import layers
    from axlearn.common.kernels import dispatch
    from axlearn.common.kernels.gated_product import gated_product_backward, gated_product_supported
    from axlearn.common.kernels.rms_norm import rms_norm_backward

    # Even on a GPU the layers would keep plain XLA: nothing could compile the kernels.
    jax.devices = lambda *_: [type("Gpu", (), {"platform": "gpu"})()]
    assert not dispatch.compiled_kernels_available()
    assert dispatch.kernel_mode(jnp.zeros((8, 1024)), fits=gated_product_supported) is None
    # Interpreted, both kernels still run, and match autodiff.
    rng = np.random.default_rng(0)
    x, dy, dres = (jnp.asarray(rng.normal(size=(16, 2048)), jnp.float32) for _ in range(3))
    scale = jnp.asarray(rng.normal(size=(2048,)), jnp.float32)
    dx, _ = rms_norm_backward(x, scale, [dy], dres, eps=1e-6, interpret=True)
    _, vjp = jax.vjp(lambda x_: layers._rms_norm(x_, scale, 1e-6, jnp.float32), x)
    np.testing.assert_allclose(dx, vjp(dy)[0] + dres, rtol=1e-4, atol=1e-4)
    silu, linear = layers.get_activation_fn("nn.silu"), layers.get_activation_fn("linear")
    cotangents = lambda a_, b_, dh_: layers.gated_product_cotangents(silu, linear, a_, b_, dh_)
    da, db = gated_product_backward(cotangents, x, dy, dres, interpret=True)
    _, vjp = jax.vjp(lambda a_, b_: silu(a_) * b_, x, dy)
    for got, want in zip((da, db), vjp(dres)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    print("OK")
    """
)


@pytest.mark.slow
def test_without_pallas_triton_the_layers_keep_xla_and_the_kernels_run_interpreted():
    # jax 0.11 deprecates Pallas's Triton backend; a jax without it must still import us.
    assert_prints_ok(_NO_TRITON_SCRIPT)


_NO_TRITON_COMPILE_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["jax.experimental.pallas.triton"] = None
    import pytest
    from axlearn.common.kernels import dispatch

    assert dispatch.compiler_params(8, interpret=True) is None
    with pytest.raises(RuntimeError, match="no Pallas Triton backend.*interpret=True"):
        dispatch.compiler_params(8, interpret=False)
    print("OK")
    """
)


@pytest.mark.slow
def test_without_pallas_triton_compiling_a_kernel_says_to_interpret_it():
    assert_prints_ok(_NO_TRITON_COMPILE_SCRIPT)


_IMPORT_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax

    def pallas_modules():
        return {m for m in sys.modules if "pallas" in m or "triton" in m}

    loaded_by_jax = pallas_modules()  # jaxlib's own GPU Triton bindings, if any.
    import axlearn.common.attention, axlearn.common.layers, axlearn.common.trainer
    assert pallas_modules() == loaded_by_jax, sorted(pallas_modules() - loaded_by_jax)
    print("OK")
    """
)


@pytest.mark.slow
def test_importing_the_layers_and_trainer_loads_no_pallas_or_triton_module():
    # The kernels import Pallas only when they build a kernel, so a CPU run never loads it.
    assert_prints_ok(_IMPORT_SCRIPT)
