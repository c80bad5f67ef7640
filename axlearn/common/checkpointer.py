"""Asynchronous, atomic checkpoints of sharded state, written with TensorStore.

On disk, one directory per saved step:

    <dir>/step_00000100/arrays/<leaf path>/   one zarr array per state leaf (TensorStore)
    <dir>/step_00000100/index.json            written last: the commit record

The commit protocol makes the newest committed checkpoint whole at every instant:
1. every process writes the shards it owns (`replica_id == 0`) into the step directory;
2. the sizes and CRC32 checksums of the written files are collected (processes other
   than 0 leave theirs in `manifest_<process>.json`);
3. process 0 writes `index.json` (tree paths, shapes, dtypes, chunking, file sizes and
   checksums, the caller's `extra` metadata and verdict `good`, and the sha256 of all
   that) to a temporary file, fsyncs it, renames it into place and fsyncs the directory.
A verdict given later (`set_verdict`: the trainer's, once the next step trained on the
state) rewrites the index the same way; restore skips steps judged bad unless asked for
one by step. A step directory without `index.json` is not a checkpoint: it is never
restored, and garbage collection removes it. A save that fails removes its directory once
every write it started has ended. Restore re-checks the index's own sha256 and the sizes and
checksums of the files it reads, so an edited index or a torn or altered file is
detected; the previous committed step is then used, and the step that failed is saved
again when training reaches it (`save` replaces it instead of keeping it as committed).

`dir` is a local path or a storage URL (`gs://`, `s3://`, `memory://`, see
`file_system`); TensorStore writes the arrays through the same key-value store. Locally
the index is committed by POSIX rename (shared file systems for multi-host); on an object
store by its single PUT, which is atomic.

`save()` blocks only while device arrays are copied to host memory (by default into
pinned host memory, see `TensorStoreStateStorage.Config.host_memory_kind`); the files are
written by a background thread, and the next `save()` waits for the previous one.
"""

import concurrent.futures
import dataclasses
import errno
import functools
import hashlib
import itertools
import json
import logging
import math
import os
import re
import threading
import time
import urllib.parse
import zlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from axlearn.common import file_system
from axlearn.common.config import (
    REQUIRED,
    ConfigError,
    ConfigOr,
    Configurable,
    Required,
    config_class,
    config_for_function,
    maybe_instantiate,
    register_configurable,
)
from axlearn.common.module import Module
from axlearn.common.progress import progress_bar
from axlearn.common.utils import flatten_with_paths

_log = logging.getLogger(__name__)

INDEX_FILE = "index.json"
_FORMAT = "axlearn.checkpoint.v1"
# The index field holding the sha256 of the rest of the index (`_index_digest`). Indexes
# written before it existed have none: they restore with a warning (see `_load_index`).
INDEX_CHECKSUM = "index_sha256"
# The index field saying why a step's verdict (`good`) is what it is, where one is given.
VERDICT_REASON = "verdict_reason"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
# Large arrays are cut into chunks of at most this many bytes, so that TensorStore writes
# and reads them in parallel and a restore on another mesh reads little it does not need.
_TARGET_CHUNK_BYTES = 64 << 20
_CHECKSUM_BLOCK_BYTES = 16 << 20
# The values of TensorStoreStateStorage.Config.host_memory_kind that are not just passed on:
# what None means, and the one that copies into numpy arrays instead of a jax memory.
_PINNED_HOST = "pinned_host"
_NUMPY = "numpy"


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed; earlier checkpoints are untouched."""


class CheckpointCorruptError(RuntimeError):
    """A committed checkpoint's files disagree with its index (torn, truncated or altered)."""


class CheckpointMismatchError(ValueError):
    """A checkpoint's index does not fit the state template: another model's checkpoint,
    or an index edited (its checksum recomputed) to name other arrays, shapes or dtypes."""


class RestoreStepError(ConfigError):
    """The step asked to restore (`restore(step=N)`, the launcher's --restore_step) is not
    committed; the one-line message lists the committed steps."""


class CorruptRestoreStepError(RestoreStepError, CheckpointCorruptError):
    """The step asked to restore is committed but fails its checks."""


# ----- save policies -----

SavePolicy = Callable[[int], bool]


@register_configurable
def every_n_steps_policy(
    n: int = 1, *, min_step: int = 1, max_step: Optional[int] = None
) -> SavePolicy:
    """Saves at every step that is a multiple of `n` within [min_step, max_step]."""
    if n < 1:
        raise ConfigError(f"every_n_steps_policy: n must be >= 1, got {n}")

    def policy(step: int) -> bool:
        if step < min_step or (max_step is not None and step > max_step):
            return False
        return step % n == 0

    return policy


@register_configurable
def every_n_steps_and_last_policy(n: int = 1, *, min_step: int = 1, max_step: int) -> SavePolicy:
    """Like `every_n_steps_policy`, and also at `max_step`, the last step of training."""
    every_n = every_n_steps_policy(n, min_step=min_step, max_step=max_step)

    def policy(step: int) -> bool:
        return step == max_step or every_n(step)

    return policy


# ----- directory layout -----


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _parse_step(name: str) -> Optional[int]:
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def _step_dirs(base_dir: str) -> dict[int, str]:
    """Step -> directory, for every step directory in `base_dir`, committed or not."""
    try:
        names = file_system.listdir(base_dir)
    except FileNotFoundError:
        return {}
    steps = {}
    for name in names:
        step = _parse_step(name)
        if step is not None and file_system.isdir(file_system.join(base_dir, name)):
            steps[step] = file_system.join(base_dir, name)
    return steps


def _write_json_atomically(path: str, value: Any) -> None:
    """Readers see either no file or the whole file, even across a crash or power loss."""
    file_system.write_text(path, json.dumps(value, indent=1, sort_keys=True))


def _read_json(path: str) -> Any:
    return json.loads(file_system.read_text(path))


def _uncommit(step_dir: str) -> None:
    """Removes the step's index, if any: from then on the directory is not a checkpoint."""
    try:
        file_system.remove(file_system.join(step_dir, INDEX_FILE))
    except FileNotFoundError:
        pass


def _file_checksum(path: str) -> dict[str, int]:
    """{'size', 'crc32'} of one file."""
    if not file_system.is_local(path):
        data = file_system.read_bytes(path)  # An object store has no partial reads to stream.
        return {"size": len(data), "crc32": zlib.crc32(data)}
    crc = 0
    size = 0
    with open(file_system.local_path(path), "rb") as f:
        while block := f.read(_CHECKSUM_BLOCK_BYTES):
            crc = zlib.crc32(block, crc)  # Releases the GIL: files are summed in parallel.
            size += len(block)
    return {"size": size, "crc32": crc}


