"""When a layer runs a kernel: compiled on a GPU, interpreted (tests), or not at all.

The kernels compile through Pallas's Triton backend, which jax 0.11 deprecates (Mosaic GPU
is its successor) and a later jax will remove. Where it does not import, `kernel_mode`
keeps every layer on plain XLA (the same results, a little slower), and the kernels
still run interpreted, which is how the tests check them on the CPU.

Nothing here imports Pallas: the kernel modules import it when they build a kernel, so
importing the layers loads no Pallas or Triton module.
"""

import contextlib
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Optional

import jax

from axlearn.common.module import Tensor
from axlearn.common.sharding import MeshAxes, current_mesh_axes, local_shape, mesh_partition_spec

# Set by `interpreted()`: the layers call the kernels in interpret mode on any backend.
_interpret_everywhere = False


@contextlib.contextmanager
def interpreted():
    """Within it, the layers use the kernels on any backend, interpreted (for tests)."""
    global _interpret_everywhere
    before, _interpret_everywhere = _interpret_everywhere, True
    try:
        yield
    finally:
        _interpret_everywhere = before


def several_devices() -> bool:
    """Whether the current mesh (`jax.set_mesh`) has more than one device."""
    return math.prod(current_mesh_axes().values()) > 1


def rows(t: Tensor) -> Tensor:
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
    device's block of `a` (`gated_product_supported`, `rms_norm_supported`).

    A Pallas call is opaque to XLA's SPMD partitioner, which would gather a sharded input
    onto every device first; on a mesh of several devices the kernel therefore runs per
    device under `shard_map`, and only where `partition_spec` says how `a` is split.
    """
    if several_devices() and (partition_spec is None or len(partition_spec) != a.ndim):
        return None
    spec = mesh_partition_spec(partition_spec or (None,) * a.ndim)
    block = local_shape(a.shape, spec)
    if block is None or not fits(block):
        return None
    return interpret_flag()


def interpret_flag() -> Optional[bool]:
    """A kernel's `interpret` flag where its layer takes it: True within `interpreted()`,
    False where it compiles (`compiled_kernels_available`), else None (plain XLA)."""
    if _interpret_everywhere:
        return True
    return False if compiled_kernels_available() else None


def compiled_kernels_available() -> bool:
    """Whether the kernels can compile here: a GPU, and a jax with Pallas's Triton backend."""
    return jax.devices()[0].platform == "gpu" and pallas_triton() is not None


@functools.cache
def pallas_triton() -> Any:
    """jax.experimental.pallas.triton, or None in a jax without it."""
    try:
        from jax.experimental.pallas import triton  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None
    return triton


def compiler_params(num_warps: int, interpret: bool, *, num_stages: Optional[int] = None) -> Any:
    """A kernel's Triton compiler parameters (num_stages None: Triton's default); None when
    interpreted, which needs no Triton."""
    if interpret:
        return None
    triton = pallas_triton()
    if triton is None:
        raise RuntimeError(
            f"jax {jax.__version__} has no Pallas Triton backend to compile the kernel; "
            "run it with interpret=True"
        )
    if num_stages is None:
        return triton.CompilerParams(num_warps=num_warps)
    return triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
