"""Compiled programs stored whole in a run's directory, so that its restarts skip the trace.

jax's compilation cache (`compilation_cache`) saves a restart the compile, not the trace
and lowering that compute the cache's key: for gpt_1b those take longer than restoring its
state. A restart of the same run, with the same code, jax and devices, compiles exactly
what the last start compiled; `ExecutableStore` keeps that executable
(`jax.experimental.serialize_executable`) in `<trainer_dir>/compiled/` and loads it
instead of tracing, lowering and compiling again:

    store = ExecutableStore(run.compiled, "train_step", config_text)
    key = store.key(abstract_args)
    compiled = store.load(key)  # None: nothing stored for these arguments
    if compiled is None:
        compiled = jitted.lower(*abstract_args).compile()
        store.save(key, compiled)

An entry's key (`entry_key`) digests all that decides the program: the config text, the
abstract arguments (tree, shapes, dtypes, shardings), the source of every module of the
process outside the Python installation and of all of `axlearn` and `experiments`, the
versions of jax, its plugins and the libraries it traces through, the devices and
processes, XLA's flags and jax's options. A change to any of them names another entry, so
the restart compiles (and stores that one in place of the old). An entry that cannot be
read (damaged, cut short, from another format) is one warning, and the program compiles.

Each process stores its own executable. The directory is trusted as jax's own cache is:
an entry is machine code that runs when loaded.
"""

import functools
import hashlib
import importlib.metadata
import logging
import os
import pickle
import sys
from collections.abc import Iterator
from typing import Any, Optional

from axlearn.common import file_system

log = logging.getLogger(__name__)

# The first line of every entry; another means another format (refused, then replaced).
MAGIC = b"axlearn-compiled-executable-v1\n"
# The distributions whose code a trace runs or whose version changes a compile.
_VERSIONED = ("jax", "jaxlib", "numpy", "optax", "ml_dtypes")
# Environment variables that change what XLA compiles.
_ENV_PREFIXES = ("XLA_", "LIBTPU_", "JAX_", "AXLEARN_", "NVIDIA_TF32", "CUDA_VISIBLE_DEVICES")
# The packages whose every module is digested, loaded or not (a trace imports lazily).
_PACKAGES = ("axlearn", "experiments")


class UnreadableEntryError(ValueError):
    """A stored entry that is not one this module wrote for its key."""