def _checksums(root: str, relative_paths: Sequence[str]) -> dict[str, dict[str, int]]:
    """{path: {'size', 'crc32'}} of the files under `root`, summed in parallel."""
    workers = min(32, (os.cpu_count() or 1) * 2)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        sums = pool.map(lambda p: _file_checksum(file_system.join(root, p)), relative_paths)
        return dict(zip(relative_paths, sums))


def _index_digest(index: dict[str, Any]) -> str:
    """The sha256 (hex) of `index` as canonical JSON (sorted keys, no spaces), its own
    checksum field left out: the same for the dict written and the dict read back."""
    body = {key: value for key, value in index.items() if key != INDEX_CHECKSUM}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ----- leaves: names, chunking, dtypes -----


def _array_dir_name(path: str) -> str:
    """A file-system-safe directory for the leaf at tree path `path`."""
    if not path:
        return "_root"
    parts = []
    for part in path.split("/"):
        part = urllib.parse.quote(part, safe="-_.")
        # '', '.' and '..' would escape or merge directories; zarr owns names starting '.'.
        if part in ("", ".", "..") or part.startswith("."):
            part = "%" + part
        parts.append(part)
    return "/".join(parts)


def _is_prng_key(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _zarr_dtype(dtype: np.dtype) -> str:
    # Extension types (bfloat16, float8, int4) are spelled by name; the others as '<f4'.
    return dtype.name if dtype.kind == "V" else dtype.str


def _normalize_index(index: Sequence[slice], shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    return tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(index, shape))


def _smallest_prime_factor(n: int) -> int:
    for p in range(2, math.isqrt(n) + 1):
        if n % p == 0:
            return p
    return n


def _chunk_shape(
    shape: Sequence[int], shard_bounds: Sequence[tuple[tuple[int, int], ...]], itemsize: int
) -> list[int]:
    """A chunk grid whose chunks never straddle two shards, cut to at most ~64 MiB.

    Chunks aligned with shard boundaries let every process write its shards without
    touching a chunk another process writes.
    """
    chunks = []
    for dim, size in enumerate(shape):
        inner = {b for bounds in shard_bounds for b in bounds[dim]} - {0, size}
        chunks.append(max(1, math.gcd(*inner) if inner else size))
    while math.prod(chunks) * itemsize > _TARGET_CHUNK_BYTES:
        dim = max(range(len(chunks)), key=lambda d: chunks[d])
        chunks[dim] //= _smallest_prime_factor(chunks[dim])
    return chunks


def _chunk_indices(
    chunks: Sequence[int], bounds: tuple[tuple[int, int], ...]
) -> list[tuple[int, ...]]:
    """The grid indices of the zarr chunks that hold the region `bounds` (a 0-d array's
    one chunk: ())."""
    ranges = []
    for chunk, (start, stop) in zip(chunks, bounds):
        if stop <= start:
            return []
        ranges.append(range(start // chunk, -(-stop // chunk)))
    return list(itertools.product(*ranges))


def _chunk_file(chunk_index: tuple[int, ...]) -> str:
    """The zarr file name of a chunk: its indices joined by '.' ('0' for a 0-d array)."""
    return ".".join(map(str, chunk_index)) or "0"


def _chunk_files(chunks: Sequence[int], bounds: tuple[tuple[int, int], ...]) -> list[str]:
    """Names of the zarr chunk files that hold the region `bounds`."""
    return [_chunk_file(i) for i in _chunk_indices(chunks, bounds)]


# ----- storage -----


@dataclasses.dataclass
class _LeafSnapshot:
    """One leaf of a state, copied to host: what this process writes of it."""

    path: str
    array_dir: str
    meta: dict[str, Any]  # Goes to the index: shape, dtype, stored_shape, stored_dtype, chunks.
    # (bounds, host data): numpy arrays, or jax arrays in a host memory
    # (TensorStoreStateStorage.Config.host_memory_kind) that the writer reads as numpy.
    shards: list[tuple[tuple[tuple[int, int], ...], Any]]


class StateSnapshot(NamedTuple):
    """What `save()` hands to the background writer: host copies and their metadata."""

    leaves: list[_LeafSnapshot]
    treedef: str  # For people reading the index; restore takes the structure from a template.


def _numpy_copy(shard: jax.Shard) -> np.ndarray:
    """The shard's data in a numpy array of its own (after `copy_to_host_async`)."""
    data = np.asarray(shard.data)
    if shard.device.platform == "cpu":
        # On CPU that is a view of the device buffer, which a donating step reuses.
        data = data.copy()
    return data


def _start_host_copy(
    path: str, leaf: Any, host_memory_kind: str
) -> Callable[[], _LeafSnapshot]:
    """Starts copying the shards of `leaf` this process owns; the returned call waits.

    `host_memory_kind`: a host memory kind of the devices ('pinned_host') copies each shard
    into a jax array in that memory, which the writer thread reads as numpy later; 'numpy'
    copies it into a new numpy array (TensorStoreStateStorage.Config.host_memory_kind).
    """
    meta: dict[str, Any] = {}
    if isinstance(leaf, jax.Array):
        meta.update(shape=list(leaf.shape), dtype=str(leaf.dtype))
        if _is_prng_key(leaf.dtype):
            meta["prng_key_impl"] = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        all_bounds = [
            _normalize_index(index, leaf.shape)
            for index in leaf.sharding.devices_indices_map(leaf.shape).values()
        ]
        owned = [shard for shard in leaf.addressable_shards if shard.replica_id == 0]
        if host_memory_kind == _NUMPY:
            for shard in owned:
                shard.data.copy_to_host_async()
            finish = [functools.partial(_numpy_copy, shard) for shard in owned]
        else:
            # One transfer a shard, not of the whole array: replicas need no copy. Waiting
            # for it means a donating step may reuse the device buffer after, and the host
            # array is the writer's alone.
            finish = [
                jax.device_put(
                    shard.data,
                    jax.sharding.SingleDeviceSharding(shard.device, memory_kind=host_memory_kind),
                ).block_until_ready
                for shard in owned
            ]

        def host_shards():
            return [
                (_normalize_index(shard.index, leaf.shape), wait())
                for shard, wait in zip(owned, finish)
            ]

    elif isinstance(leaf, (np.ndarray, np.generic, bool, int, float)):
        leaf = np.array(leaf)  # A copy: the caller may change its array after save().
        meta.update(shape=list(leaf.shape), dtype=str(leaf.dtype))
        all_bounds = [tuple((0, n) for n in leaf.shape)]
        owned_shards = [(all_bounds[0], leaf)] if jax.process_index() == 0 else []

        def host_shards():
            return owned_shards

    else:
        raise TypeError(
            f"State leaf '{path}' is a {type(leaf).__name__}; a checkpoint holds jax.Array, "
            "numpy arrays and Python scalars"
        )
    dtype = np.dtype(leaf.dtype)
    meta.update(
        stored_shape=list(leaf.shape),
        stored_dtype=_zarr_dtype(dtype),
        chunks=_chunk_shape(leaf.shape, all_bounds, dtype.itemsize),
    )
    return lambda: _LeafSnapshot(path, _array_dir_name(path), meta, host_shards())


def _wait_for_all(futures: Sequence[Any], timeout: float) -> list[BaseException]:
    """Waits for every future; returns the errors of those that failed, in order."""
    errors = []
    for future in futures:
        try:
            future.result(timeout=timeout)
        except Exception as e:  # pylint: disable=broad-except
            errors.append(e)
    return errors


def _check_unique_paths(paths: Sequence[str]) -> None:
    names = [_array_dir_name(p) for p in paths]
    if len(set(names)) != len(names):
        seen, dups = set(), set()
        for path, name in zip(paths, names):
            if name in seen:
                dups.add(path)
            seen.add(name)
        raise ValueError(f"State leaves share a checkpoint path: {sorted(dups)}")


class TensorStoreStateStorage(Configurable):
    """Writes and reads a state pytree as one zarr array per leaf."""

    @config_class
    class Config(Configurable.Config):
        """Configures TensorStoreStateStorage."""

        # Seconds to wait for one checkpoint's writes, reads or the other processes' files.
        timeout_secs: float = 3600
        # Where `save()` copies the device shards before returning. A host memory kind of
        # the devices, None meaning 'pinned_host': into jax arrays in that memory, which
        # the writer thread reads as numpy. On a GPU that is page-locked memory the device
        # fills by DMA, so a save blocks training far less than a copy into pageable
        # memory; the runtime keeps the pool (about the state's size) between saves.
        # 'numpy': into new numpy arrays, pageable memory freed after the write, for hosts
        # short of memory.
        host_memory_kind: Optional[str] = None

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        # Tensorstore fsyncs each file it writes, so data is durable before the index is.
        # A child of file_system's context: memory:// arrays and files share its stores.
        self._context = ts.Context({"file_io_sync": True}, parent=file_system.context())

    # --- save ---

    def snapshot(self, state: Any) -> StateSnapshot:
        """Copies the shards this process owns to host memory; the state may change after."""
        entries = flatten_with_paths(state)
        _check_unique_paths([path for path, _ in entries])
        kind = self.config.host_memory_kind or _PINNED_HOST
        if kind != _NUMPY:
            self._check_host_memory_kind(kind, [leaf for _, leaf in entries])
        # Every device-to-host transfer starts before the first one is waited for.
        started = [_start_host_copy(path, leaf, kind) for path, leaf in entries]
        return StateSnapshot(
            [finish() for finish in started], treedef=str(jax.tree_util.tree_structure(state))
        )

    def _check_host_memory_kind(self, kind: str, leaves: Sequence[Any]) -> None:
        devices = set()
        for leaf in leaves:
            if isinstance(leaf, jax.Array):
                devices.update(leaf.sharding.addressable_devices)
        for device in devices:
            kinds = sorted(m.kind for m in device.addressable_memories())
            if kind not in kinds:
                raise ConfigError(
                    f"{type(self).__name__}.Config.host_memory_kind={kind!r}: device {device} "
                    f"has the memories {kinds}"
                )

    def write(self, snapshot: StateSnapshot, step_dir: str) -> dict[str, dict[str, int]]:
        """Writes this process's shards; returns {relative file: {size, crc32}} it wrote."""
        cfg = self.config
        opened = [
            ts.open(
                self._spec(step_dir, leaf.array_dir, leaf.meta),
                create=True,
                open=True,
                context=self._context,
            )
            for leaf in snapshot.leaves
        ]
        files = []
        writes = []
        try:
            for leaf, future in zip(snapshot.leaves, opened):
                array = future.result(timeout=cfg.timeout_secs)
                for bounds, data in leaf.shards:
                    index = tuple(slice(start, stop) for start, stop in bounds)
                    writes.append(array[index].write(np.asarray(data)))
                    chunk_files = _chunk_files(leaf.meta["chunks"], bounds)
                    files += [f"arrays/{leaf.array_dir}/{f}" for f in chunk_files]
                if jax.process_index() == 0:
                    files.append(f"arrays/{leaf.array_dir}/.zarray")
        finally:
            # Every started write ends (or fails) before this returns or raises, so that
            # the clean-up of a failed step finds no write still adding files to it.
            errors = _wait_for_all([*opened, *writes], cfg.timeout_secs)
        if errors:
            raise errors[0]
        return _checksums(step_dir, sorted(set(files)))

    @staticmethod
    def _spec(step_dir: str, array_dir: str, meta: dict[str, Any]) -> dict[str, Any]:
        return {
            "driver": "zarr",
            "kvstore": file_system.kvstore_spec(file_system.join(step_dir, "arrays", array_dir)),
            "metadata": {
                "shape": meta["stored_shape"],
                "chunks": meta["chunks"],
                "dtype": meta["stored_dtype"],
                "compressor": None,  # Raw chunks: writing is I/O bound, not CPU bound.
                "fill_value": None,
            },
            # Every chunk becomes a file, so the set of files is known from the shards.
            "store_data_equal_to_fill_value": True,
        }

    # --- restore ---

    def read(
        self, step_dir: str, index: dict[str, Any], template: Any, *, subset: bool = False
    ) -> Any:
        """The leaves of `template` read from `step_dir` into its shardings.

        Each file is read once (`_FileRead`): its bytes checked against the size and CRC32
        the index records, then copied into the host regions that need them (read into
        place where a chunk is a contiguous piece of one); the leaves go to their devices
        in batches as their files come in. `subset`: the template may leave out leaves of
        the checkpoint, which are not read. Raises CheckpointMismatchError for a template
        that does not match (the caller's mistake), before reading anything, and
        CheckpointCorruptError for files that disagree with the index.
        """
        index_path = file_system.join(step_dir, INDEX_FILE)
        entries = flatten_with_paths(template)
        arrays = index["arrays"]
        missing = [p for p, _ in entries if p not in arrays]
        unexpected = [] if subset else sorted(set(arrays) - {p for p, _ in entries})
        if missing or unexpected:
            raise CheckpointMismatchError(
                f"The state template does not match checkpoint {index_path}: "
                f"missing from the checkpoint: {missing or 'none'}; "
                f"in the checkpoint but not in the template: {unexpected or 'none'}"
            )
        leaves = []
        for path, leaf in entries:
            _check_leaf_matches(path, leaf, arrays[path], index_path)
            leaves.append(_LeafRead(path, leaf, arrays[path]))
        files = _file_reads(step_dir, index["files"], leaves)
        workers = _read_workers()
        step_name = os.path.basename(step_dir.rstrip("/"))
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool, progress_bar(
            total=len(leaves), desc=f"Reading {step_name}", unit="array"
        ) as bar:
            # Leaf by leaf, in order: each leaf's files are waited for as a batch is placed.
            futures = {name: pool.submit(read.run) for name, read in files.items()}
            try:
                values = _place_in_batches(leaves, futures, self.config.timeout_secs, bar)
            finally:
                for future in futures.values():
                    future.cancel()
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), values)


def _read_workers() -> int:
    """Threads reading a restore's files: half the cores, at most 8. Reading is bound by
    memory bandwidth (on one H200's host, 8 threads read 16 GiB faster than 32), and the
    other cores are left to the train step compiling meanwhile (`compile_ahead`)."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


# Leaves go to their devices in batches of about this many bytes: one device_put call for
# many arrays transfers several times faster than one call each, and batches let the
# transfers of the first leaves overlap the reading of the later ones.
_PLACE_BATCH_BYTES = 1 << 30


class _LeafRead:
    """One leaf of a restore: the regions of its stored array its devices need, each a
    host buffer the leaf's files are copied into."""

    def __init__(self, path: str, leaf: Any, meta: dict[str, Any]):
        self.leaf, self.meta = leaf, meta
        self.regions = _regions_to_read(leaf, meta)
        self.dtype = _stored_dtype(meta["stored_dtype"])
        self.chunk_shape = tuple(meta["chunks"])
        self.host = {
            bounds: np.empty([b - a for a, b in bounds], self.dtype)
            for bounds in dict.fromkeys(self.regions.values())
        }
        array_dir = f"arrays/{_array_dir_name(path)}"
        self.metadata_file = f"{array_dir}/.zarray"
        # {file (relative to the step directory): grid index} of every chunk a region needs.
        self.chunk_files = {
            f"{array_dir}/{_chunk_file(i)}": i
            for bounds in self.host
            for i in _chunk_indices(self.chunk_shape, bounds)
        }

    def files(self) -> list[str]:
        """Every file this leaf reads: its metadata and its chunks."""
        return [self.metadata_file, *self.chunk_files]

    def small_value(self) -> Any:
        """The value of a leaf that `_place_leaves` does not batch (`_small_value`)."""
        return _small_value(self.leaf, self.meta, next(iter(self.host.values())))


class _FileRead:
    """Reads one file of a checkpoint once, checks it against the index and, for a chunk
    file, copies the chunk into the regions of its leaf that need it."""

    def __init__(
        self,
        path: str,
        recorded: dict[str, int],
        index_path: str,
        chunk: Optional[tuple[_LeafRead, tuple[int, ...]]] = None,
    ):
        self.path, self.recorded, self.index_path = path, recorded, index_path
        self.chunk = chunk  # (leaf, grid index) of a chunk file; None for metadata.

    def run(self) -> None:
        if self.chunk is None:
            self._read(into=None)
            return
        leaf, chunk_index = self.chunk
        # (chunk slices, region slices, region buffer) where the chunk meets each region.
        pieces = []
        for bounds, host in leaf.host.items():
            overlap = _chunk_overlap(chunk_index, leaf.chunk_shape, bounds)
            if overlap is not None:
                pieces.append((*overlap, host))
        target = _whole_contiguous_target(pieces, leaf.chunk_shape)
        if target is not None and file_system.is_local(self.path):
            self._read(into=target)  # Straight into the one region it fills.
            return
        data = self._read(into=None)
        if data.size != math.prod(leaf.chunk_shape) * leaf.dtype.itemsize:
            raise CheckpointCorruptError(
                f"{self.path} holds {data.size} bytes, not one chunk {list(leaf.chunk_shape)} "
                f"of {leaf.dtype} (index {self.index_path})"
            )
        values = data.view(leaf.dtype).reshape(leaf.chunk_shape)
        for in_chunk, in_region, host in pieces:
            host[in_region] = values[in_chunk]

    def _read(self, into: Optional[np.ndarray]) -> np.ndarray:
        """The file's bytes (in `into`, where given), checked against the index."""
        try:
            if file_system.is_local(self.path):
                with open(file_system.local_path(self.path), "rb", buffering=0) as f:
                    size = os.fstat(f.fileno()).st_size
                    self._check_size(size)  # A torn file is not read at all.
                    data = _read_into(f, into if into is not None else np.empty(size, np.uint8))
            else:
                data = np.frombuffer(file_system.read_bytes(self.path), np.uint8)
        except FileNotFoundError:
            raise CheckpointCorruptError(
                f"{self.path} is missing (listed in {self.index_path})"
            ) from None
        self._check_size(data.size)  # An object's, or a file's that shrank while read.
        if zlib.crc32(data) != self.recorded["crc32"]:  # Releases the GIL.
            raise CheckpointCorruptError(
                f"{self.path} fails its CRC32 check against {self.index_path} (altered or "
                "corrupted)"
            )
        return data

    def _check_size(self, size: int) -> None:
        expected = self.recorded["size"]
        if size != expected:
            raise CheckpointCorruptError(
                f"{self.path} has {size} bytes, {self.index_path} records {expected} "
                "(torn or truncated)"
            )


def _whole_contiguous_target(
    pieces: list, chunk_shape: tuple[int, ...]
) -> Optional[np.ndarray]:
    """The bytes of the region a chunk fills whole and contiguously, where it meets just
    that one region (`_FileRead.run`'s pieces); else None."""
    if len(pieces) != 1:
        return None
    in_chunk, in_region, host = pieces[0]
    target = host[(*in_region, ...)]
    whole = all(s.stop - s.start == n for s, n in zip(in_chunk, chunk_shape))
    return target.reshape(-1).view(np.uint8) if whole and target.flags.c_contiguous else None


def _read_into(f: Any, data: np.ndarray) -> np.ndarray:
    """`data` (uint8) filled from the open file `f`; cut short where the file ends first."""
    view, done = memoryview(data), 0
    while done < data.size:
        n = f.readinto(view[done:])
        if not n:
            return data[:done]
        done += n
    return data


def _file_reads(
    step_dir: str, recorded: dict[str, dict], leaves: Sequence[_LeafRead]
) -> dict[str, _FileRead]:
    """The reads of every file the leaves need, each file once."""
    index_path = file_system.join(step_dir, INDEX_FILE)
    reads: dict[str, _FileRead] = {}
    for leaf in leaves:
        for name in leaf.files():
            if name not in recorded:
                raise CheckpointCorruptError(f"{index_path} lists no checksum for {name}")
            chunk = (leaf, leaf.chunk_files[name]) if name in leaf.chunk_files else None
            path = file_system.join(step_dir, name)
            reads[name] = _FileRead(path, recorded[name], index_path, chunk)
    return reads


def _place_in_batches(
    leaves: Sequence[_LeafRead],
    futures: dict[str, concurrent.futures.Future],
    timeout: float,
    bar: Any,
) -> list[Any]:
    """Each leaf's value on its devices: leaves whose files are read are placed together
    once about _PLACE_BATCH_BYTES of them are waiting, and the rest at the end."""
    values: list[Any] = []
    batch: list[_LeafRead] = []
    batch_bytes = 0

    def place() -> None:
        values.extend(_place_leaves(batch))
        bar.update(len(batch))
        batch.clear()

    for leaf in leaves:
        for name in leaf.files():
            futures[name].result(timeout=timeout)
        batch.append(leaf)
        batch_bytes += sum(h.nbytes for h in leaf.host.values())
        if batch_bytes >= _PLACE_BATCH_BYTES:
            place()
            batch_bytes = 0
    place()
    return values


def _place_leaves(leaves: Sequence[_LeafRead]) -> list[Any]:
    """The leaves' values: the device arrays among them put on their devices in one call."""
    batched = [
        isinstance(leaf.leaf, (jax.Array, jax.ShapeDtypeStruct))
        and "prng_key_impl" not in leaf.meta
        for leaf in leaves
    ]
    on_devices = [leaf for leaf, b in zip(leaves, batched) if b]
    pieces = [leaf.host[bounds] for leaf in on_devices for bounds in leaf.regions.values()]
    devices = [device for leaf in on_devices for device in leaf.regions]
    placed = iter(jax.device_put(pieces, devices) if pieces else [])
    out = []
    for leaf, b in zip(leaves, batched):
        if b:
            shards = [next(placed) for _ in leaf.regions]
            shape = tuple(leaf.meta["shape"])
            sharding = _sharding_of(leaf.leaf)
            out.append(jax.make_array_from_single_device_arrays(shape, sharding, shards))
        else:
            out.append(leaf.small_value())
    return out


def _stored_dtype(name: str) -> np.dtype:
    """The numpy dtype of a zarr dtype string ('<f4', or an extension type's name)."""
    return np.dtype(name) if name[:1] in "<>|" else jnp.dtype(name)


def _chunk_overlap(
    chunk_index: tuple[int, ...], chunk_shape: tuple[int, ...], bounds: tuple[tuple[int, int], ...]
) -> Optional[tuple[tuple[slice, ...], tuple[slice, ...]]]:
    """(slices of the chunk, slices of the region) where chunk `chunk_index` and the
    region `bounds` of the stored array meet, or None where they do not."""
    in_chunk, in_region = [], []
    for i, n, (start, stop) in zip(chunk_index, chunk_shape, bounds):
        lo, hi = max(i * n, start), min((i + 1) * n, stop)
        if lo >= hi:
            return None
        in_chunk.append(slice(lo - i * n, hi - i * n))
        in_region.append(slice(lo - start, hi - start))
    return tuple(in_chunk), tuple(in_region)


def _check_leaf_matches(path: str, leaf: Any, meta: dict, index_path: str) -> None:
    shape = tuple(np.shape(leaf)) if not hasattr(leaf, "shape") else tuple(leaf.shape)
    dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
    if shape != tuple(meta["shape"]) or str(dtype) != meta["dtype"]:
        raise CheckpointMismatchError(
            f"Parameter '{path}': the template has shape {shape} dtype {dtype}, but checkpoint "
            f"{index_path} holds shape {tuple(meta['shape'])} dtype {meta['dtype']}"
        )


def _regions_to_read(leaf: Any, meta: dict) -> dict[Any, tuple[tuple[int, int], ...]]:
    """Device (or None for host values) -> region of the stored array to read for it."""
    stored_shape = meta["stored_shape"]
    full = tuple((0, n) for n in stored_shape)
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        return {None: full}
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if "prng_key_impl" in meta:
        # Keys are tiny: read them whole and let device_put place them.
        return {device: full for device in sharding.addressable_devices}
    return {
        device: _normalize_index(index, stored_shape)
        for device, index in sharding.addressable_devices_indices_map(tuple(stored_shape)).items()
    }


def _sharding_of(leaf: Any) -> jax.sharding.Sharding:
    """The leaf's sharding; one on the first local device for a leaf without one."""
    return getattr(leaf, "sharding", None) or jax.sharding.SingleDeviceSharding(
        jax.local_devices()[0]
    )


def _small_value(leaf: Any, meta: dict, host: np.ndarray) -> Any:
    """The value of a leaf that is no device array (a number or numpy value), or of a
    PRNG key leaf (tiny: put on its devices whole)."""
    if not isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        return type(leaf)(host.item()) if isinstance(leaf, (bool, int, float)) else host
    keys = jax.random.wrap_key_data(host, impl=meta["prng_key_impl"])
    return jax.device_put(keys, _sharding_of(leaf))


# ----- the checkpointer -----


def _describe(error: BaseException) -> str:
    """The cause of a failed save in words, for the two common ones."""
    text = f"{type(error).__name__}: {error}"
    code = error.errno if isinstance(error, OSError) else None
    if code == errno.ENOSPC or "No space left" in text or "RESOURCE_EXHAUSTED" in text:
        return f"the disk is full ({text})"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS) or "PERMISSION_DENIED" in text:
        return f"the directory is not writable ({text})"
    return text


