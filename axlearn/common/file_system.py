"""Files and directories at local paths or at URLs of TensorStore key-value stores.

A path is local (a plain path, or a `file://` URL) or a URL that TensorStore's
`KvStore.open` accepts: `gs://bucket/dir`, `s3://bucket/dir`, `memory://dir`, ...

- Local paths go through the os module. `write_bytes` writes a temporary file, fsyncs
  it, renames it into place and fsyncs the directory: readers see the old file or the
  whole new one, even after a crash.
- URLs go through `tensorstore.KvStore`. A "directory" is a key prefix ending in '/'; it
  exists while a key starts with it, and `makedirs` has nothing to do. A write is one
  object PUT, which object stores make atomic. URL paths are percent-encoded as
  TensorStore reads them: `join` encodes the parts it appends, and the names `listdir`
  returns are decoded.

Endpoints: TensorStore's s3 driver reads its endpoint from its spec only, so an `s3://`
URL takes the AWS SDK's variables `AWS_ENDPOINT_URL_S3` (or `AWS_ENDPOINT_URL`) as its
endpoint and `AWS_REGION` (or `AWS_DEFAULT_REGION`) as its region, for S3-compatible
servers other than AWS. Credentials come from the usual AWS variables or files, which
TensorStore reads itself.

`memory://` stores live in a TensorStore context of this process (`context()`): code
opening TensorStore arrays at these paths passes that context, or a child of it, so
that arrays and files see the same stores.

TensorStore is imported only when a URL is used: local runs do not pay its import.
"""

import functools
import json
import os
import posixpath
import shutil
import threading
import urllib.parse
from fnmatch import fnmatchcase
from typing import Any

_FILE_SCHEME = "file://"
_GLOB_CHARS = "*?["


# ----- paths -----


def is_local(path: str) -> bool:
    """Whether `path` is a plain file-system path or a `file://` URL."""
    return "://" not in path or path.startswith(_FILE_SCHEME)


def local_path(path: str) -> str:
    """The file-system path of a local path: `file:///a%20b` -> `/a b`."""
    if not is_local(path):
        raise ValueError(f"{path} is a URL of a key-value store, not a local path")
    if path.startswith(_FILE_SCHEME):
        rest = path[len(_FILE_SCHEME) :]
        if not rest.startswith("/"):
            raise ValueError(f"{path}: a file:// URL takes an absolute path (file:///dir/...)")
        return urllib.parse.unquote(rest)
    return path


def join(base: str, *parts: str) -> str:
    """`base/part/...`; on URLs, parts are percent-encoded and may not be absolute."""
    if "://" not in base:
        return os.path.join(base, *parts)
    for part in parts:
        if part.startswith("/"):
            raise ValueError(f"Cannot join the absolute path {part!r} to the URL {base}")
    quoted = [urllib.parse.quote(part, safe="/") for part in parts]
    return posixpath.join(base, *quoted)


def _split_pattern(pattern: str) -> tuple[str, str]:
    """(the longest directory without glob characters, the rest of the pattern)."""
    parts = pattern.split("/")
    for i, part in enumerate(parts):
        if any(c in part for c in _GLOB_CHARS):
            return "/".join(parts[:i]), "/".join(parts[i:])
    return pattern, ""


# ----- TensorStore -----


@functools.cache
def context() -> Any:
    """The TensorStore context holding this process's `memory://` stores."""
    import tensorstore as ts  # pylint: disable=import-outside-toplevel

    return ts.Context()


def kvstore_spec(path: str) -> dict[str, Any]:
    """The TensorStore kvstore spec (JSON) of `path`, e.g. for a zarr array's `kvstore`."""
    if is_local(path):
        return {"driver": "file", "path": local_path(path)}
    import tensorstore as ts  # pylint: disable=import-outside-toplevel

    if "|" in path:
        raise ValueError(f"{path}: kvstore adapter URLs ('|') are not supported here")
    try:
        spec = ts.KvStore.Spec(path).to_json()
    except ValueError as e:
        raise ValueError(f"{path} is not a storage URL TensorStore accepts: {e}") from e
    if spec["driver"] == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if endpoint:
            spec["endpoint"] = endpoint
        if region:
            spec["aws_region"] = region
    return spec


@functools.cache
def _open_store(root_spec_json: str) -> Any:
    import tensorstore as ts  # pylint: disable=import-outside-toplevel

    return ts.KvStore.open(json.loads(root_spec_json), context=context()).result()


def _store_and_key(url: str) -> tuple[Any, str]:
    """(the store at the root of `url`'s bucket, the key of `url` without a trailing '/')."""
    spec = kvstore_spec(url)
    key = spec.pop("path", "").rstrip("/")
    return _open_store(json.dumps(spec, sort_keys=True)), key


def _prefix(key: str) -> str:
    return f"{key}/" if key else ""


def _key_range(prefix: str) -> Any:
    """The keys that start with `prefix` (all keys for '')."""
    import tensorstore as ts  # pylint: disable=import-outside-toplevel

    if not prefix:
        return ts.KvStore.KeyRange()
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    return ts.KvStore.KeyRange(inclusive_min=prefix, exclusive_max=end)


def _result(future: Any, path: str) -> Any:
    """The future's value; TensorStore's errors become OSError naming `path`."""
    try:
        return future.result()
    except OSError:
        raise
    except ValueError as e:  # TensorStore reports storage errors as ValueError.
        raise OSError(f"{path}: {e}") from e


