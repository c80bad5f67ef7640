"""Grouped matmul: rows sorted by group, each group's rows times its own matrix (the
experts of a mixture of experts).

`grouped_matmul(x, w, group_sizes)` is `jax.lax.ragged_dot(x, w, group_sizes)` for x
[rows, k] whose first group_sizes[0] rows belong to group 0, the next group_sizes[1] to
group 1, and so on, and w [groups, k, n]; rows past the last group come out zero.

XLA's own ragged dot on GPUs (jax 0.10 and 0.11) multiplies densely by every group's
matrix, num_groups times the FLOPs. On a Hopper GPU, with `use_kernels`, the forward
product and both products of the backward pass run as grouped GEMMs instead: jax's
Mosaic GPU kernels (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu` for x @ w and
dy @ w^T, `transposed_ragged_dot_mgpu` for each group's x^T @ dy). They take bf16 or f16
operands whose dims are multiples of their tiles; elsewhere `jax.lax.ragged_dot` runs.
The kernels are opaque to XLA's partitioner: on a mesh of several devices call this
under `shard_map`.
"""

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from axlearn.common.module import Tensor


@dataclasses.dataclass(frozen=True)
class Tiling:
    """The Mosaic GPU kernels' tiles (rows, output columns, contraction) and pipelining;
    jax's `python -m jax.experimental.pallas.ops.gpu.ragged_dot_mgpu` searches them."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 1


# (x [rows, k], w [groups, k, n], *, group_sizes) -> [rows, n]; with transpose_rhs, w is
# [groups, n, k]. And (x [rows, k], dy [rows, n], *, group_sizes) -> [groups, k, n].
RaggedDot = Callable[..., Tensor]


@dataclasses.dataclass(frozen=True)
class _Kernels:
    ragged_dot: RaggedDot
    transposed_ragged_dot: RaggedDot


def _rows_in_groups(y: Tensor, group_sizes: Tensor) -> Tensor:
    """y with its rows past the last group set to zero (the kernels leave them unset)."""
    in_groups = jnp.arange(y.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(in_groups[:, None], y, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_matmul_with(x: Tensor, w: Tensor, group_sizes: Tensor, kernels: _Kernels) -> Tensor:
    """grouped_matmul through `kernels`: one ragged dot forward, two backward."""
    return _rows_in_groups(kernels.ragged_dot(x, w, group_sizes=group_sizes), group_sizes)


def _grouped_matmul_fwd(x, w, group_sizes, kernels):
    return _grouped_matmul_with(x, w, group_sizes, kernels), (x, w, group_sizes)


def _grouped_matmul_bwd(kernels, residuals, dy):
    x, w, group_sizes = residuals
    dy = dy.astype(x.dtype)
    dx = kernels.ragged_dot(dy, w, group_sizes=group_sizes, transpose_rhs=True)
    dw = kernels.transposed_ragged_dot(x, dy, group_sizes=group_sizes)
    dx = _rows_in_groups(dx, group_sizes)
    return dx, dw.astype(w.dtype), None


_grouped_matmul_with.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


@functools.cache
def _mosaic_gpu_modules() -> Optional[tuple[Any, Any]]:
    """jax's Mosaic GPU ragged-dot modules, or None where this jax lacks them."""
    try:
        # pylint: disable-next=import-outside-toplevel
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    except ImportError:
        return None
    return ragged_dot_mgpu, transposed_ragged_dot_mgpu


def on_hopper() -> bool:
    """Whether jax's first device is a Hopper GPU (compute capability 9.x)."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    return device.platform == "gpu" and capability is not None and str(capability).startswith("9.")


def kernels_fit(x_shape: Sequence[int], w_shape: Sequence[int], dtype: Any, tiling: Tiling) -> bool:
    """Whether the Mosaic GPU kernels run here on x [rows, k] and w [groups, k, n]."""
    _, k, n = w_shape
    return (
        jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and k % tiling.block_k == 0
        and k % (tiling.block_n * tiling.grid_block_n) == 0  # The backward's dx has k columns ...
        and k % tiling.block_m == 0  # ... and its weight gradient k rows.
        and n % (tiling.block_n * tiling.grid_block_n) == 0
        and n % tiling.block_k == 0
        and x_shape[0] % tiling.block_k == 0  # The weight gradient contracts over rows.
        and on_hopper()
        and _mosaic_gpu_modules() is not None
    )


def mosaic_gpu_kernels(tiling: Tiling) -> _Kernels:
    """The Mosaic GPU kernels with `tiling` (see kernels_fit for where they run)."""
    forward, transposed = _mosaic_gpu_modules()
    params = dataclasses.asdict(tiling)
    return _Kernels(
        ragged_dot=functools.partial(forward.ragged_dot, **params),
        transposed_ragged_dot=functools.partial(transposed.transposed_ragged_dot, **params),
    )


def grouped_matmul(
    x: Tensor,
    w: Tensor,
    group_sizes: Tensor,
    *,
    use_kernels: bool = False,
    tiling: Tiling = Tiling(),
) -> Tensor:
    """x [rows, k] (sorted by group) times w [groups, k, n] per group: [rows, n], zero past
    the groups. With `use_kernels`, the Mosaic GPU kernels where they fit (module doc)."""
    if use_kernels and kernels_fit(x.shape, w.shape, x.dtype, tiling):
        return _grouped_matmul_with(x, w.astype(x.dtype), group_sizes, mosaic_gpu_kernels(tiling))
    return _rows_in_groups(jax.lax.ragged_dot(x, w, group_sizes), group_sizes)
