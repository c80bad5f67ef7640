"""Pallas (Triton) kernels for two backward passes on GPU: the gated MLP's and RMSNorm's.

The elementwise work of a transformer step is limited by memory bandwidth, so its cost
is the number of times each [tokens, hidden] tensor crosses HBM. Inside a whole train
step XLA emits the two input cotangents of h = act0(a) * act1(b) as two kernels, each
re-reading the hidden activations (gpt_1b on an H100: 9.6 ms a step); the kernel here
reads a, b and dh once and writes both (docs/benchmarks.md). An RMSNorm's backward
needs a sum over each row before any of the row's outputs, which XLA emits as a
reduction pass and an elementwise pass that read the row twice; the norm kernel holds
whole rows and reads each input once.

They run with `interpret=True` on any backend, which is how the tests check them on the
CPU. `layers.gated_product` and `layers.RMSNorm.residual_and_norm` ask `kernel_mode`
whether to use them or plain XLA; on a mesh of several devices they run per device under
`shard_map`.

They compile through Pallas's Triton backend, which jax 0.11 deprecates (Mosaic GPU is its
successor) and a later jax will remove. Where it no longer imports, `kernel_mode` keeps
every layer on plain XLA (the same results; gpt_1b ~2% slower on an H100 by the kernels'
recorded gains in docs/benchmarks.md), and the kernels still run interpreted.
"""

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # A jax without Pallas's Triton backend: no compiled kernels.
    plgpu = None

from axlearn.common.base_layer import MeshAxes
from axlearn.common.module import Tensor
from axlearn.common.sharding import axis_names, current_mesh_axes, local_shape, mesh_partition_spec

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


def _several_devices() -> bool:
    """Whether the current mesh (`jax.set_mesh`) has more than one device."""
    return math.prod(current_mesh_axes().values()) > 1


def _rows(t: Tensor) -> Tensor:
    """[..., hidden] -> [rows, hidden], the layout the kernels take."""
    return t.reshape(-1, t.shape[-1])


def kernel_mode(
    a: Tensor,
    partition_spec: Optional[MeshAxes] = None,
    *,
    fits: Callable[[Sequence[int]], bool],
) -> Optional[bool]:
    """How a layer should take the backward of `a` ([..., hidden]): None for plain XLA,
    else the kernel's `interpret` flag. `fits(block)` says whether the kernel takes each
    device's block of `a` (`supported`, `rms_norm_supported`).

    A Pallas call is opaque to XLA's SPMD partitioner, which would gather a sharded input
    onto every device first; on a mesh of several devices the kernel therefore runs per
    device under `shard_map`, and only where `partition_spec` says how `a` is split.
    """
    if _several_devices() and (partition_spec is None or len(partition_spec) != a.ndim):
        return None
    spec = mesh_partition_spec(partition_spec or (None,) * a.ndim)
    block = local_shape(a.shape, spec)
    if block is None or not fits(block):
        return None
    if _interpret_everywhere:
        return True
    return False if compiled_kernels_available() else None


def compiled_kernels_available() -> bool:
    """Whether the kernels can compile here: a GPU, and a jax with Pallas's Triton backend."""
    return plgpu is not None and jax.devices()[0].platform == "gpu"


def _compiler_params(num_warps: int, interpret: bool) -> Optional["plgpu.CompilerParams"]:
    # Interpreted kernels need no Triton parameters, so they run whatever jax has.
    return None if interpret else plgpu.CompilerParams(num_warps=num_warps)


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
        da, db = gated_product_backward(
            cotangents, _rows(a_), _rows(b_), _rows(dh_), interpret=interpret
        )
        return da.reshape(a_.shape), db.reshape(b_.shape)

    if not _several_devices():
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
        compiler_params=_compiler_params(num_warps, interpret),
        interpret=interpret,
        name="gated_product_backward",
    )(a, b, dh)


# ----- RMSNorm's backward -----

# Elements of rows a program holds at once (gpt_1b: 2 rows of 2048), and of the rows it
# walks through, summing the scale's gradient on the way so that it writes one partial
# sum (gpt_1b: 64 rows); warps. Chosen on an H100 with benchmarks/norm_check.py
# (docs/benchmarks.md).
_NORM_BLOCK_ELEMENTS = 4096
_NORM_PROGRAM_ELEMENTS = 131072
_NORM_NUM_WARPS = 8
# The widest row a program holds: a few [rows, hidden] float32 tiles in registers.
_NORM_MAX_HIDDEN = 8192


