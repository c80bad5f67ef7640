"""A Pallas (Triton) kernel for the gated MLP's backward pass on GPU.

The elementwise work of a transformer step is limited by memory bandwidth, so its cost
is the number of times each [tokens, hidden] tensor crosses HBM. Inside a whole train
step XLA emits the two input cotangents of h = act0(a) * act1(b) as two kernels, each
re-reading the hidden activations (gpt_1b on an H100: 9.6 ms a step); the kernel here
reads a, b and dh once and writes both (docs/benchmarks.md).

It runs with `interpret=True` on any backend, which is how the tests check it on the
CPU. `layers.gated_product` asks `kernel_mode` whether to use it or plain XLA; on a
mesh of several devices it runs per device under `shard_map`.
"""

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from axlearn.common.base_layer import MeshAxes
from axlearn.common.module import Tensor
from axlearn.common.sharding import current_mesh_axes, local_shape, mesh_partition_spec

# (a, b, dh) -> (da, db): the elementwise cotangents of a gated product.
Cotangents = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]

# Rows x hidden units of one program. Blocks of 2-32 rows and 8 warps all ran at
# ~2.9 TB/s on an H100 (benchmarks/kernel_check.py); 4 warps at ~2.6.
_BLOCK = (8, 1024)
_NUM_WARPS = 8

# Set by `interpreted()`: the layers call the kernel in interpret mode on any backend.
_interpret_everywhere = False


@contextlib.contextmanager
def interpreted():
    """Within it, the layers use the kernel on any backend, interpreted (for tests)."""
    global _interpret_everywhere
    before, _interpret_everywhere = _interpret_everywhere, True
    try:
        yield
    finally:
        _interpret_everywhere = before


def kernel_mode(a: Tensor, partition_spec: Optional[MeshAxes] = None) -> Optional[bool]:
    """How `layers.gated_product` should take the backward of `a` ([..., hidden]): None for
    plain XLA, else the kernel's `interpret` flag.

    A Pallas call is opaque to XLA's SPMD partitioner, which would gather a sharded input
    onto every device first; on a mesh of several devices the kernel therefore runs per
    device under `shard_map`, and only where `partition_spec` says how `a` is split.
    """
    mesh_devices = math.prod(current_mesh_axes().values())
    if mesh_devices > 1 and (partition_spec is None or len(partition_spec) != a.ndim):
        return None
    spec = mesh_partition_spec(partition_spec or (None,) * a.ndim)
    block = local_shape(a.shape, spec)
    if block is None or not supported(block):
        return None
    if _interpret_everywhere:
        return True
    return False if jax.devices()[0].platform == "gpu" else None


def supported(shape: Sequence[int]) -> bool:
    """Whether the kernel tiles an array of `shape` ([..., hidden]) exactly."""
    hidden, rows = shape[-1], math.prod(shape[:-1])
    block_rows, block_hidden = _block(hidden)
    return len(shape) >= 2 and rows % block_rows == 0 and hidden % block_hidden == 0 and (
        block_hidden & (block_hidden - 1) == 0
    )


def _block(hidden: int) -> tuple[int, int]:
    block_rows, block_hidden = _BLOCK
    return block_rows, min(block_hidden, hidden)


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
        rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
        da, db = gated_product_backward(cotangents, rows(a_), rows(b_), rows(dh_), interpret=interpret)
        return da.reshape(a_.shape), db.reshape(b_.shape)

    if math.prod(current_mesh_axes().values()) <= 1:
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
    rows, hidden = a.shape
    block_rows, block_hidden = block or _block(hidden)

    def kernel(a_ref, b_ref, dh_ref, da_ref, db_ref):
        da, db = cotangents(*(ref[...].astype(jnp.float32) for ref in (a_ref, b_ref, dh_ref)))
        da_ref[...] = da.astype(da_ref.dtype)
        db_ref[...] = db.astype(db_ref.dtype)

    spec = pl.BlockSpec((block_rows, block_hidden), lambda i, j: (i, j))
    return pl.pallas_call(
        kernel,
        grid=(rows // block_rows, hidden // block_hidden),
        in_specs=[spec, spec, spec],
        out_specs=[spec, spec],
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype), jax.ShapeDtypeStruct(b.shape, b.dtype)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps),
        interpret=interpret,
        name="gated_product_backward",
    )(a, b, dh)
