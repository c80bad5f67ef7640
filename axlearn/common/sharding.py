"""Meshes and sharding constraints over logical mesh axes.

Layers name mesh axes in their partition specs ('data', 'fsdp', 'model', ...). The
trainer builds one `jax.sharding.Mesh` with Auto axes (XLA's SPMD partitioner places the
collectives) and sets it as the current mesh; `maybe_shard` then constrains activations
where the spec says so, and does nothing when no mesh is set (single-device tests).
"""

import math
from collections.abc import Sequence
from typing import Any, Optional, Union

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MeshAxes = Sequence[Optional[Union[str, Sequence[str]]]]


def create_mesh(
    mesh_shape: Sequence[int],
    axis_names: Sequence[str],
    devices: Optional[Sequence[Any]] = None,
) -> Mesh:
    """A mesh with Auto axes over `devices` (default: all), in the order jax lists them."""
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(mesh_shape)
    if int(np.prod(shape)) != len(devices):
        raise ValueError(f"Mesh shape {shape} needs {int(np.prod(shape))} devices, have {len(devices)}")
    try:
        device_array = jax.experimental.mesh_utils.create_device_mesh(shape, devices=devices)
    except Exception:  # pylint: disable=broad-except
        # Device layouts the helper does not know (e.g. fake CPU devices): plain order.
        device_array = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(device_array, tuple(axis_names), axis_types=(AxisType.Auto,) * len(shape))


def current_mesh_axes() -> dict[str, int]:
    """Axis name -> size of the mesh set with `jax.set_mesh`, or {} when there is none."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return {}
    return dict(mesh.shape)


def axis_names(entry: Optional[Union[str, Sequence[str]]]) -> tuple[str, ...]:
    """The mesh axes one partition-spec entry names: None -> (), 'a' -> ('a',)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _known_axes(entry: Optional[Union[str, Sequence[str]]], known: Any) -> tuple[str, ...]:
    """The axes `entry` names that `known` (axis name -> size) has, in the order given."""
    return tuple(name for name in axis_names(entry) if name in known)


def batch_axes(mesh: Mesh, names: Optional[Union[str, Sequence[str]]]) -> tuple[str, ...]:
    """The axes among `names` that `mesh` has, in the order given: those a batch
    dimension is split over (axes the mesh lacks are ignored)."""
    return _known_axes(names, mesh.shape)


def batch_shards(mesh: Mesh, names: Optional[Union[str, Sequence[str]]]) -> int:
    """Into how many parts `mesh` splits a batch dimension over `names`."""
    return math.prod(mesh.shape[name] for name in batch_axes(mesh, names))


def microbatch_count(rows_per_device: int, microbatch: int) -> Optional[int]:
    """In how many microbatches of `microbatch` rows a device runs its `rows_per_device`:
    1 when they fit at once; None when `microbatch` does not divide them."""
    if rows_per_device <= microbatch:
        return 1
    if rows_per_device % microbatch:
        return None
    return rows_per_device // microbatch


def global_batch(
    local_batch: Any, mesh: Mesh, names: Optional[Union[str, Sequence[str]]], *, path: str
) -> Any:
    """This process's rows of a batch (a tree of NumPy arrays) as global `jax.Array`s on
    `mesh`: the leading dimension split over the batch axes `names`, the rows of all
    processes stacked in process order; scalars are replicated.

    Raises:
        ValueError: naming `path` (the trainer's or evaler's config path) when the global
            rows do not split evenly over the batch axes.
    """
    axes = batch_axes(mesh, names)
    num_shards = batch_shards(mesh, names)

    def to_global(x: Any) -> jax.Array:
        x = np.asarray(x)
        if x.ndim:
            global_rows = x.shape[0] * jax.process_count()
            if global_rows % num_shards:
                raise ValueError(
                    f"{path}: a batch of {global_rows} rows cannot be split over mesh axes "
                    f"{axes} ({num_shards} shards); make the batch size a multiple of "
                    f"{num_shards} or set {path}.batch_axis_names"
                )
        return jax.make_array_from_process_local_data(_batch_sharding(mesh, axes, x.ndim), x)

    return jax.tree_util.tree_map(to_global, local_batch)


def global_batch_spec(
    element_spec: Any, mesh: Mesh, names: Optional[Union[str, Sequence[str]]]
) -> Any:
    """What `global_batch` makes of batches of `element_spec` (an input's global shapes and
    dtypes, `jax.ShapeDtypeStruct`s), without a batch: the same shapes and dtypes with the
    shardings it gives them."""
    axes = batch_axes(mesh, names)
    return jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(
            s.shape, s.dtype, sharding=_batch_sharding(mesh, axes, len(s.shape))
        ),
        element_spec,
    )


def _batch_sharding(mesh: Mesh, axes: Sequence[str], ndim: int) -> NamedSharding:
    """A batch array's sharding: rows split over the batch `axes`; a scalar replicated."""
    if ndim == 0:
        return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, PartitionSpec(axes or None, *([None] * (ndim - 1))))