def _keys_under(url: str) -> tuple[Any, str, list[str]]:
    """(store, prefix, keys under the "directory" `url`, relative to it)."""
    store, key = _store_and_key(url)
    prefix = _prefix(key)
    names = _result(
        store.list(_key_range(prefix), strip_prefix_length=len(prefix.encode())), url
    )
    return store, prefix, [name.decode() for name in names]


# ----- queries -----


def isfile(path: str) -> bool:
    if is_local(path):
        return os.path.isfile(local_path(path))
    store, key = _store_and_key(path)
    return _result(store.read(key, byte_range=slice(0, 0)), path).state == "value"


def isdir(path: str) -> bool:
    """A local directory, or a URL prefix that some key starts with."""
    if is_local(path):
        return os.path.isdir(local_path(path))
    return bool(_keys_under(path)[2])


def exists(path: str) -> bool:
    if is_local(path):
        return os.path.exists(local_path(path))
    return isfile(path) or isdir(path)


def listdir(path: str) -> list[str]:
    """Names of the files and directories directly in `path`, sorted; FileNotFoundError
    if it does not exist."""
    if is_local(path):
        return sorted(os.listdir(local_path(path)))
    names = {name.split("/", 1)[0] for name in _keys_under(path)[2]}
    if not names:
        raise FileNotFoundError(f"{path}: no such directory (no key starts with it)")
    return sorted(names)


def glob(pattern: str) -> list[str]:
    """Paths matching `pattern` (`*`, `?`, `[...]` within one path component), sorted."""
    if is_local(pattern):
        import glob as glob_module  # pylint: disable=import-outside-toplevel

        if pattern.startswith(_FILE_SCHEME):
            prefix = _FILE_SCHEME
            found = glob_module.glob(local_path(pattern))
            return sorted(prefix + urllib.parse.quote(p, safe="/") for p in found)
        return sorted(glob_module.glob(pattern))
    base, rest = _split_pattern(pattern)
    if not rest:
        return [pattern] if exists(pattern) else []
    wanted = [urllib.parse.unquote(part) for part in rest.split("/")]
    matches = set()
    for name in _keys_under(base)[2]:
        parts = name.split("/")
        if len(parts) < len(wanted):
            continue
        # A match of fewer components than a key has names a directory.
        head = parts[: len(wanted)]
        if all(fnmatchcase(p, w) for p, w in zip(head, wanted)):
            matches.add("/".join(head))
    return sorted(join(base, m) for m in matches)


# ----- reading and writing -----


def read_bytes(path: str) -> bytes:
    """The file's contents; FileNotFoundError if it does not exist."""
    if is_local(path):
        with open(local_path(path), "rb") as f:
            return f.read()
    store, key = _store_and_key(path)
    result = _result(store.read(key), path)
    if result.state != "value":
        raise FileNotFoundError(f"{path}: no such file")
    return bytes(result.value)


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")


def write_bytes(path: str, data: bytes) -> None:
    """Writes the whole file; readers see the old contents or the new, never a part."""
    if not is_local(path):
        store, key = _store_and_key(path)
        _result(store.write(key, data), path)
        return
    path = local_path(path)
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(path) or ".")


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs(path: str) -> None:
    """Creates a local directory and its parents; nothing to do for a URL."""
    if is_local(path):
        os.makedirs(local_path(path), exist_ok=True)


def remove(path: str) -> None:
    """Deletes one file; FileNotFoundError for a missing local file (a missing object is
    not an error: object stores do not tell)."""
    if is_local(path):
        path = local_path(path)
        os.remove(path)
        _fsync_dir(os.path.dirname(path) or ".")
        return
    store, key = _store_and_key(path)
    _result(store.write(key, None), path)


def rmtree(path: str, *, ignore_errors: bool = False) -> None:
    """Deletes a directory and everything in it; a missing one is not an error."""
    try:
        if is_local(path):
            shutil.rmtree(local_path(path))
        else:
            store, key = _store_and_key(path)
            _result(store.delete_range(_key_range(_prefix(key))), path)
    except FileNotFoundError:
        pass
    except OSError:
        if not ignore_errors:
            raise


class _ObjectAppender:
    """A file opened for appending, over an object store, which has no append: the
    object is rewritten whole (its old contents, then what was written) at each flush."""

    def __init__(self, path: str):
        self._path = path
        try:
            self._data = bytearray(read_bytes(path))
        except FileNotFoundError:
            self._data = bytearray()
        self._dirty = False
        self.closed = False

    def write(self, data: bytes) -> int:
        if self.closed:
            raise ValueError(f"{self._path}: write to a closed file")
        self._data += data
        self._dirty = True
        return len(data)

    def flush(self) -> None:
        if self._dirty:
            write_bytes(self._path, bytes(self._data))
            self._dirty = False

    def close(self) -> None:
        if not self.closed:
            self.flush()
            self.closed = True


def fsync(file: Any) -> None:
    """Makes what was flushed to a file of `open_append` durable: fsync for a local file;
    nothing for an object, whose flush was a completed PUT."""
    if not isinstance(file, _ObjectAppender):
        os.fsync(file.fileno())


def open_append(path: str) -> Any:
    """A binary file object (`write`, `flush`, `close`) appending to `path`. Local files
    are appended to; on a URL, each `flush` rewrites the object, so flush sparingly."""
    if is_local(path):
        return open(local_path(path), "ab")  # pylint: disable=consider-using-with
    return _ObjectAppender(path)

