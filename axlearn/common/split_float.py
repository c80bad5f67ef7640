"""float32 arrays kept as narrower integer arrays that hold (nearly) all of their bits.

Two layouts:
- split_float32 / join_float32: a float32 as two 16-bit halves, its bfloat16 rounding and
  the bits below it; exact, for carried weights (below).
- round_to_float24 / float24_to_float32: a float32 rounded to its top 24 bits, kept as a
  uint16 and a uint8 array (`Float24`); 3 bytes an element, relative error at most 2**-16,
  for optimizer state (`optimizers.cast_optimizer_state(dtype=FLOAT24)`).

Split weights: a mixed-precision train step keeps float32 weights for the update and
reads bfloat16 copies of them in the forward and backward passes. Carried side by side,
the two take 6 bytes a weight, and the update writes all 6. Split, they take 4 and lose
nothing:

    high = the bfloat16 nearest x (ties away from zero): the copy the model reads
    low  = x's bits minus high's, as an int16                (|low| <= 2**15)

`join_float32(high, low)` gives x back bit for bit, for every float32 but NaN (which stays
a NaN). `high` equals `x.astype(bfloat16)` except where x lies exactly halfway between two
bfloat16 values and round-to-nearest-even would round toward zero (one float32 in 2**17);
rounding ties the other way is what keeps `low` within 16 bits.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from axlearn.common.module import Tensor

# Added to a float32's bits before the low 16 are dropped: rounds its magnitude to the
# nearest bfloat16, halfway cases up.
_HALF = 0x8000
# The bits of a quiet bfloat16 NaN; NaN's bits plus _HALF can carry into the sign bit.
_BFLOAT16_NAN = 0x7FC0


def split_float32(x: Tensor) -> tuple[Tensor, Tensor]:
    """(high, low) of a float32 array: bfloat16 and int16 arrays of x's shape."""
    if x.dtype != jnp.float32:
        raise ValueError(f"split_float32 takes float32, got {x.dtype}")
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    high = ((bits + jnp.uint32(_HALF)) >> 16).astype(jnp.uint16)
    high = jnp.where(jnp.isnan(x), jnp.uint16(_BFLOAT16_NAN), high)
    low = (bits - (high.astype(jnp.uint32) << 16)).astype(jnp.int32).astype(jnp.int16)
    return jax.lax.bitcast_convert_type(high, jnp.bfloat16), low


def join_float32(high: Tensor, low: Tensor) -> Tensor:
    """The float32 array that `split_float32` split into `high` and `low`."""
    if high.dtype != jnp.bfloat16 or low.dtype != jnp.int16:
        raise ValueError(f"join_float32 takes bfloat16 and int16, got {high.dtype} and {low.dtype}")
    high_bits = jax.lax.bitcast_convert_type(high, jnp.uint16).astype(jnp.uint32) << 16
    # int16 -> int32 -> uint32 sign-extends, so the sum wraps to high_bits + low.
    bits = high_bits + low.astype(jnp.int32).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


# What `cast_optimizer_state` (and a config) takes in place of a dtype for the 24-bit layout.
FLOAT24 = "float24"
# Added to a float32's bits before the low 8 are dropped: rounds its magnitude to the
# nearest 24-bit value, halfway cases up.
_HALF_BYTE = 0x80
# A quiet float32 NaN, whose low 8 bits are zero; other NaNs plus _HALF_BYTE can carry
# into the sign bit.
_FLOAT32_NAN = 0x7FC00000


class Float24(NamedTuple):
    """A float32 array rounded to its top 24 bits (sign, 8 exponent bits, 15 of the 23
    mantissa bits), stored as the top 16 (`high`, uint16) and the next 8 (`low`, uint8).

    Against bfloat16 (7 mantissa bits) it keeps 256 times the precision for 1.5 times the
    bytes: rounding to nearest, an EMA kept in it loses a step only when the step is under
    2**-17 to 2**-16 of its value (bfloat16: 2**-9 to 2**-8), where float32 state's own
    inputs, gradients from bfloat16 matmuls, carry relative errors near 2**-9.
    """

    high: Tensor
    low: Tensor


def is_float24(x: Any) -> bool:
    """Whether `x` is a `Float24` (for `is_leaf` in tree maps over state that holds them)."""
    return isinstance(x, Float24)


def round_to_float24(x: Tensor) -> Float24:
    """`x` (float32) rounded to the nearest 24-bit value, ties away from zero; infinities and
    NaNs stay what they are, and magnitudes past the largest 24-bit value become infinite."""
    if x.dtype != jnp.float32:
        raise ValueError(f"round_to_float24 takes float32, got {x.dtype}")
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    # The sign is its own bit, so adding half a unit to the bits rounds the magnitude; a
    # mantissa that overflows carries into the exponent, which is the next binade.
    rounded = bits + jnp.uint32(_HALF_BYTE)
    rounded = jnp.where(jnp.isnan(x), jnp.uint32(_FLOAT32_NAN), rounded)
    return Float24(
        high=(rounded >> 16).astype(jnp.uint16),
        low=((rounded >> 8) & jnp.uint32(0xFF)).astype(jnp.uint8),
    )


def float24_to_float32(x: Float24) -> Tensor:
    """The float32 array a `Float24` holds (its low 8 bits zero)."""
    if x.high.dtype != jnp.uint16 or x.low.dtype != jnp.uint8:
        raise ValueError(
            f"float24_to_float32 takes uint16 and uint8, got {x.high.dtype} and {x.low.dtype}"
        )
    bits = (x.high.astype(jnp.uint32) << 16) | (x.low.astype(jnp.uint32) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)