def _filter_axes(spec: MeshAxes, known: dict[str, int]) -> PartitionSpec:
    """Drops axis names the current mesh lacks, so one config serves every mesh."""

    def keep(entry):
        names = _known_axes(entry, known)
        if not names:
            return None
        return names[0] if len(names) == 1 else names

    return PartitionSpec(*[keep(e) for e in spec])


def mesh_partition_spec(spec: MeshAxes) -> PartitionSpec:
    """`spec` for the mesh set with `jax.set_mesh`: axis names it lacks are dropped."""
    return _filter_axes(spec, current_mesh_axes())


def _parts(shape: Sequence[int], spec: MeshAxes, sizes: dict[str, int]) -> list[int]:
    """Into how many parts `spec` splits each dim of `shape` over a mesh of axis `sizes`
    (axes the mesh lacks split nothing)."""
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    return [math.prod(sizes[n] for n in _known_axes(e, sizes)) for e in entries[: len(shape)]]


def local_shape(shape: Sequence[int], spec: PartitionSpec) -> Optional[tuple[int, ...]]:
    """Each device's block of an array of `shape` split by `spec` over the current mesh, or
    None where an axis does not divide evenly."""
    parts = _parts(shape, spec, current_mesh_axes())
    if any(dim % n for dim, n in zip(shape, parts)):
        return None
    return tuple(dim // n for dim, n in zip(shape, parts))


def indivisible_dim(shape: Sequence[int], spec: MeshAxes, sizes: dict[str, int]) -> Optional[str]:
    """Where `spec` cannot split an array of `shape` evenly over a mesh of axis `sizes`: the
    first such dim, in words; None where every dim divides."""
    for dim, (size, parts, entry) in enumerate(zip(shape, _parts(shape, spec, sizes), spec)):
        if size % parts:
            axes = _known_axes(entry, sizes)
            return f"dim {dim} ({size}) over {' x '.join(axes)} ({parts} parts)"
    return None


def maybe_shard(x: jax.Array, spec: Optional[MeshAxes]) -> jax.Array:
    """`with_sharding_constraint(x, spec)` when a mesh is set and `spec` is given."""
    if spec is None:
        return x
    known = current_mesh_axes()
    if not known:
        return x
    if len(spec) != x.ndim:
        raise ValueError(f"Partition spec {tuple(spec)} has {len(spec)} entries for a {x.ndim}-D tensor")
    return jax.lax.with_sharding_constraint(x, _filter_axes(spec, known))


def gathered_for_matmul(weight: jax.Array, spec: Optional[MeshAxes]) -> jax.Array:
    """A weight about to be multiplied, on a mesh where XLA needs its FSDP all-gather
    spelled out: constrained to the 'model' entries of its partition spec `spec`.

    XLA's SPMD partitioner (jax 0.10.2 and 0.11.2, with Shardy or GSPMD, seen on fake CPU
    devices; the pass is the same on GPU) partitions
    x[batch over ('data', 'fsdp'), ..., 'model'] @ w['model', 'fsdp'] wrong on some meshes
    that split the batch over two axes and 'model' over a third (data=2 x fsdp=2 x model=2,
    data=4 x fsdp=2 x model=2, data=2 x expert=2 x model=2 among those tried): it swaps x's
    batch blocks between devices and never swaps the product back, in plain JAX too. With
    the weight gathered first the partition is right (tests/test_attention.py's sharded
    test). Only meshes with 'model' and two other axes above 1 take this path, so the
    programs of every other mesh (single device, FSDP, FSDP x model) stay as they were.
    """
    axes = current_mesh_axes()
    others_split = sum(size > 1 for name, size in axes.items() if name != "model")
    if spec is None or axes.get("model", 1) == 1 or others_split < 2:
        return weight
    return maybe_shard(weight, ["model" if "model" in axis_names(e) else None for e in spec])


def whole_heads_if_uneven(x: jax.Array, *, axis: int) -> jax.Array:
    """`x` with its heads dim `axis` whole on every 'model' shard where the 'model' axis does
    not divide it (grouped-query attention with fewer key/value heads than 'model' shards);
    its other dims are left to the partitioner.

    Left to itself, XLA splits such a dim unevenly (padded), and on a mesh that also splits
    'seq' it computed the keys' and values' gradients wrong (4 query and 2 key/value heads
    on seq=2 x model=4 fake CPU devices, jax 0.10.2 and 0.11.2; the forward was right).
    Kept whole, the step is right (tests/test_attention.py's sharded test); where 'model'
    divides the heads nothing changes.
    """
    model = current_mesh_axes().get("model", 1)
    if model == 1 or x.shape[axis] % model == 0:
        return x
    spec = [PartitionSpec.UNCONSTRAINED] * x.ndim
    spec[axis] = None
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))


def named_sharding(mesh: Mesh, spec: MeshAxes) -> NamedSharding:
    return NamedSharding(mesh, _filter_axes(spec, dict(mesh.shape)))