def _norm_rows(hidden: int) -> tuple[int, int]:
    """(rows a program holds at once, rows a program walks through) for rows of `hidden`."""
    block_rows = max(1, _NORM_BLOCK_ELEMENTS // hidden)
    return block_rows, max(block_rows, _NORM_PROGRAM_ELEMENTS // hidden)


def rms_norm_supported(shape: Sequence[int]) -> bool:
    """Whether the norm kernel takes an array of `shape` ([..., hidden]) whole rows at a time."""
    hidden, rows = shape[-1], math.prod(shape[:-1])
    return (
        len(shape) >= 2
        and hidden & (hidden - 1) == 0
        and hidden <= _NORM_MAX_HIDDEN
        and rows % _norm_rows(hidden)[0] == 0
    )


def sharded_rms_norm_backward(
    x: Tensor,
    scale: Tensor,
    dys: Sequence[Tensor],
    dresidual: Tensor,
    *,
    eps: float,
    partition_spec: Optional[MeshAxes],
    interpret: bool = False,
) -> tuple[Tensor, Tensor]:
    """`rms_norm_backward` for [..., hidden] arrays split by `partition_spec` over the
    current mesh (None: unsplit; the hidden axis must not be split): each device runs the
    kernel on its own rows, and the scale's gradient is summed over the devices."""

    def local(x_, scale_, dres_, *dys_):
        dx, dscale = rms_norm_backward(
            _rows(x_), scale_, [_rows(t) for t in dys_], _rows(dres_), eps=eps, interpret=interpret
        )
        return dx.reshape(x_.shape), dscale

    if not _several_devices():
        return local(x, scale, dresidual, *dys)
    spec = mesh_partition_spec(partition_spec)
    row_axes = tuple(name for entry in spec[:-1] for name in axis_names(entry))

    def summed(*args):
        dx, dscale = local(*args)
        return dx, jax.lax.psum(dscale, row_axes) if row_axes else dscale

    replicated = PartitionSpec()
    return jax.shard_map(
        summed,
        in_specs=(spec, replicated, spec) + (spec,) * len(dys),
        out_specs=(spec, replicated),
        check_vma=False,
    )(x, scale, dresidual, *dys)


def rms_norm_backward(
    x: Tensor,
    scale: Tensor,
    dys: Sequence[Tensor],
    dresidual: Tensor,
    *,
    eps: float,
    block_rows: Optional[int] = None,
    rows_per_program: Optional[int] = None,
    num_warps: int = _NORM_NUM_WARPS,
    interpret: bool = False,
) -> tuple[Tensor, Tensor]:
    """The input and scale gradients of a pre-norm block's `x` ([rows, hidden]), in one pass.

    For y = x * r * scale with r = rsqrt(mean(x^2) + eps) over each row, read by several
    consumers (dy, the sum of `dys`, one a consumer), and x also feeding the block's
    residual add (whose gradient is `dresidual`):

        dx = dresidual + r * scale * dy - x * r^3 * mean(scale * dy * x)
        dscale = sum over rows of dy * x * r

    computed in float32 from rows read once. dx has x's dtype, dscale scale's.
    `block_rows` and `rows_per_program` default to `_norm_rows(hidden)`.
    """
    rows, hidden = x.shape
    default_block_rows, default_per_program = _norm_rows(hidden)
    block_rows = block_rows or default_block_rows
    per_program = math.gcd(rows, rows_per_program or default_per_program)
    if per_program % block_rows:
        raise ValueError(f"rms_norm_backward: {rows} rows do not split into blocks of {block_rows}")
    steps = per_program // block_rows
    programs = rows // per_program

    def kernel(x_ref, scale_ref, dres_ref, *refs):
        dy_refs, (dx_ref, dscale_ref) = refs[:-2], refs[-2:]
        gamma = scale_ref[...].astype(jnp.float32)

        def step(i, dscale):
            block = (pl.ds(i * block_rows, block_rows), slice(None))
            x_, dres_ = (ref[block].astype(jnp.float32) for ref in (x_ref, dres_ref))
            dy_ = sum(ref[block].astype(jnp.float32) for ref in dy_refs)
            r = jax.lax.rsqrt(jnp.mean(x_ * x_, axis=1, keepdims=True) + eps)
            g = dy_ * gamma
            c = jnp.mean(g * x_, axis=1, keepdims=True) * r * r * r
            dx_ref[block] = (dres_ + r * g - x_ * c).astype(dx_ref.dtype)
            return dscale + jnp.sum(dy_ * x_ * r, axis=0)

        dscale = jax.lax.fori_loop(0, steps, step, jnp.zeros((hidden,), jnp.float32))
        dscale_ref[...] = dscale[None, :]

    rows_spec = pl.BlockSpec((per_program, hidden), lambda i: (i, 0))
    dx, partial = pl.pallas_call(
        kernel,
        grid=(programs,),
        in_specs=[rows_spec, pl.BlockSpec((hidden,), lambda i: (0,)), rows_spec]
        + [rows_spec] * len(dys),
        out_specs=[rows_spec, pl.BlockSpec((1, hidden), lambda i: (i, 0))],
        out_shape=[
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct((programs, hidden), jnp.float32),
        ],
        compiler_params=_compiler_params(num_warps, interpret),
        interpret=interpret,
        name="rms_norm_backward",
    )(x, scale, dresidual, *dys)
    return dx, jnp.sum(partial, axis=0).astype(scale.dtype)
