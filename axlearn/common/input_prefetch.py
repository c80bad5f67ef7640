"""Keeping the accelerator fed: `prefetch_in_thread(batches, size)` runs an iterator in
a background thread, `size` items ahead; errors in the thread surface at the consumer's
next().

Put batches on devices (`sharding.global_batch`) in the thread that dispatches the steps
(as `SpmdTrainer.run` does), never inside `prefetch_in_thread`: device memory taken from
another thread can land just above a step's large temporary buffer while that buffer is
held, and the next step's buffer then fits neither below nor above it. The transfer is
asynchronous, so a batch put there still copies while the previous step runs.
"""

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Optional, TypeVar

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


def prefetch_indexed(
    batch_at: Callable[[int], T], *, start: int, stop: Optional[int], size: int
) -> Iterator[T]:
    """`batch_at(start)`, `batch_at(start + 1)`, ... up to `stop` (None: without end), each
    computed from its index alone, produced up to `size` ahead (`prefetch_in_thread`)."""

    def generate():
        step = start
        while stop is None or step < stop:
            yield batch_at(step)
            step += 1

    return prefetch_in_thread(generate(), size)
