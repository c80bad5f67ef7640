"""Tokenizing a stream of documents on every core, with results in input order.

`tokenize_documents` groups documents into chunks (a few hundred documents or about a
MiB of text), tokenizes them in a pool of worker processes, and yields each chunk's
tokens in input order, so the result is the same for any number of workers. At most two
chunks per worker are in flight, so a corpus is never read far ahead of its tokenization.

Workers start with `forkserver` (`spawn` where that is missing), never `fork`: the
parent may run JAX's threads, which a forked child would inherit in an unknown state.
This module imports nothing heavier than NumPy, so workers start quickly; a vocabulary
reaches them pickled (`input_vocab` vocabularies reload their model file). Input that
fits one chunk is tokenized in the calling process, without a pool.
"""

import collections
import concurrent.futures
import multiprocessing
import signal
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Optional, TypeVar

import numpy as np

Tag = TypeVar("Tag")  # Travels with each document, e.g. the split it belongs to.
_CHUNK_DOCUMENTS = 256  # Documents per task sent to a worker, at most ...
_CHUNK_CHARS = 1 << 20  # ... and characters of text per task (the last text may pass it).


def tokenize(
    vocab: Any, text: str, *, replace_newlines_with: Optional[str] = None
) -> tuple[np.ndarray, int]:
    """(token ids, UTF-8 bytes of the original text); newlines are replaced before encoding."""
    num_bytes = len(text.encode("utf-8"))
    if replace_newlines_with is not None:
        text = text.replace("\n", replace_newlines_with)
    if hasattr(vocab, "encode_array"):
        return vocab.encode_array(text), num_bytes
    return np.asarray(vocab.encode(text), dtype=np.int32), num_bytes  # E.g. seqio's.


def tokenize_chunk(
    vocab: Any, texts: Sequence[str], replace_newlines_with: Optional[str] = None
) -> tuple[np.ndarray, np.ndarray]:
    """(int32 ids of all `texts` concatenated, int64 [tokens, bytes] per text)."""
    ids, counts = [], np.empty((len(texts), 2), dtype=np.int64)
    for i, text in enumerate(texts):
        tokens, num_bytes = tokenize(vocab, text, replace_newlines_with=replace_newlines_with)
        ids.append(np.asarray(tokens, dtype=np.int32))
        counts[i] = (len(tokens), num_bytes)
    return (np.concatenate(ids) if ids else np.empty(0, np.int32)), counts


_worker: dict[str, Any] = {}  # A worker process's vocabulary and newline replacement.


def _init_worker(vocab: Any, replace_newlines_with: Optional[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # The parent handles Ctrl-C and stops the pool.
    _worker.update(vocab=vocab, replace_newlines_with=replace_newlines_with)


def _tokenize_in_worker(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    return tokenize_chunk(_worker["vocab"], texts, _worker["replace_newlines_with"])


def _chunks(
    documents: Iterable[tuple[str, Tag]]
) -> Iterator[tuple[list[str], list[Tag]]]:
    """(texts, tags) of consecutive documents: one worker task each."""
    texts, tags, chars = [], [], 0
    for text, tag in documents:
        texts.append(text)
        tags.append(tag)
        chars += len(text)
        if len(texts) >= _CHUNK_DOCUMENTS or chars >= _CHUNK_CHARS:
            yield texts, tags
            texts, tags, chars = [], [], 0
    if texts:
        yield texts, tags


def _start_pool(
    vocab: Any, replace_newlines_with: Optional[str], num_workers: int
) -> concurrent.futures.ProcessPoolExecutor:
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    return concurrent.futures.ProcessPoolExecutor(
        num_workers,
        mp_context=context,
        initializer=_init_worker,
        initargs=(vocab, replace_newlines_with),
    )


def tokenize_documents(
    documents: Iterable[tuple[str, Tag]],
    *,
    vocab: Any,
    replace_newlines_with: Optional[str] = None,
    num_workers: int = 1,
) -> Iterator[tuple[np.ndarray, np.ndarray, list[Tag]]]:
    """Per chunk of (text, tag) documents, in input order: (int32 ids of its documents
    concatenated, int64 [tokens, bytes] per document, their tags).

    Errors raised while reading `documents` or tokenizing reach the caller; the pool is
    stopped when the iterator finishes, fails or is closed.
    """
    chunks = _chunks(documents)
    first = next(chunks, None)
    second = next(chunks, None) if first is not None else None
    if num_workers <= 1 or second is None:  # One worker, or too little work for a pool.
        for texts, tags in filter(None, (first, second)):
            yield (*tokenize_chunk(vocab, texts, replace_newlines_with), tags)
        for texts, tags in chunks:
            yield (*tokenize_chunk(vocab, texts, replace_newlines_with), tags)
        return
    pool = _start_pool(vocab, replace_newlines_with, num_workers)
    try:
        pending: collections.deque = collections.deque()
        for texts, tags in _prepend((first, second), chunks):
            pending.append((pool.submit(_tokenize_in_worker, texts), tags))
            if len(pending) >= 2 * num_workers:
                result, done = pending.popleft()
                yield (*result.result(), done)
        while pending:
            result, done = pending.popleft()
            yield (*result.result(), done)
    finally:
        # Chunks in progress finish (a worker killed mid-reply could hang the pool); queued
        # ones are dropped.
        pool.shutdown(wait=True, cancel_futures=True)


def _prepend(items: Sequence[Any], rest: Iterator[Any]) -> Iterator[Any]:
    yield from items
    yield from rest


def map_in_order(
    fn: Any,
    tasks: Iterable[Any],
    *,
    initializer: Any,
    initargs: tuple,
    num_workers: int,
) -> Iterator[Any]:
    """`fn(task)` for each task, in order, computed in `num_workers` processes (started as
    `tokenize_documents`'s are, each running `initializer(*initargs)` first; at most two
    tasks per worker in flight). One worker, or a single task, runs in this process.
    `fn` and `initializer` must be module-level functions (they are pickled)."""
    tasks = iter(tasks)
    first = next(tasks, None)
    second = next(tasks, None) if first is not None else None
    if num_workers <= 1 or second is None:
        initializer(*initargs)
        for task in filter(lambda t: t is not None, (first, second)):
            yield fn(task)
        for task in tasks:
            yield fn(task)
        return
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    pool = concurrent.futures.ProcessPoolExecutor(
        num_workers, mp_context=context, initializer=_init_mapped, initargs=(initializer, initargs)
    )
    try:
        pending: collections.deque = collections.deque()
        for task in _prepend((first, second), tasks):
            pending.append(pool.submit(fn, task))
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _init_mapped(initializer: Any, initargs: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # The parent handles Ctrl-C and stops the pool.
    initializer(*initargs)
