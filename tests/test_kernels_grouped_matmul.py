"""kernels.grouped_matmul: its custom backward against autodiff of jax.lax.ragged_dot
(with stand-in kernels on the CPU), and jax's Mosaic GPU kernels on a Hopper GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common.kernels import grouped_matmul as gm

RNG = np.random.default_rng(0)


def _nan_past_groups(y, group_sizes):
    """The Mosaic kernels leave rows past the groups unwritten: stand in with NaN."""
    return jnp.where(jnp.arange(y.shape[0])[:, None] < jnp.sum(group_sizes), y, jnp.nan)


def _ragged_dot(x, w, *, group_sizes, transpose_rhs=False):  # As the kernel's arguments.
    w = jnp.swapaxes(w, 1, 2) if transpose_rhs else w
    return _nan_past_groups(jax.lax.ragged_dot(x, w, group_sizes), group_sizes)


def _transposed_ragged_dot(x, dy, *, group_sizes):
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    return jax.lax.ragged_dot_general(x, dy, group_sizes, ragged_dot_dimension_numbers=numbers)


def _reference(x, w, group_sizes):
    in_groups = jnp.arange(x.shape[0])[:, None] < jnp.sum(group_sizes)
    return jnp.where(in_groups, jax.lax.ragged_dot(x, w, group_sizes), 0)


def _case(rows=24, k=16, n=8, dtype=jnp.float32):
    x = jnp.asarray(RNG.normal(size=(rows, k)), dtype)
    w = jnp.asarray(RNG.normal(size=(3, k, n)), dtype)
    group_sizes = jnp.array([5, 0, 11], jnp.int32)  # An empty group; 8 rows past them.
    dy = jnp.asarray(RNG.normal(size=(rows, n)), dtype)
    return x, w, group_sizes, dy


def test_custom_backward_matches_autodiff_of_ragged_dot_and_zeroes_rows_past_groups():
    x, w, group_sizes, dy = _case()
    # pylint: disable-next=protected-access
    kernels = gm._Kernels(ragged_dot=_ragged_dot, transposed_ragged_dot=_transposed_ragged_dot)
    # pylint: disable-next=protected-access
    y, vjp = jax.vjp(lambda x, w: gm._grouped_matmul_with(x, w, group_sizes, kernels), x, w)
    want_y, want_vjp = jax.vjp(lambda x, w: _reference(x, w, group_sizes), x, w)
    np.testing.assert_allclose(y, want_y, rtol=1e-6)
    for got, want in zip(vjp(dy), want_vjp(dy)):
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_without_the_kernels_it_is_ragged_dot():
    x, w, group_sizes, _ = _case()
    np.testing.assert_array_equal(
        gm.grouped_matmul(x, w, group_sizes, use_kernels=True), _reference(x, w, group_sizes)
    )


@pytest.mark.skipif(not gm.on_hopper(), reason="needs a Hopper GPU")
def test_mosaic_gpu_kernels_match_ragged_dot_forward_and_backward():
    x, w, _, dy = _case(rows=1024, k=256, n=512, dtype=jnp.bfloat16)
    group_sizes = jnp.array([300, 0, 600], jnp.int32)
    assert gm.kernels_fit(x.shape, w.shape, x.dtype, gm.Tiling())

    def run(use_kernels):
        return jax.jit(
            lambda x, w: jax.vjp(
                lambda x, w: gm.grouped_matmul(x, w, group_sizes, use_kernels=use_kernels), x, w
            )[1](dy)
            + (gm.grouped_matmul(x, w, group_sizes, use_kernels=use_kernels),)
        )(x, w)

    for got, want in zip(run(True), run(False)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_the_calls_fit_the_signatures_of_jax_mosaic_gpu_kernels():
    """Binds the arguments grouped_matmul passes to jax's kernels (checks them on any
    machine with this jax, GPU or not)."""
    import inspect  # pylint: disable=import-outside-toplevel

    if gm._mosaic_gpu_modules() is None:  # pylint: disable=protected-access
        pytest.skip("this jax has no Mosaic GPU ragged-dot kernels")
    kernels = gm.mosaic_gpu_kernels(gm.Tiling())
    x, w, group_sizes, dy = _case()
    inspect.signature(kernels.ragged_dot).bind(x, w, group_sizes=group_sizes)
    inspect.signature(kernels.ragged_dot).bind(dy, w, group_sizes=group_sizes, transpose_rhs=True)
    inspect.signature(kernels.transposed_ragged_dot).bind(x, dy, group_sizes=group_sizes)