class Checkpointer(Module):
    """Saves state asynchronously by policy, restores the newest intact checkpoint, and
    garbage-collects old ones."""

    @config_class
    class Config(Module.Config):
        """Configures Checkpointer."""

        dir: Required[str] = REQUIRED  # Checkpoint directory; the trainer sets it.
        # step -> bool: whether to save at that step.
        save_policy: ConfigOr[SavePolicy] = config_for_function(every_n_steps_policy)
        keep_last_n: int = 1  # Committed checkpoints kept, newest first.
        keep_every_n_steps: Optional[int] = None  # Also keep every step divisible by this.
        # Seconds between background garbage collections (also run after every commit).
        gc_loop_interval_seconds: float = 60
        storage: TensorStoreStateStorage.Config = TensorStoreStateStorage.default_config()
        # None: off. Else `should_save` is also true once this long has passed since the
        # last save; a save at a step the save policy does not choose is then temporary:
        # garbage collection deletes it once a newer one is committed (unless
        # keep_every_n_steps keeps its step).
        temporary_save_interval_seconds: Optional[float] = None

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        cfg = self.config
        where = self.path()
        if not isinstance(cfg.dir, str) or not cfg.dir:
            raise ConfigError(f"{where}.dir must be a directory path, got {cfg.dir!r}")
        try:
            file_system.kvstore_spec(cfg.dir)
        except ValueError as e:
            raise ConfigError(f"{where}.dir={cfg.dir!r}: {e}") from e
        if cfg.keep_last_n < 1:
            raise ConfigError(f"{where}.keep_last_n must be >= 1, got {cfg.keep_last_n}")
        if cfg.keep_every_n_steps is not None and cfg.keep_every_n_steps < 1:
            raise ConfigError(
                f"{where}.keep_every_n_steps must be None or >= 1, got {cfg.keep_every_n_steps}"
            )
        if cfg.gc_loop_interval_seconds <= 0:
            raise ConfigError(f"{where}.gc_loop_interval_seconds must be > 0")
        kind = cfg.storage.host_memory_kind
        if kind is not None and (not isinstance(kind, str) or kind == "device"):
            raise ConfigError(
                f"{where}.storage.host_memory_kind must be None, '{_NUMPY}' or a host memory "
                f"kind such as '{_PINNED_HOST}', got {kind!r}"
            )
        interval = cfg.temporary_save_interval_seconds
        if interval is not None and interval <= 0:
            raise ConfigError(f"{where}.temporary_save_interval_seconds must be None or > 0")
        self._dir = cfg.dir
        self._temporary_save_interval = cfg.temporary_save_interval_seconds
        self._policy: SavePolicy = maybe_instantiate(cfg.save_policy)
        self._storage: TensorStoreStateStorage = cfg.storage.instantiate()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="checkpoint-writer"
        )
        self._pending: Optional[concurrent.futures.Future] = None
        # Verdicts (`set_verdict`) queued behind the save in flight, in the writer thread.
        self._pending_verdicts: list[concurrent.futures.Future] = []
        self._in_flight_step: Optional[int] = None
        # Committed steps that failed their checks in `restore`, with the reason: not
        # checkpoints for garbage collection, and replaced when saved again.
        self._failed_steps: dict[int, str] = {}
        self._last_save_time = time.monotonic()
        self._gc_lock = threading.Lock()
        self._gc_stop = threading.Event()
        self._gc_thread: Optional[threading.Thread] = None
        self._stopped = False

    @property
    def directory(self) -> str:
        return self._dir

    # --- policy ---

    def should_save(self, step: int) -> bool:
        """Whether the save policy, or the temporary-save interval, asks for a save now."""
        return bool(self._policy(step)) or self._time_due()

    def save_if_policy(self, step: int, state: Any, extra: Optional[dict] = None) -> bool:
        """Saves if `should_save(step)`; returns whether it did."""
        if not self.should_save(step):
            return False
        self.save(step, state, extra=extra)
        return True

    def _time_due(self) -> bool:
        interval = self._temporary_save_interval
        if interval is None:
            return False
        due = time.monotonic() - self._last_save_time >= interval
        if jax.process_count() > 1:
            # Hosts' clocks differ; all must take process 0's decision.
            from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

            due = bool(multihost_utils.broadcast_one_to_all(np.asarray(due)))
        return due

    # --- save ---

    def save(
        self,
        step: int,
        state: Any,
        *,
        extra: Optional[dict] = None,
        good: Optional[bool] = None,
    ) -> None:
        """Starts saving `state` as `step`; returns once the arrays are copied to host.

        `extra` is small JSON-able metadata (e.g. the input iterator's position), committed
        with the arrays. `good` is the caller's verdict on the state, recorded in the index
        (`set_verdict` gives or changes it later; the trainer's is given once the step
        after it passed its checks); garbage collection always keeps the newest step
        whose verdict is good, and `restore()` skips steps judged bad. None: no verdict.
        Raises the error of a previous save that failed. While
        `temporary_save_interval_seconds` is set, a step the save policy does not choose
        is saved as a temporary checkpoint. A step that is already committed is not saved
        again, unless it fails its checks or was judged bad (`_commit_problem`): then it
        is replaced.
        """
        if self._stopped:
            raise RuntimeError(f"{self.path()}: save() after stop()")
        self.wait_until_finished()
        if not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"Checkpoint step must be a non-negative int, got {step!r}")
        step = int(step)
        try:
            extra_json = json.loads(json.dumps(extra))
        except (TypeError, ValueError) as e:
            raise ValueError(f"Checkpoint extra for step {step} must be JSON-able: {e}") from e
        step_dir = file_system.join(self._dir, step_dir_name(step))
        if file_system.isfile(file_system.join(step_dir, INDEX_FILE)):
            problem = self._commit_problem(step, step_dir)
            if problem is None:
                _log.warning(
                    "Step %d is already committed in %s; not saving it again.", step, step_dir
                )
                return
            _log.warning(
                "Step %d in %s is committed but failed its checks (%s); saving it again.",
                step, step_dir, problem,
            )
        self._last_save_time = time.monotonic()
        snapshot = self._storage.snapshot(state)
        if jax.process_index() == 0 and file_system.exists(step_dir):
            # Left by a save that never committed (a crash), or a commit that failed its
            # checks: start it afresh, uncommitted first, so a crash now leaves no torn
            # checkpoint.
            _uncommit(step_dir)
            file_system.rmtree(step_dir, ignore_errors=True)
        nonce = self._agree_on_nonce()
        temporary = self._temporary_save_interval is not None and not self._policy(step)
        self._in_flight_step = step
        self._pending = self._executor.submit(
            self._write_and_commit, step, step_dir, snapshot, extra_json, temporary, good, nonce
        )
        self._maybe_start_gc_thread()

    def _commit_problem(self, step: int, step_dir: str) -> Optional[str]:
        """Why committed `step` is no valid checkpoint, or None: it failed its checks in
        `restore`, its index fails them now (the index only: the files are not reread), or
        its verdict is bad."""
        if step in self._failed_steps:
            return self._failed_steps[step]
        try:
            index = self._load_index(step_dir)
        except CheckpointCorruptError as e:
            return str(e)
        if index.get("good") is False:
            return f"judged bad: {index.get(VERDICT_REASON) or 'no reason recorded'}"
        return None

    def _agree_on_nonce(self) -> int:
        """A number naming this save, the same on every process (also a barrier)."""
        nonce = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

            nonce = int(multihost_utils.broadcast_one_to_all(np.asarray(nonce, np.int32)))
        return nonce

    def _write_and_commit(
        self,
        step: int,
        step_dir: str,
        snapshot: StateSnapshot,
        extra: Any,
        temporary: bool,
        good: Optional[bool],
        nonce: int,
    ) -> None:
        try:
            file_system.makedirs(step_dir)
            files = self._storage.write(snapshot, step_dir)
            files = self._gather_files(step_dir, files, nonce)
            if jax.process_index() == 0:
                index = {
                    "format": _FORMAT,
                    "step": step,
                    "temporary": temporary,
                    "process_count": jax.process_count(),
                    "treedef": snapshot.treedef,
                    "arrays": {leaf.path: leaf.meta for leaf in snapshot.leaves},
                    "files": files,
                    "extra": extra,
                    "good": good,
                }
                self._commit(step_dir, index)
            self._failed_steps.pop(step, None)
        except BaseException as e:
            if jax.process_index() == 0:
                # Frees space; never committed.
                file_system.rmtree(step_dir, ignore_errors=True)
            raise CheckpointSaveError(
                f"Saving checkpoint step {step} to {step_dir} failed: {_describe(e)}. Earlier "
                f"checkpoints in {self._dir} are intact."
            ) from e
        if jax.process_index() == 0:
            self._gc_safely()

    def _gather_files(self, step_dir: str, own: dict, nonce: int) -> dict:
        """All processes' {file: checksum}; on processes other than 0, writes its own."""
        count = jax.process_count()
        if count == 1:
            return own
        manifest = {"nonce": nonce, "files": own}
        if jax.process_index() != 0:
            _write_json_atomically(
                file_system.join(step_dir, f"manifest_{jax.process_index():05d}.json"), manifest
            )
            return own
        files = dict(own)
        deadline = time.monotonic() + self._storage.config.timeout_secs
        for process in range(1, count):
            path = file_system.join(step_dir, f"manifest_{process:05d}.json")
            while True:
                if file_system.isfile(path):
                    other = _read_json(path)
                    if other.get("nonce") == nonce:
                        files.update(other["files"])
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Process {process} did not finish writing {step_dir}")
                time.sleep(0.1)
        return files

    def _commit(self, step_dir: str, index: dict) -> None:
        """Writes the index with its own checksum: from this instant on, the step is a
        checkpoint."""
        index = dict(index, **{INDEX_CHECKSUM: _index_digest(index)})
        _write_json_atomically(file_system.join(step_dir, INDEX_FILE), index)

    def wait_until_finished(self) -> None:
        """Blocks until the save in flight is committed and the queued verdicts are
        recorded; raises the first error among them."""
        pending, self._pending = self._pending, None
        verdicts, self._pending_verdicts = self._pending_verdicts, []
        errors = []
        try:
            if pending is not None:
                errors = _wait_for_all([pending], timeout=None)
        finally:
            self._in_flight_step = None
        errors += _wait_for_all(verdicts, timeout=None)
        if errors:
            raise errors[0]

    # --- verdicts ---

    def verdict(self, step: int) -> Optional[bool]:
        """The verdict committed `step`'s index records: True (good), False (bad), or None
        (none given, or the step is not committed)."""
        try:
            index = _read_json(file_system.join(self._dir, step_dir_name(step), INDEX_FILE))
        except (OSError, ValueError):
            return None
        good = index.get("good") if isinstance(index, dict) else None
        return good if isinstance(good, bool) else None

    def set_verdict(self, step: int, good: bool, *, reason: Optional[str] = None) -> None:
        """Records `good` (with `reason`, if given) as committed `step`'s verdict, without
        blocking: in the writer thread, after the save in flight. Process 0 rewrites the
        step's index with its new checksum, atomically. A step that is not committed then
        (its save failed) is left alone with a warning."""
        if jax.process_index() != 0:
            return
        self._pending_verdicts.append(
            self._executor.submit(self._write_verdict, step, bool(good), reason)
        )

    def _write_verdict(self, step: int, good: bool, reason: Optional[str]) -> None:
        step_dir = file_system.join(self._dir, step_dir_name(step))
        with self._gc_lock:  # Garbage collection reads verdicts; it must not see one torn.
            if not file_system.isfile(file_system.join(step_dir, INDEX_FILE)):
                _log.warning("No verdict for step %d: it is not committed in %s", step, self._dir)
                return
            try:
                index = self._load_index(step_dir)
            except CheckpointCorruptError as e:
                _log.warning("No verdict for step %d: %s", step, e)
                return
            index = {k: v for k, v in index.items() if k not in (INDEX_CHECKSUM, VERDICT_REASON)}
            index["good"] = good
            if reason:
                index[VERDICT_REASON] = reason
            try:
                self._commit(step_dir, index)
            except BaseException as e:
                raise CheckpointSaveError(
                    f"Recording the verdict of checkpoint step {step} in {step_dir} failed: "
                    f"{_describe(e)}"
                ) from e
        self._gc_safely()  # The newest good step may have moved: older ones may go.

    def stop(self) -> None:
        """Finishes the save in flight and stops background garbage collection."""
        self._stopped = True
        try:
            self.wait_until_finished()
        finally:
            self._gc_stop.set()
            if self._gc_thread is not None:
                self._gc_thread.join()
                self._gc_thread = None
            self._executor.shutdown(wait=True)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # --- listing ---

    def committed_steps(self) -> list[int]:
        """Steps with an index file, ascending (not yet verified)."""
        return sorted(
            step
            for step, path in _step_dirs(self._dir).items()
            if file_system.isfile(file_system.join(path, INDEX_FILE))
        )

    def latest_committed_step(self) -> Optional[int]:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def latest_good_step(self) -> Optional[int]:
        """The newest committed step saved with good=True that has not failed its checks
        in `restore`, or None."""
        for step in reversed(self.committed_steps()):
            if step not in self._failed_steps and self._index_flags(step)[1]:
                return step
        return None

    def remove_unfinished_saves(self) -> list[int]:
        """Removes the step directories without an index, the saves that a kill or crash cut
        short (none of this checkpointer's is running: `restore` calls it after waiting),
        saying so in one warning line; returns their steps. Process 0 removes them; every
        process returns the same steps."""
        self.wait_until_finished()
        unfinished = {
            step: path
            for step, path in _step_dirs(self._dir).items()
            if not file_system.isfile(file_system.join(path, INDEX_FILE))
        }
        if not unfinished:
            return []
        names = ", ".join(step_dir_name(step) for step in sorted(unfinished))
        _log.warning(
            "%s in %s: no %s, a save that a kill or crash cut short; removed (the newest "
            "committed step is %s)",
            names, self._dir, INDEX_FILE,
            self.latest_committed_step() if self.committed_steps() else "none (a fresh start)",
        )
        if jax.process_index() == 0:
            for path in unfinished.values():
                file_system.rmtree(path, ignore_errors=True)
        return sorted(unfinished)

    # --- restore ---

    def restore(
        self, *, step: Optional[int] = None, state: Any, subset: bool = False
    ) -> tuple[Optional[int], Any, Any]:
        """Restores into the template `state` (leaves: jax.Array or jax.ShapeDtypeStruct
        carrying the target sharding, or numpy values). `subset`: `state` may hold only
        some of the saved leaves (e.g. {'model': ...} for the model parameters alone); the
        others are neither checked nor read.

        Returns (step, restored_state, extra), or (None, state, None) when nothing is
        committed. With step=None, a checkpoint failing its checks is skipped with a
        warning naming the file that failed, and the previous committed one is used; the
        skipped step is then no checkpoint for garbage collection, and `save` replaces it.
        Steps judged bad (`set_verdict`) are skipped too. An explicit `step` is restored
        whatever its verdict; RestoreStepError (one line, listing the committed steps) if
        it is not committed or fails its checks.
        """
        self.wait_until_finished()
        self.remove_unfinished_saves()
        if step is not None:
            step_dir = file_system.join(self._dir, step_dir_name(step))
            if not file_system.isfile(file_system.join(step_dir, INDEX_FILE)):
                raise RestoreStepError(
                    f"No committed checkpoint for step {step} in {self._dir}; committed "
                    f"steps: {self.committed_steps()}"
                )
            candidates = [step]
        else:
            candidates = []
            for candidate in reversed(self.committed_steps()):
                if self.verdict(candidate) is False:
                    _log.warning(
                        "Skipping checkpoint step %d: judged bad (%s). --restore_step=%d "
                        "restores it anyway.", candidate,
                        self._verdict_reason(candidate) or "no reason recorded", candidate,
                    )
                    continue
                candidates.append(candidate)
        problems = []
        for candidate in candidates:
            step_dir = file_system.join(self._dir, step_dir_name(candidate))
            error: Optional[CheckpointCorruptError] = None
            restored = None
            try:
                index = self._load_index(step_dir)
                restored = self._storage.read(step_dir, index, state, subset=subset)
            except CheckpointCorruptError as e:
                error = e
            except KeyError as e:  # An index (checksum recomputed) that lacks a field.
                error = CheckpointCorruptError(f"{step_dir}/{INDEX_FILE} lacks the field {e}")
            # A template mismatch (ValueError) is the same on every process: it propagates.
            if not self._all_processes_verified(error is None) and error is None:
                error = CheckpointCorruptError(f"Another process found {step_dir} corrupt")
            if error is not None:
                if step is not None:
                    raise CorruptRestoreStepError(
                        f"Checkpoint step {step} in {self._dir} cannot be restored: {error}; "
                        f"committed steps: {self.committed_steps()}"
                    ) from error
                _log.warning(
                    "Skipping checkpoint step %d: %s. It is saved again when training "
                    "reaches that step.", candidate, error,
                )
                problems.append(str(error))
                self._failed_steps[candidate] = str(error)
                continue
            self._last_save_time = time.monotonic()
            return candidate, restored, index.get("extra")
        if problems:
            raise CheckpointCorruptError(
                f"Every committed checkpoint in {self._dir} failed its checks: {problems}"
            )
        if self.committed_steps():
            raise RestoreStepError(
                f"Every committed checkpoint in {self._dir} was judged bad (steps "
                f"{self.committed_steps()}); choose one with --restore_step=N"
            )
        return None, state, None

    def _verdict_reason(self, step: int) -> Optional[str]:
        try:
            index = _read_json(file_system.join(self._dir, step_dir_name(step), INDEX_FILE))
        except (OSError, ValueError):
            return None
        return index.get(VERDICT_REASON) if isinstance(index, dict) else None

    def _load_index(self, step_dir: str) -> dict:
        path = file_system.join(step_dir, INDEX_FILE)
        try:
            index = _read_json(path)
        except (OSError, ValueError) as e:
            raise CheckpointCorruptError(f"Cannot read {path}: {e}") from e
        if not isinstance(index, dict) or index.get("format") != _FORMAT:
            raise CheckpointCorruptError(f"{path} is not a {_FORMAT} index")
        recorded = index.get(INDEX_CHECKSUM)
        if recorded is None:
            # Written before indexes had checksums. Accepted, so that runs started before
            # still resume and older versions still read new indexes (which only add the
            # field); what the checksum guards against, a flipped byte or an edited
            # value, does not remove a field.
            _log.warning(
                "%s has no %s (written before indexes had checksums); its contents are "
                "used unchecked", path, INDEX_CHECKSUM,
            )
        elif recorded != _index_digest(index):
            raise CheckpointCorruptError(
                f"{path} fails its sha256 check ({INDEX_CHECKSUM}): the index was edited or "
                "corrupted after its commit"
            )
        return index

    @staticmethod
    def _all_processes_verified(ok: bool) -> bool:
        """Each process checks only the files it reads; all must pass to restore a step."""
        if jax.process_count() == 1:
            return ok
        from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

        return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))

    # --- garbage collection ---

    def run_garbage_collection(self) -> list[int]:
        """Deletes what the keep rules do not keep; returns the deleted steps.

        Kept: the newest committed step, the newest `keep_last_n` permanent ones, those
        divisible by `keep_every_n_steps`, and the newest saved with good=True. Steps that
        failed their checks in `restore` count as uncommitted: kept while not older than
        the newest committed step (training saves them again), deleted after.
        """
        cfg = self.config
        with self._gc_lock:
            dirs = _step_dirs(self._dir)
            committed = set(self.committed_steps()) - set(self._failed_steps)
            if not committed:
                return []
            newest = max(committed)
            flags = {s: self._index_flags(s) for s in committed}
            permanent = sorted(s for s in committed if not flags[s][0])
            keep = {newest} | set(permanent[-cfg.keep_last_n :])
            if cfg.keep_every_n_steps:
                keep |= {s for s in committed if s % cfg.keep_every_n_steps == 0}
            good = [s for s in committed if flags[s][1]]
            if good:
                keep.add(max(good))
            deleted = []
            for step, path in sorted(dirs.items()):
                if step in keep:
                    continue
                if step not in committed and (step >= newest or step == self._in_flight_step):
                    continue  # A save that may still be running, or one to be saved again.
                # Uncommit first: a crash mid-delete leaves a non-checkpoint, not a torn one.
                _uncommit(path)
                file_system.rmtree(path, ignore_errors=True)
                deleted.append(step)
            return deleted

    def _index_flags(self, step: int) -> tuple[bool, bool]:
        """(temporary, good) as the step's index records them."""
        try:
            index = _read_json(file_system.join(self._dir, step_dir_name(step), INDEX_FILE))
            return bool(index.get("temporary")), index.get("good") is True
        except (OSError, ValueError, AttributeError):
            return False, False  # Unreadable: keep by the ordinary rules; restore will judge it.

    def _gc_safely(self) -> None:
        try:
            self.run_garbage_collection()
        except OSError as e:  # Never fail a committed save because old ones linger.
            _log.warning("Checkpoint garbage collection in %s failed: %s", self._dir, e)

    def _maybe_start_gc_thread(self) -> None:
        if self._gc_thread is not None or jax.process_index() != 0:
            return

        def loop():
            while not self._gc_stop.wait(self.config.gc_loop_interval_seconds):
                self._gc_safely()

        self._gc_thread = threading.Thread(target=loop, name="checkpoint-gc", daemon=True)
        self._gc_thread.start()
