"""Saves a state sharded over one mesh, or restores it onto another (run as a subprocess).

    python tests/checkpointer_mesh_script.py save DIR REFERENCE.npz
    python tests/checkpointer_mesh_script.py save_numpy DIR REFERENCE.npz
    python tests/checkpointer_mesh_script.py restore_1 DIR OUT.npz
    python tests/checkpointer_mesh_script.py restore_2x4 DIR OUT.npz

`save` needs 8 devices and shards the state with fsdp=8; the reference values come from
REFERENCE.npz (written by the test with NumPy). `save_numpy` saves the same with the
shards copied into numpy arrays (`host_memory_kind='numpy'`) instead of pinned host
memory. `restore_*` write the restored values (bfloat16 as float32, PRNG keys as their
key data) and each leaf's per-device shard shapes to OUT.npz. The caller sets XLA_FLAGS
to choose the fake device count.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
from axlearn.common.checkpointer import Checkpointer, TensorStoreStateStorage
from axlearn.common.sharding import create_mesh

# Leaf -> (dtype, fsdp=8 spec for saving, 2x4 spec for restoring).
LAYOUT = {
    "w": (jnp.float32, PartitionSpec("fsdp", None), PartitionSpec("data", "fsdp")),
    "emb": (jnp.bfloat16, PartitionSpec(None, "fsdp"), PartitionSpec("fsdp", "data")),
    "counts": (jnp.int32, PartitionSpec("fsdp"), PartitionSpec(("data", "fsdp"))),
    "odd": (jnp.float32, PartitionSpec(), PartitionSpec(None, "data")),
    "scalar": (jnp.float32, PartitionSpec(), PartitionSpec()),
}


def _checkpointer(directory: str, host_memory_kind=None) -> Checkpointer:
    storage = TensorStoreStateStorage.default_config().set(host_memory_kind=host_memory_kind)
    cfg = Checkpointer.default_config().set(name="checkpointer", dir=directory, storage=storage)
    return cfg.instantiate(parent=None)


def save(directory: str, reference: str, host_memory_kind=None) -> None:
    assert jax.device_count() == 8, jax.devices()
    mesh = create_mesh((8,), ("fsdp",))
    values = np.load(reference)
    state = {
        name: jax.device_put(values[name].astype(dtype), NamedSharding(mesh, save_spec))
        for name, (dtype, save_spec, _) in LAYOUT.items()
    }
    key = jax.random.wrap_key_data(values["key"], impl="threefry2x32")
    state["key"] = jax.device_put(key, NamedSharding(mesh, PartitionSpec()))
    with _checkpointer(directory, host_memory_kind) as checkpointer:
        checkpointer.save(3, state, extra={"mesh": "fsdp=8"})


def restore(directory: str, out: str, mesh_shape: tuple[int, ...]) -> None:
    if mesh_shape == (1,):
        assert jax.device_count() == 1, jax.devices()
        device = SingleDeviceSharding(jax.devices()[0])
        shardings = {name: device for name in list(LAYOUT) + ["key"]}
    else:
        mesh = create_mesh(mesh_shape, ("data", "fsdp"))
        shardings = {name: NamedSharding(mesh, spec) for name, (_, _, spec) in LAYOUT.items()}
        shardings["key"] = NamedSharding(mesh, PartitionSpec())
    shapes = {"w": (16, 12), "emb": (8, 24), "counts": (32,), "odd": (5, 4), "scalar": ()}
    template = {
        name: jax.ShapeDtypeStruct(shapes[name], dtype, sharding=shardings[name])
        for name, (dtype, _, _) in LAYOUT.items()
    }
    template["key"] = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=shardings["key"])
    with _checkpointer(directory) as checkpointer:
        step, state, extra = checkpointer.restore(state=template)
    assert step == 3 and extra == {"mesh": "fsdp=8"}, (step, extra)
    result = {}
    for name, value in state.items():
        assert value.sharding == shardings[name], (name, value.sharding)
        if name == "key":
            value = jax.random.key_data(value)
        if value.dtype == jnp.bfloat16:
            value = value.astype(jnp.float32)  # Exact; npz has no bfloat16.
        result[name] = np.asarray(value)
        result[f"{name}.shard_shapes"] = np.array([s.data.shape for s in value.addressable_shards])
    np.savez(out, **result)


if __name__ == "__main__":
    mode, directory, path = sys.argv[1:4]
    if mode == "save":
        save(directory, path)
    elif mode == "save_numpy":
        save(directory, path, host_memory_kind="numpy")
    elif mode == "restore_1":
        restore(directory, path, (1,))
    elif mode == "restore_2x4":
        restore(directory, path, (2, 4))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