def _installation_roots() -> tuple[str, ...]:
    """The directories of the Python installation: modules under them are versioned
    (`_versions`), not digested."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    roots.update(p for p in sys.path if "site-packages" in p or "dist-packages" in p)
    return tuple(os.path.join(os.path.realpath(r), "") for r in roots if r)


def _package_sources() -> Iterator[str]:
    """The .py files of the loaded `_PACKAGES` and of every other loaded module whose file
    lies outside the Python installation."""
    roots = _installation_roots()
    seen: set[str] = set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not path:
            continue
        path = os.path.realpath(path)
        if name in _PACKAGES:
            for dirpath, dirnames, filenames in os.walk(os.path.dirname(path)):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__")))
                for filename in sorted(filenames):
                    if filename.endswith(".py"):
                        seen.add(os.path.join(dirpath, filename))
        elif path.endswith(".py") and not path.startswith(roots):
            seen.add(path)
    yield from sorted(seen)


def source_digest() -> str:
    """sha256 of the source files `_package_sources` names (paths and contents)."""
    digest = hashlib.sha256()
    for path in _package_sources():
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            data = b"<unreadable>"
        digest.update(path.encode() + b"\0" + hashlib.sha256(data).digest())
    return digest.hexdigest()


def _versions() -> list[str]:
    names = list(_VERSIONED)
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(("jax-cuda", "jax_cuda", "jax-rocm", "libtpu")):
            names.append(name)
    found = []
    for name in sorted(set(names)):
        try:
            found.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name}: absent")
    return found


@functools.lru_cache(maxsize=1)
def _installed_parts() -> tuple[str, ...]:
    # Read once a process (about 0.1 s): the code does not change under a running process.
    return (*_versions(), f"python {sys.version}", f"sources {source_digest()}")


def environment_parts() -> list[str]:
    """What of the process decides a compile besides the config and the arguments:
    versions and the source digest, devices and processes, XLA flags and jax options."""
    import jax  # pylint: disable=import-outside-toplevel

    devices = jax.devices()
    env = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES))
    options = sorted(f"{k}={v!r}" for k, v in jax.config.values.items())
    return [
        *_installed_parts(),
        f"backend {jax.default_backend()} {devices[0].client.platform_version}",
        f"devices {[(d.id, d.process_index, d.device_kind) for d in devices]}",
        f"process {jax.process_index()} of {jax.process_count()}",
        *env,
        *options,
    ]


def abstract_parts(args: Any) -> list[str]:
    """One line for the tree of `args` and one a leaf: its path, shape, dtype, sharding."""
    import jax  # pylint: disable=import-outside-toplevel

    leaves, tree = jax.tree_util.tree_flatten_with_path(args)
    parts = [str(tree)]
    for path, leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        parts.append(
            f"{jax.tree_util.keystr(path)} {getattr(leaf, 'shape', None)} "
            f"{getattr(leaf, 'dtype', None)} {sharding!r}"
        )
    return parts


def entry_key(salt: str, args: Any) -> str:
    """The key of the program compiled for `salt` (the config text) and the abstract
    arguments `args` in this process (module docstring)."""
    digest = hashlib.sha256(salt.encode())
    for part in (*environment_parts(), *abstract_parts(args)):
        digest.update(b"\n" + part.encode())
    return digest.hexdigest()[:32]


def encode_entry(key: str, compiled: Any) -> bytes:
    """`compiled` (a `jax.stages.Compiled`) as an entry's bytes: MAGIC, then its key, its
    executable and its argument and result trees."""
    from jax.experimental import serialize_executable  # pylint: disable=import-outside-toplevel

    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    return MAGIC + pickle.dumps((key, payload, in_tree, out_tree), protocol=5)


def decode_entry(data: bytes, key: str) -> Any:
    """The executable (`jax.stages.Compiled`, loaded on this process's devices) an entry's
    bytes hold; UnreadableEntryError where they are not an entry for `key`."""
    from jax.experimental import serialize_executable  # pylint: disable=import-outside-toplevel

    if not data.startswith(MAGIC):
        raise UnreadableEntryError("not an entry of this format")
    try:
        stored_key, payload, in_tree, out_tree = pickle.loads(data[len(MAGIC):])
    except Exception as e:  # pylint: disable=broad-except
        raise UnreadableEntryError(f"damaged or cut short ({type(e).__name__})") from None
    if stored_key != key:
        raise UnreadableEntryError("stored under another key")
    return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)


class ExecutableStore:
    """The entries of one program, `name`, in `directory` (a local path or URL), keyed by
    `salt` (the config text) and the arguments (`entry_key`); one file a process,
    `<name>-p<process index>-<key>.bin`, its older ones removed when a new one is saved."""

    def __init__(self, directory: str, name: str, salt: str):
        self.directory = directory
        self.name = name
        self._salt = salt

    def path(self, key: str) -> str:
        """The entry of `key` for this process."""
        import jax  # pylint: disable=import-outside-toplevel

        return file_system.join(self.directory, f"{self.name}-p{jax.process_index()}-{key}.bin")

    def key(self, args: Any) -> str:
        """The key of the program compiled for the abstract arguments `args` (`entry_key`)."""
        return entry_key(self._salt, args)

    def load(self, key: str) -> Optional[Any]:
        """The executable stored under `key`; None where none is, or where the stored one
        cannot be read or loaded (a warning)."""
        path = self.path(key)
        try:
            data = file_system.read_bytes(path)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("%s cannot be read (%s): compiling %s instead", path, e, self.name)
            return None
        try:
            return decode_entry(data, key)
        except Exception as e:  # pylint: disable=broad-except
            log.warning(
                "%s cannot be loaded (%s): compiling %s instead, and replacing it",
                path, str(e).splitlines()[0][:200] if str(e) else type(e).__name__, self.name,
            )
            return None

    def save(self, key: str, compiled: Any) -> None:
        """Stores `compiled` under `key` (a few MB: well under a second), removing this
        process's older entries; an entry that cannot be made or written is logged and
        forgotten. In the caller's thread: a thread of its own could be cut off inside
        jax's serializer as the process exits, which aborts it."""
        path = self.path(key)
        try:
            data = encode_entry(key, compiled)
        except Exception as e:  # pylint: disable=broad-except
            log.info("%s is not stored for restarts: %s", self.name, e)
            return
        try:
            file_system.makedirs(self.directory)
            self._remove_older(keep=path)
            file_system.write_bytes(path, data)
        except OSError as e:
            log.warning("%s cannot be written (%s): restarts compile %s", path, e, self.name)
            return
        log.info("Stored %s for restarts: %s (%.1f MB)", self.name, path, len(data) / 1e6)

    def _remove_older(self, keep: str) -> None:
        """Removes this process's other entries (those of earlier starts)."""
        for path in file_system.glob(self.path("*")):
            if path != keep:
                file_system.remove(path)
