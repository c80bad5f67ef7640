"""One of two CPU processes that save a state sharded over both, then restore it resharded.

    python tests/checkpointer_multiprocess_script.py PROCESS_ID DIR PORT [HOST_MEMORY_KIND]

Each process has 4 fake devices (the caller sets XLA_FLAGS); together they form an
fsdp=8 mesh. The state is saved, then restored onto a 2x4 mesh, and every shard this
process holds is compared with the NumPy values it was built from. HOST_MEMORY_KIND (e.g.
numpy) sets the storage's `host_memory_kind`.
"""

import os
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")

# pylint: disable=wrong-import-position
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from axlearn.common.checkpointer import Checkpointer, TensorStoreStateStorage
from axlearn.common.sharding import create_mesh

WEIGHTS = np.arange(16 * 12, dtype=np.float32).reshape(16, 12) / 7
REPLICATED = np.arange(3, dtype=np.float32)


def main() -> None:
    process_id, directory, port = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    host_memory_kind = sys.argv[4] if len(sys.argv) > 4 else None
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    assert jax.device_count() == 8 and jax.local_device_count() == 4

    mesh = create_mesh((8,), ("fsdp",))
    state = {
        "w": jax.make_array_from_callback(
            WEIGHTS.shape, NamedSharding(mesh, PartitionSpec("fsdp", None)), lambda i: WEIGHTS[i]
        ),
        "r": jax.make_array_from_callback(
            REPLICATED.shape, NamedSharding(mesh, PartitionSpec()), lambda i: REPLICATED[i]
        ),
    }
    storage = TensorStoreStateStorage.default_config().set(host_memory_kind=host_memory_kind)
    cfg = Checkpointer.default_config().set(name="checkpointer", dir=directory, storage=storage)
    with cfg.instantiate(parent=None) as checkpointer:
        checkpointer.save(1, state, extra={"processes": 2})
        checkpointer.wait_until_finished()
        # Only process 0 commits; the others learn of it through this barrier.
        multihost_utils.sync_global_devices("checkpoint committed")

        mesh_2x4 = create_mesh((2, 4), ("data", "fsdp"))
        w_sharding = NamedSharding(mesh_2x4, PartitionSpec("fsdp", "data"))
        r_sharding = NamedSharding(mesh_2x4, PartitionSpec())
        template = {
            "w": jax.ShapeDtypeStruct(WEIGHTS.shape, jnp.float32, sharding=w_sharding),
            "r": jax.ShapeDtypeStruct(REPLICATED.shape, jnp.float32, sharding=r_sharding),
        }
        step, restored, extra = checkpointer.restore(state=template)
    assert step == 1 and extra == {"processes": 2}, (step, extra)
    for name, reference in (("w", WEIGHTS), ("r", REPLICATED)):
        for shard in restored[name].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), reference[shard.index])
    print(f"process {process_id} restored", flush=True)


if __name__ == "__main__":
    main()
