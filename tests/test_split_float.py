"""Tests of axlearn.common.split_float against a float64 re-derivation of the rounding."""

import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common.split_float import join_float32, split_float32


def _float32s(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random float32 bit patterns (every exponent, subnormals included), ties at bf16
    precision of both signs, and the special values."""
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2**16, n // 4, dtype=np.uint64).astype(np.uint32) << 16) | 0x8000
    special = np.array(
        [0.0, -0.0, np.inf, -np.inf, 3.4028235e38, -3.4028235e38, 1e-45, -1e-45, 1.1754944e-38],
        np.float32,
    )
    return np.concatenate([bits.view(np.float32), ties.view(np.float32), special])


def _nearest_bfloat16_ties_away(x: np.ndarray) -> np.ndarray:
    """The bfloat16 value nearest each finite float32 x, halfway cases away from zero, in
    float64: the two candidates are x with its low 16 bits cleared and the next such value
    away from zero (2**128 standing for the one past the largest, which rounds to
    infinity)."""
    unit = 1 << 16
    magnitude = np.abs(x.astype(np.float64))
    down_bits = np.abs(x).view(np.uint32) & np.uint32(0xFFFFFFFF ^ (unit - 1))
    down = down_bits.view(np.float32).astype(np.float64)
    up = (down_bits + np.uint32(unit)).view(np.float32).astype(np.float64)
    up = np.where(np.isinf(up), 2.0**128, up)
    nearest = np.where(magnitude - down < up - magnitude, down, up)
    nearest = np.where(nearest == 2.0**128, np.inf, nearest)
    return np.copysign(nearest, x.astype(np.float64))


def test_joining_the_halves_gives_every_float32_back_bit_for_bit():
    x = _float32s(np.random.default_rng(0), 200_000)
    x = x[~np.isnan(x)]
    high, low = split_float32(jnp.asarray(x))
    assert high.dtype == jnp.bfloat16 and low.dtype == jnp.int16
    joined = np.asarray(join_float32(high, low))
    np.testing.assert_array_equal(joined.view(np.uint32), x.view(np.uint32))


def test_the_high_half_is_the_nearest_bfloat16_with_ties_away_from_zero():
    x = _float32s(np.random.default_rng(1), 200_000)
    x = x[np.isfinite(x)]
    high, _ = split_float32(jnp.asarray(x))
    got = np.asarray(high).astype(np.float64)
    np.testing.assert_array_equal(got, _nearest_bfloat16_ties_away(x))
    # So it is the cast wherever the cast (ties to even) agrees: everywhere but half the ties.
    cast = np.asarray(jnp.asarray(x).astype(jnp.bfloat16)).astype(np.float64)
    tie = x.view(np.uint32) & 0xFFFF == 0x8000
    np.testing.assert_array_equal(got[~tie], cast[~tie])
    assert 0 < np.sum(got[tie] != cast[tie]) < np.sum(tie)


def test_a_nan_stays_a_nan_whatever_its_bits():
    # 0x7FFFFFFF is the NaN a GPU's float32 arithmetic writes; plus the rounding's half it
    # would carry into the sign bit and read as -0.0.
    nans = np.array([0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001], np.uint32).view(np.float32)
    high, low = split_float32(jnp.asarray(nans))
    assert np.all(np.isnan(np.asarray(high).astype(np.float32)))
    assert np.all(np.isnan(np.asarray(join_float32(high, low))))


def test_other_dtypes_are_refused():
    with pytest.raises(ValueError, match="split_float32 takes float32, got bfloat16"):
        split_float32(jnp.zeros(3, jnp.bfloat16))
    with pytest.raises(ValueError, match="join_float32 takes bfloat16 and int16, got float32"):
        join_float32(jnp.zeros(3, jnp.float32), jnp.zeros(3, jnp.int16))

