"""The binary token shard format: write, validate and memory-map.

A shard is one file, little-endian:

    offset  size  field
    0       8     magic b"AXLTOKEN"
    8       4     format version (1)
    12      4     bytes per token: 2 (uint16) or 4 (uint32)
    16      4     vocabulary size (every token id is below it)
    20      4     eos id (appended to every document)
    24      8     token count (EOS included)
    32      8     document count
    40      4     CRC-32 of the payload (everything after the header)
    44      64    vocabulary name, UTF-8, zero-padded ('bytes' or a model file's name)
    108     16    zero
    124     4     CRC-32 of bytes [0, 124)
    128           payload:
                  tokens       [token count]     uint16/uint32: each document then its EOS
                  (zero bytes up to a multiple of 8)
                  doc_ends     [document count]  int64: end of document i in tokens
                  doc_bytes    [document count]  int64: UTF-8 bytes of document i's text

Documents are stored with EOS appended, so document i's aligned block (see
`input_packing`) is `tokens[doc_ends[i-1]:doc_ends[i]]` as targets.
"""

import dataclasses
import mmap
import os
import struct
import zlib
from collections.abc import Iterable, Sequence
from typing import Optional

import numpy as np

from axlearn.common.input_base import InputError

MAGIC = b"AXLTOKEN"
VERSION = 1
HEADER_SIZE = 128
_FIELDS = struct.Struct("<8sIIIIQQI64s")  # Everything up to the reserved bytes.
_HEADER_CRC_OFFSET = 124
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


class TokenShardError(InputError):
    """A token shard that is missing, corrupt or does not match what the reader expects."""


@dataclasses.dataclass(frozen=True)
class ShardHeader:
    """The fixed header of a token shard."""

    itemsize: int
    vocab_size: int
    eos_id: int
    num_tokens: int
    num_docs: int
    payload_crc32: int
    vocab_name: str

    @property
    def dtype(self) -> np.dtype:
        return _DTYPES[self.itemsize]

    def payload_size(self) -> int:
        return _align8(self.num_tokens * self.itemsize) + 16 * self.num_docs


def _align8(n: int) -> int:
    return -(-n // 8) * 8


def token_itemsize(vocab_size: int) -> int:
    """2 bytes per token when ids fit in uint16, else 4."""
    return 2 if vocab_size <= 1 << 16 else 4


def encode_header(header: ShardHeader) -> bytes:
    name = header.vocab_name.encode("utf-8")
    if len(name) > 64:
        raise ValueError(f"Vocabulary name {header.vocab_name!r} is longer than 64 bytes")
    fields = _FIELDS.pack(
        MAGIC,
        VERSION,
        header.itemsize,
        header.vocab_size,
        header.eos_id,
        header.num_tokens,
        header.num_docs,
        header.payload_crc32,
        name,
    )
    fields = fields.ljust(_HEADER_CRC_OFFSET, b"\0")
    return fields + struct.pack("<I", zlib.crc32(fields))


def decode_header(data: bytes, *, path: str) -> ShardHeader:
    """Parses and checks a header; errors name `path` and what was expected."""
    if len(data) < HEADER_SIZE:
        raise TokenShardError(
            f"{path}: {len(data)} bytes is shorter than the {HEADER_SIZE}-byte token shard header"
        )
    magic, version, itemsize, vocab_size, eos_id, num_tokens, num_docs, crc, name = (
        _FIELDS.unpack_from(data)
    )
    if magic != MAGIC:
        raise TokenShardError(
            f"{path}: not an axlearn token shard (magic {magic!r}, expected {MAGIC!r}); "
            "build shards with `python -m axlearn.common.input_tokens build`"
        )
    (header_crc,) = struct.unpack_from("<I", data, _HEADER_CRC_OFFSET)
    if zlib.crc32(data[:_HEADER_CRC_OFFSET]) != header_crc:
        raise TokenShardError(f"{path}: corrupt token shard header (header checksum mismatch)")
    if version != VERSION:
        raise TokenShardError(f"{path}: token shard format version {version}, expected {VERSION}")
    if itemsize not in _DTYPES:
        raise TokenShardError(f"{path}: {itemsize} bytes per token, expected 2 or 4")
    return ShardHeader(
        itemsize=itemsize,
        vocab_size=vocab_size,
        eos_id=eos_id,
        num_tokens=num_tokens,
        num_docs=num_docs,
        payload_crc32=crc,
        vocab_name=name.rstrip(b"\0").decode("utf-8", errors="replace"),
    )


def write_shard(
    path: str,
    documents: Sequence[np.ndarray],
    num_bytes: Sequence[int],
    *,
    vocab_name: str,
    vocab_size: int,
    eos_id: int,
) -> ShardHeader:
    """Writes tokenized documents (without EOS) to `path` atomically; skips empty ones."""
    kept = [(np.asarray(d), int(b)) for d, b in zip(documents, num_bytes) if len(d)]
    itemsize = token_itemsize(vocab_size)
    dtype = _DTYPES[itemsize]
    lengths = np.array([d.size + 1 for d, _ in kept], dtype=np.int64)
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths)
    for (doc, _), end, length in zip(kept, ends, lengths):
        if doc.size and (doc.min() < 0 or doc.max() >= vocab_size):
            raise ValueError(f"{path}: token ids outside [0, {vocab_size})")
        tokens[end - length : end - 1] = doc
        tokens[end - 1] = eos_id
    token_bytes = tokens.tobytes()
    payload = b"".join(
        [
            token_bytes,
            b"\0" * (_align8(len(token_bytes)) - len(token_bytes)),
            ends.astype("<i8").tobytes(),
            np.array([b for _, b in kept], dtype="<i8").tobytes(),
        ]
    )
    header = ShardHeader(
        itemsize=itemsize,
        vocab_size=vocab_size,
        eos_id=eos_id,
        num_tokens=tokens.size,
        num_docs=len(kept),
        payload_crc32=zlib.crc32(payload),
        vocab_name=vocab_name,
    )
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(encode_header(header))
        f.write(payload)
    os.replace(tmp, path)
    return header


