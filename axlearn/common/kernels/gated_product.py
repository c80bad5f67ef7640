"""The backward pass of a gated product h = act0(a) * act1(b) as one Pallas kernel.

The elementwise work of a transformer step is limited by memory bandwidth, so its cost
is the number of times each [tokens, hidden] tensor crosses HBM. Inside a train step XLA
emits the two input cotangents as two kernels, each re-reading the hidden activations;
this kernel reads a, b and dh once and writes both. `layers.gated_product` takes it
where `dispatch.kernel_mode` says so.
"""

import math
from collections.abc import Callable, Sequence
from typing import Optional

import jax
import jax.numpy as jnp

from axlearn.common.kernels.dispatch import compiler_params, rows, several_devices
from axlearn.common.module import Tensor
from axlearn.common.sharding import MeshAxes, mesh_partition_spec

# (a, b, dh) -> (da, db): the elementwise cotangents of a gated product.
Cotangents = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]

# Rows x hidden units of one program, and its warps (tuned on Hopper: 4 warps are slower).
_BLOCK = (8, 1024)
_NUM_WARPS = 8


def _block(hidden: int) -> tuple[int, int]:
    block_rows, block_hidden = _BLOCK
    return block_rows, min(block_hidden, hidden)


def gated_product_supported(shape: Sequence[int]) -> bool:
    """Whether the kernel tiles an array of `shape` ([..., hidden]) exactly."""
    hidden, num_rows = shape[-1], math.prod(shape[:-1])
    block_rows, block_hidden = _block(hidden)
    return len(shape) >= 2 and num_rows % block_rows == 0 and hidden % block_hidden == 0 and (
        block_hidden & (block_hidden - 1) == 0
    )


def sharded_gated_product_backward(
    cotangents: Cotangents,
    a: Tensor,
    b: Tensor,
    dh: Tensor,
    *,
    partition_spec: Optional[MeshAxes],
    interpret: bool = False,
) -> tuple[Tensor, Tensor]:
    """`gated_product_backward` for [..., hidden] arrays split by `partition_spec` over the
    current mesh (None: unsplit): each device runs the kernel on its own block."""

    def local(a_, b_, dh_):
        da, db = gated_product_backward(
            cotangents, rows(a_), rows(b_), rows(dh_), interpret=interpret
        )
        return da.reshape(a_.shape), db.reshape(b_.shape)

    if not several_devices():
        return local(a, b, dh)
    spec = mesh_partition_spec(partition_spec)
    # check_vma=False: the Pallas call has no rule for varying manual axes, and every
    # output block depends only on the same block of the inputs.
    return jax.shard_map(local, in_specs=(spec,) * 3, out_specs=(spec, spec), check_vma=False)(
        a, b, dh
    )


def gated_product_backward(
    cotangents: Cotangents,
    a: Tensor,
    b: Tensor,
    dh: Tensor,
    *,
    block: Optional[tuple[int, int]] = None,
    num_warps: int = _NUM_WARPS,
    interpret: bool = False,
) -> tuple[Tensor, Tensor]:
    """(da, db) = cotangents(a, b, dh) for [rows, hidden] a, b and dh, in one pass over
    them, with the inputs in float32 (`layers.gated_product_cotangents` for the gated MLP).

    `cotangents` must be elementwise and built from ops Triton lowers (no erf).
    """
    from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel

    num_rows, hidden = a.shape
    block_rows, block_hidden = block or _block(hidden)

    def kernel(a_ref, b_ref, dh_ref, da_ref, db_ref):
        da, db = cotangents(*(ref[...].astype(jnp.float32) for ref in (a_ref, b_ref, dh_ref)))
        da_ref[...] = da.astype(da_ref.dtype)
        db_ref[...] = db.astype(db_ref.dtype)

    spec = pl.BlockSpec((block_rows, block_hidden), lambda i, j: (i, j))
    return pl.pallas_call(
        kernel,
        grid=(num_rows // block_rows, hidden // block_hidden),
        in_specs=[spec, spec, spec],
        out_specs=[spec, spec],
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype), jax.ShapeDtypeStruct(b.shape, b.dtype)],
        compiler_params=compiler_params(num_warps, interpret),
        interpret=interpret,
        name="gated_product_backward",
    )(a, b, dh)
