"""How long a checkpoint save stalls the train loop, and how long until it is committed.

    PYTHONPATH=. python tools/checkpoint_check.py [--size 1e9] [--dir /tmp/ckpt_bench] \
        [--host_memory_kind=numpy]

Builds a float32 state of `--size` parameters (split into `--leaves` arrays of 4096
columns, sharded over all local devices along their rows, as fsdp would), then saves it
`--repeats` times, with a step between saves that replaces the state by a new one and
donates the old buffers, as a train step does. (Saving the same arrays again would time
nothing: jax keeps an array's host copy once made, so a second save of it does not copy.)
"blocks" is how long `save()` kept the caller (the device-to-host copy); "committed" is
until the index was written; the last column is the write throughput. A final restore
of the last state saved, into the same shardings, is timed too. `--host_memory_kind`
sets the storage's `host_memory_kind` (where `save()` copies the shards): by default
pinned host memory, or `numpy` for new numpy arrays.
"""

import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax.sharding import NamedSharding, PartitionSpec

from axlearn.common.checkpointer import Checkpointer, TensorStoreStateStorage
from axlearn.common.command_flags import parse_command_flags
from axlearn.common.sharding import create_mesh

_COLUMNS = 4096


def build_state(size: float, leaves: int, dtype: jnp.dtype) -> dict[str, jax.Array]:
    """`leaves` arrays of about `size` parameters in all, made on the devices."""
    mesh = create_mesh((jax.device_count(),), ("fsdp",))
    sharding = NamedSharding(mesh, PartitionSpec("fsdp", None))
    rows = max(1, round(size / leaves / _COLUMNS / jax.device_count())) * jax.device_count()

    def make(seed):
        return jax.random.normal(jax.random.PRNGKey(seed), (rows, _COLUMNS), dtype)

    make = jax.jit(make, static_argnums=0, out_shardings=sharding)
    state = {f"layer_{i:02d}": make(i) for i in range(leaves)}
    jax.block_until_ready(state)
    return state


def define_flags(flag_values: flags.FlagValues) -> None:
    """The check's flags."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_float("size", 1e9, "Parameters in the state.", **fv)
    flags.DEFINE_integer("leaves", 8, "Arrays the state is split into.", **fv)
    flags.DEFINE_string("dtype", "float32", "The state's dtype.", **fv)
    flags.DEFINE_integer("repeats", 3, "Saves timed.", **fv)
    flags.DEFINE_string("dir", None, "Default: a new temporary directory.", **fv)
    flags.DEFINE_bool("keep", False, "Keep the checkpoint files.", **fv)
    flags.DEFINE_string(
        "host_memory_kind", None,
        "A host memory kind of the devices, or 'numpy' (default: the storage's, pinned_host).",
        **fv,
    )


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command line `argv` (None: sys.argv's) run."""
    args, _ = parse_command_flags(
        define_flags, argv, program="tools/checkpoint_check.py",
        doc=f"usage: checkpoint_check.py [flags]\n\n{__doc__}",
    )

    directory = args.dir or tempfile.mkdtemp(prefix="ckpt_bench_")
    state = build_state(args.size, args.leaves, jnp.dtype(args.dtype))
    params = sum(x.size for x in state.values())
    gigabytes = sum(x.nbytes for x in state.values()) / 1e9
    devices = jax.devices()
    print(f"state: {params / 1e9:.3f}B params, {gigabytes:.2f} GB {args.dtype}, "
          f"{len(devices)} x {devices[0].device_kind}; dir {directory}; "
          f"host copies: {args.host_memory_kind or 'pinned_host (default)'}")

    storage = TensorStoreStateStorage.default_config().set(host_memory_kind=args.host_memory_kind)
    cfg = Checkpointer.default_config().set(
        name="checkpointer", dir=directory, keep_last_n=1, storage=storage
    )
    checkpointer = cfg.instantiate(parent=None)
    train_step = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
    rows = []
    try:
        for step in range(1, args.repeats + 1):
            if step > 1:
                state = jax.block_until_ready(train_step(state))
            start = time.perf_counter()
            checkpointer.save(step, state)
            returned = time.perf_counter()
            checkpointer.wait_until_finished()
            committed = time.perf_counter()
            rows.append((step, returned - start, committed - start))
        template = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()
        }
        start = time.perf_counter()
        _, restored, _ = checkpointer.restore(state=template)
        jax.block_until_ready(restored)
        restore_s = time.perf_counter() - start
        same = all(bool(jnp.array_equal(restored[k], state[k])) for k in state)
    finally:
        checkpointer.stop()
        if not args.keep and args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)

    print(f"{'save':>4}  {'blocks (s)':>10}  {'committed (s)':>13}  {'write GB/s':>10}")
    for step, blocks, committed in rows:
        print(f"{step:>4}  {blocks:>10.3f}  {committed:>13.3f}  {gigabytes / committed:>10.2f}")
    print(f"median: blocks {np.median([r[1] for r in rows]):.3f} s, "
          f"committed {np.median([r[2] for r in rows]):.3f} s")
    print(f"restore: {restore_s:.3f} s ({gigabytes / restore_s:.2f} GB/s), values equal: {same}")
    print(f"host: {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