class TokenShard:
    """A memory-mapped shard: `tokens`, `doc_ends` and `doc_bytes` are read-only arrays."""

    def __init__(self, path: str, *, verify_checksum: bool = True):
        self.path = path
        if not os.path.isfile(path):
            raise TokenShardError(f"{path}: token shard file does not exist")
        with open(path, "rb") as f:
            self.header = decode_header(f.read(HEADER_SIZE), path=path)
            size = os.fstat(f.fileno()).st_size
            expected = HEADER_SIZE + self.header.payload_size()
            if size != expected:
                raise TokenShardError(
                    f"{path}: file has {size} bytes; its header ({self.header.num_tokens} tokens, "
                    f"{self.header.num_docs} documents) implies {expected} (truncated or corrupt)"
                )
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        header = self.header
        payload = memoryview(self._map)[HEADER_SIZE:]
        if verify_checksum and zlib.crc32(payload) != header.payload_crc32:
            raise TokenShardError(f"{path}: corrupt token shard payload (checksum mismatch)")
        doc_start = HEADER_SIZE + _align8(header.num_tokens * header.itemsize)
        self.tokens = np.frombuffer(self._map, header.dtype, header.num_tokens, HEADER_SIZE)
        self.doc_ends = np.frombuffer(self._map, "<i8", header.num_docs, doc_start)
        self.doc_bytes = np.frombuffer(
            self._map, "<i8", header.num_docs, doc_start + 8 * header.num_docs
        )
        # Every stored document has at least one token and its EOS.
        lengths = np.diff(self.doc_ends, prepend=0)
        last_end = self.doc_ends[-1] if header.num_docs else 0
        if last_end != header.num_tokens or np.any(lengths < 2):
            raise TokenShardError(f"{path}: document boundaries do not match the token count")

    def check_vocabulary(
        self, *, vocab_name: Optional[str] = None, model_vocab_size: Optional[int] = None
    ) -> None:
        """Raises if the shard was tokenized with another vocabulary than the model's."""
        header = self.header
        if vocab_name is not None and header.vocab_name != vocab_name:
            raise TokenShardError(
                f"{self.path}: tokenized with vocabulary '{header.vocab_name}', but the model "
                f"expects '{vocab_name}'"
            )
        if model_vocab_size is not None and header.vocab_size > model_vocab_size:
            raise TokenShardError(
                f"{self.path}: vocabulary '{header.vocab_name}' has {header.vocab_size} ids, more "
                f"than the model's vocab_size {model_vocab_size}"
            )


def expand_paths(patterns: Iterable[str]) -> list[str]:
    """Files named by `patterns` (globs allowed), sorted; raises for patterns matching none."""
    import glob  # pylint: disable=import-outside-toplevel

    paths = []
    for pattern in patterns:
        is_glob = any(c in pattern for c in "*?[")
        matches = sorted(glob.glob(pattern)) if is_glob else [pattern]
        if not matches:
            raise TokenShardError(f"{pattern}: no token shard files match this pattern")
        for match in matches:
            if not os.path.isfile(match):
                raise TokenShardError(f"{match}: token shard file does not exist")
        paths.extend(matches)
    return paths
