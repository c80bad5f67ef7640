"""float32 arrays split exactly into their bfloat16 rounding and the int16 bits below it.

A mixed-precision train step keeps float32 weights for the update and reads bfloat16
copies of them in the forward and backward passes. Carried side by side, the two take
6 bytes a weight, and the update writes all 6. Split, they take 4 and lose nothing
(`SpmdTrainer.Config.split_carried_weights`):

    high = the bfloat16 nearest x (ties away from zero): the copy the model reads
    low  = x's bits minus high's, as an int16                (|low| <= 2**15)

`join_float32(high, low)` gives x back bit for bit, for every float32 but NaN (which stays
a NaN). `high` equals `x.astype(bfloat16)` except where x lies exactly halfway between two
bfloat16 values and round-to-nearest-even would round toward zero (one float32 in 2**17);
rounding ties the other way is what keeps `low` within 16 bits.
"""

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

