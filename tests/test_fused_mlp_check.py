"""benchmarks/fused_mlp_check.py: its Triton kernels and the Mosaic GPU ones of
benchmarks/fused_mlp_mosaic.py, interpreted on the CPU, against a NumPy float64
re-derivation (so the GPU timings it prints are of the right math)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import fused_mlp_check as check
from benchmarks import fused_mlp_mosaic as mosaic

# 10 row blocks of 64: a full group of 8 tiles' rows and a partial group of 2.
_ROWS, _MODEL, _HIDDEN = 640, 128, 256
_CONFIG = (64, 128, 32, 4, 2)


def _bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16, back in float64."""
    return np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)


def _silu(x):
    return x / (1 + np.exp(-x))


def _random_operands(seed: int, rows: int, model: int, hidden: int) -> dict[str, np.ndarray]:
    """x, dy, w0, w1, w2 of an MLP, bf16-rounded; weights scaled by 1 / sqrt(fan-in)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: _bf16(rng.normal(size=shape) / np.sqrt(shape[0]))  # noqa: E731
    return dict(
        x=_bf16(rng.normal(size=(rows, model))),
        dy=_bf16(rng.normal(size=(rows, model))),
        w0=normal(model, hidden),
        w1=normal(model, hidden),
        w2=normal(hidden, model),
    )


@pytest.fixture(name="operands")
def fixture_operands():
    return _random_operands(0, _ROWS, _MODEL, _HIDDEN)


def _jnp(*arrays):
    return [jnp.asarray(a, jnp.bfloat16) for a in arrays]


def _assert_close(got, want):
    # One bfloat16 rounding of the result (8 bits of mantissa) on top of float32 sums.
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-2, atol=1e-2)


def test_matmul_tiles_the_whole_product(operands):
    x, w0 = operands["x"], operands["w0"]
    got = check.matmul(*_jnp(x, w0), config=_CONFIG, interpret=True)
    _assert_close(got, x @ w0)


def test_fused_forward_writes_both_projections_and_the_gated_product(operands):
    x, w0, w1 = operands["x"], operands["w0"], operands["w1"]
    a, b, h = check.gated_mlp_forward(*_jnp(x, w0, w1), config=_CONFIG, interpret=True)
    _assert_close(a, x @ w0)
    _assert_close(b, x @ w1)
    # h from a and b as the kernel rounded them, like a separate pass would read them.
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    _assert_close(h, _silu(a64) * b64)


def test_fused_backward_gives_the_gated_product_s_cotangents(operands):
    x, dy, w0, w1, w2 = (operands[k] for k in ("x", "dy", "w0", "w1", "w2"))
    a, b = _bf16(x @ w0), _bf16(x @ w1)
    da, db = check.gated_mlp_backward(*_jnp(dy, w2, a, b), config=_CONFIG, interpret=True)
    dh = _bf16(dy @ w2.T)
    sigmoid = 1 / (1 + np.exp(-a))
    _assert_close(da, dh * b * sigmoid * (1 + a * (1 - sigmoid)))
    _assert_close(db, dh * _silu(a))


def test_the_tile_order_visits_every_tile_once():
    rows, cols = 10, 3
    tile = check._tile_order(rows, cols, group=8)  # pylint: disable=protected-access
    seen = [tuple(int(v) for v in tile(jnp.int32(p))) for p in range(rows * cols)]
    assert sorted(seen) == [(i, j) for i in range(rows) for j in range(cols)]
    # A group's rows share each column block before the next column block starts.
    assert seen[:8] == [(i, 0) for i in range(8)]


def test_the_separate_path_matches_the_fused_one(operands):
    x, dy, w0, w1, w2 = _jnp(*(operands[k] for k in ("x", "dy", "w0", "w1", "w2")))
    want = check.separate_forward(x, w0, w1)
    got = check.gated_mlp_forward(x, w0, w1, config=_CONFIG, interpret=True)
    for g, w in zip(got, want):
        _assert_close(g, np.asarray(w, np.float64))
    a, b, _ = want
    want = check.separate_backward(dy, w2, a, b, interpret=True)
    got = check.gated_mlp_backward(dy, w2, a, b, config=_CONFIG, interpret=True)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        _assert_close(g, np.asarray(w, np.float64))


# The Mosaic GPU kernels under their CPU interpreter: 2 × 3 output tiles of 128 × 128
# over 3 blocks (each block loops over two tiles), 3 pipeline steps of 64; with one
# compute warpgroup, 4 × 3 tiles of 64 × 128 over 5 blocks (some loop over three).
_MOSAIC_SHAPE = dict(rows=256, model=192, hidden=384)
_MOSAIC_TILES = mosaic.Tiles(stages=2, num_blocks=3, interpret=True, w2_transposed=True)

needs_interpreter = pytest.mark.skipif(
    not mosaic.interpreter_available(), reason="this jax has no Mosaic GPU interpreter"
)


@pytest.fixture(name="mosaic_operands")
def fixture_mosaic_operands():
    return _random_operands(1, **_MOSAIC_SHAPE)


@needs_interpreter
@pytest.mark.parametrize(
    "tiles",
    [
        _MOSAIC_TILES,
        dataclasses.replace(_MOSAIC_TILES, out_slots=4, delay_release=1),
        dataclasses.replace(_MOSAIC_TILES, compute_wgs=1, num_blocks=5),
    ],
    ids=["two_slots", "four_slots_delayed_release", "one_compute_warpgroup"],
)
def test_mosaic_forward_writes_both_projections_and_the_gated_product(mosaic_operands, tiles):
    x, w0, w1 = mosaic_operands["x"], mosaic_operands["w0"], mosaic_operands["w1"]
    a, b, h = jax.jit(functools.partial(mosaic.forward, tiles=tiles))(*_jnp(x, w0, w1))
    _assert_close(a, x @ w0)
    _assert_close(b, x @ w1)
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    _assert_close(h, _silu(a64) * b64)


@needs_interpreter
@pytest.mark.parametrize(
    "tiles",
    [
        _MOSAIC_TILES,
        dataclasses.replace(_MOSAIC_TILES, compute_wgs=1, num_blocks=5),
        dataclasses.replace(_MOSAIC_TILES, ab_load_step=1),
    ],
    ids=["two_compute_warpgroups", "one_compute_warpgroup", "loads_at_the_second_step"],
)
def test_mosaic_backward_gives_the_gated_product_s_cotangents(mosaic_operands, tiles):
    x, dy, w0, w1, w2 = (mosaic_operands[k] for k in ("x", "dy", "w0", "w1", "w2"))
    a, b = _bf16(x @ w0), _bf16(x @ w1)
    backward = jax.jit(functools.partial(mosaic.backward, tiles=tiles))
    da, db = backward(*_jnp(dy, w2, a, b))
    dh = _bf16(dy @ w2.T)
    sigmoid = 1 / (1 + np.exp(-a))
    _assert_close(da, dh * b * sigmoid * (1 + a * (1 - sigmoid)))
    _assert_close(db, dh * _silu(a))


def test_mosaic_kernels_reject_shapes_they_do_not_tile():
    x = jnp.zeros((200, 192), jnp.bfloat16)  # 200 rows: not a whole number of 128-row blocks.
    w = jnp.zeros((192, 384), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"\[200, 192\] x \[192, 384\] does not tile"):
        mosaic.forward(x, w, w, tiles=_MOSAIC_TILES)
