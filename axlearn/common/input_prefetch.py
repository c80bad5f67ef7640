"""Keeping the accelerator fed: prefetch host batches in a thread and onto devices.

- `prefetch_in_thread(batches, size)` runs an iterator in a background thread, `size`
  items ahead; errors in the thread surface at the consumer's next().
- `prefetch_to_device(batches, sharding, size)` turns host-local NumPy batches into
  global `jax.Array`s on `sharding` with `jax.make_array_from_process_local_data`,
  `size` batches ahead (device transfers are asynchronous, so the next batches copy
  while the current step runs).

Put batches on devices in the thread that dispatches the steps, never inside
`prefetch_in_thread`: device memory taken from another thread can land just above a
step's large temporary buffer while that buffer is held, and the next step's buffer then
fits neither below nor above it (`SpmdTrainer.run`, docs/benchmarks.md).
"""

import collections
import queue
import threading
from collections.abc import Iterator, Mapping
from typing import Any, Optional, TypeVar, Union

import jax
import numpy as np

T = TypeVar("T")

_DONE = object()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


def prefetch_in_thread(items: Iterator[T], size: int) -> Iterator[T]:
    """Yields what `items` yields, produced up to `size` items ahead in a daemon thread.

    Closing the returned generator (or dropping it) stops the thread.
    """
    if size <= 0:
        yield from items
        return
    buffer: queue.Queue = queue.Queue(maxsize=size)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                buffer.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce():
        try:
            for item in items:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as e:  # pylint: disable=broad-except
            put(_Failure(e))

    thread = threading.Thread(target=produce, name="input-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = buffer.get()
            if item is _DONE:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item
    finally:
        stop.set()
        # A daemon thread still inside jax when the interpreter exits aborts the process.
        thread.join(timeout=30)


def _global_shape(local: np.ndarray, process_count: int) -> tuple[int, ...]:
    return (local.shape[0] * process_count,) + tuple(local.shape[1:])


def put_on_device(
    batch: Mapping[str, np.ndarray],
    sharding: Union[jax.sharding.Sharding, Mapping[str, jax.sharding.Sharding]],
    *,
    process_count: Optional[int] = None,
) -> dict[str, jax.Array]:
    """One host-local batch as global arrays (rows of all processes stacked in order)."""
    process_count = jax.process_count() if process_count is None else process_count
    out = {}
    for key, local in batch.items():
        key_sharding = sharding[key] if isinstance(sharding, Mapping) else sharding
        out[key] = jax.make_array_from_process_local_data(
            key_sharding, local, _global_shape(local, process_count)
        )
    return out


def prefetch_to_device(
    batches: Iterator[Mapping[str, np.ndarray]],
    sharding: Union[jax.sharding.Sharding, Mapping[str, jax.sharding.Sharding]],
    *,
    size: int = 2,
) -> Iterator[dict[str, Any]]:
    """Yields `batches` as global jax.Arrays on `sharding`, transferring `size` batches ahead."""
    pending: collections.deque = collections.deque()
    for batch in batches:
        pending.append(put_on_device(batch, sharding))
        if len(pending) > size:
            yield pending.popleft()
    while pending:
        yield pending.popleft()
