"""The binary token shard format: write, validate and memory-map.

A shard is one file, little-endian:

    offset  size  field
    0       8     magic b"AXLTOKEN"
    8       4     format version (2; 3 where flags are set; 1, without a manifest, is read too)
    12      4     bytes per token: 2 (uint16) or 4 (uint32)
    16      4     vocabulary size (every token id is below it)
    20      4     eos id (appended to every document)
    24      8     token count (EOS included)
    32      8     document count
    40      4     CRC-32 of the payload (everything after the header)
    44      64    vocabulary name, UTF-8, zero-padded ('bytes' or a model file's name)
    108     4     manifest size in bytes (0 in version 1)
    112     4     flags (version 3; 0 before): 1 = loss mask, 2 = preference pairs
    116     8     zero
    124     4     CRC-32 of bytes [0, 124)
    128           payload:
                  tokens       [token count]     uint16/uint32: each document then its EOS
                  (zero bytes up to a multiple of 8)
                  doc_ends     [document count]  int64: end of document i in tokens
                  doc_bytes    [document count]  int64: UTF-8 bytes of document i's text
                  loss_mask    [token count]     uint8, flag 1 only: 1 where the token trains
                  (zero bytes up to a multiple of 8, flag 1 only)
                  manifest     [manifest size]   UTF-8 JSON, sorted keys (below)

Documents are stored with EOS appended, so document i's aligned block (see
`input_packing`) is `tokens[doc_ends[i-1]:doc_ends[i]]` as targets.

A shard with a loss mask (chat data, `chat_template`) holds one byte per stored token,
aligned with the tokens: 1 where that token, as a target, counts in the loss (the
appended EOS included), 0 where it does not. Its doc_bytes count the UTF-8 bytes of the
trained text only, so that bits per byte stay nats over trained targets / their bytes.
A preference-pair shard (flag 2, with flag 1) holds pairs as consecutive documents:
2i = prompt + chosen response, 2i + 1 = prompt + rejected response, the mask 1 on the
response's tokens only. Shards without flags are written as version 2, byte for byte as
before; readers of version 2 refuse version 3 by its number.

The manifest describes the vocabulary the shard was tokenized with, e.g.
`{"vocabulary": {"bos_id": 1, "eos_id": 2, "kind": "sentencepiece", "name": "llama.model",
"pad_id": -1, "sha256": "<hex of the model file>", "size": 32000}}` (`VocabularyRecord`;
-1: no such token; kind '' and sha256 '' where unknown, as in version 1 files), and,
for chat and pair shards, how the mask was made, e.g. `{"chat": {"template_sha256": ...,
"train_on": "assistant"}}`.
"""

import dataclasses
import json
import mmap
import os
import struct
import zlib
from collections.abc import Iterable, Sequence
from typing import Optional

import numpy as np

from axlearn.common.input_base import InputError

MAGIC = b"AXLTOKEN"
VERSION = 2
FLAGGED_VERSION = 3  # The version of shards with flags (a loss mask, pairs).
_READABLE_VERSIONS = (1, 2, 3)
HEADER_SIZE = 128
_FIELDS = struct.Struct("<8sIIIIQQI64sII")  # Everything up to the reserved bytes.
FLAG_LOSS_MASK = 1  # A per-token loss mask follows doc_bytes.
FLAG_PAIRS = 2  # Documents 2i, 2i + 1 are a preference pair's chosen and rejected.
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
    manifest_size: int = 0  # Bytes of the JSON manifest ending the payload (0: none).
    flags: int = 0  # FLAG_LOSS_MASK | FLAG_PAIRS (version 3), 0 before.

    @property
    def dtype(self) -> np.dtype:
        return _DTYPES[self.itemsize]

    @property
    def has_loss_mask(self) -> bool:
        return bool(self.flags & FLAG_LOSS_MASK)

    @property
    def is_pairs(self) -> bool:
        return bool(self.flags & FLAG_PAIRS)

    def payload_size(self) -> int:
        tokens = _align8(self.num_tokens * self.itemsize)
        mask = _align8(self.num_tokens) if self.has_loss_mask else 0
        return tokens + 16 * self.num_docs + mask + self.manifest_size


@dataclasses.dataclass(frozen=True)
class VocabularyRecord:
    """The vocabulary a shard was tokenized with, as its manifest records it."""

    name: str  # 'bytes' or the model file's base name.
    size: int  # Every token id is below it.
    eos_id: int  # Ends every document.
    kind: str = ""  # 'bytes', 'sentencepiece', 'huggingface'; '' if unknown.
    sha256: str = ""  # Hex SHA-256 of the model file; '' for bytes or if unknown.
    bos_id: int = -1  # -1: none (documents are not prefixed with it).
    pad_id: int = -1  # -1: none (batches pad with 0 regardless; see input_packing).

    @classmethod
    def from_header(cls, name: str, size: int, eos_id: int) -> "VocabularyRecord":
        """What a name, size and eos id alone say: the byte vocabulary is known by name."""
        if name == "bytes":
            return cls(name=name, size=size, eos_id=eos_id, kind="bytes", pad_id=0)
        return cls(name=name, size=size, eos_id=eos_id)

    def describe(self) -> str:
        """A short human description, e.g. "'llama.model' (sentencepiece, 32000 ids)"."""
        kind = f"{self.kind}, " if self.kind else ""
        return f"'{self.name}' ({kind}{self.size} ids)"


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
        FLAGGED_VERSION if header.flags else VERSION,
        header.itemsize,
        header.vocab_size,
        header.eos_id,
        header.num_tokens,
        header.num_docs,
        header.payload_crc32,
        name,
        header.manifest_size,
        header.flags,
    )
    fields = fields.ljust(_HEADER_CRC_OFFSET, b"\0")
    return fields + struct.pack("<I", zlib.crc32(fields))


def decode_header(data: bytes, *, path: str) -> ShardHeader:
    """Parses and checks a header; errors name `path` and what was expected."""
    if len(data) < HEADER_SIZE:
        raise TokenShardError(
            f"{path}: {len(data)} bytes is shorter than the {HEADER_SIZE}-byte token shard header"
        )
    (magic, version, itemsize, vocab_size, eos_id, num_tokens, num_docs, crc, name, manifest,
     flags) = _FIELDS.unpack_from(data)
    if magic != MAGIC:
        raise TokenShardError(
            f"{path}: not an axlearn token shard (magic {magic!r}, expected {MAGIC!r}); "
            "build shards with `python -m axlearn.common.input_tokens build`"
        )
    (header_crc,) = struct.unpack_from("<I", data, _HEADER_CRC_OFFSET)
    if zlib.crc32(data[:_HEADER_CRC_OFFSET]) != header_crc:
        raise TokenShardError(f"{path}: corrupt token shard header (header checksum mismatch)")
    if version not in _READABLE_VERSIONS:
        raise TokenShardError(
            f"{path}: token shard format version {version}, expected one of {_READABLE_VERSIONS}"
        )
    if itemsize not in _DTYPES:
        raise TokenShardError(f"{path}: {itemsize} bytes per token, expected 2 or 4")
    flags = flags if version >= 3 else 0
    if flags & ~(FLAG_LOSS_MASK | FLAG_PAIRS) or (
        flags & FLAG_PAIRS and not flags & FLAG_LOSS_MASK
    ):
        raise TokenShardError(f"{path}: unknown token shard flags {flags:#x}")
    return ShardHeader(
        itemsize=itemsize,
        vocab_size=vocab_size,
        eos_id=eos_id,
        num_tokens=num_tokens,
        num_docs=num_docs,
        payload_crc32=crc,
        vocab_name=name.rstrip(b"\0").decode("utf-8", errors="replace"),
        manifest_size=manifest if version >= 2 else 0,
        flags=flags,
    )


def write_shard(
    path: str,
    documents: Sequence[np.ndarray],
    num_bytes: Sequence[int],
    *,
    vocabulary: Optional[VocabularyRecord] = None,
    vocab_name: Optional[str] = None,
    vocab_size: Optional[int] = None,
    eos_id: Optional[int] = None,
    loss_masks: Optional[Sequence[np.ndarray]] = None,
    pairs: bool = False,
    manifest_extra: Optional[dict] = None,
) -> ShardHeader:
    """Writes tokenized documents (without EOS) to `path` atomically; skips empty ones.

    The vocabulary is `vocabulary`, or, given as `vocab_name`, `vocab_size` and `eos_id`,
    `VocabularyRecord.from_header` of them. `loss_masks`: per document, 0/1 for each of
    its tokens and then its EOS (length + 1), written as the shard's loss mask. `pairs`:
    the documents are preference pairs (chosen, rejected, ...; needs `loss_masks`, and no
    document may be empty). `manifest_extra`: more JSON fields of the manifest.
    """
    names = (vocab_name, vocab_size, eos_id)
    if (vocabulary is None) == all(v is None for v in names) or (
        vocabulary is None and None in names
    ):
        raise TypeError("write_shard takes `vocabulary` or all of vocab_name, vocab_size, eos_id")
    if vocabulary is None:
        vocabulary = VocabularyRecord.from_header(vocab_name, vocab_size, eos_id)
    vocab_size, eos_id = vocabulary.size, vocabulary.eos_id
    if pairs and (loss_masks is None or len(documents) % 2):
        raise ValueError(f"{path}: preference pairs need loss masks and an even document count")
    masks = [None] * len(documents) if loss_masks is None else list(loss_masks)
    kept = [
        (np.asarray(d), int(b), m) for d, b, m in zip(documents, num_bytes, masks) if len(d)
    ]
    if pairs and len(kept) != len(documents):
        raise ValueError(f"{path}: a preference pair's document is empty")
    for doc, _, mask in kept:
        if mask is not None and np.shape(mask) != (doc.size + 1,):
            raise ValueError(f"{path}: a loss mask needs one entry per token and one for EOS")
    itemsize = token_itemsize(vocab_size)
    dtype = _DTYPES[itemsize]
    lengths = np.array([d.size + 1 for d, _, _ in kept], dtype=np.int64)
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths)
    for (doc, _, _), end, length in zip(kept, ends, lengths):
        if doc.size and (doc.min() < 0 or doc.max() >= vocab_size):
            raise ValueError(f"{path}: token ids outside [0, {vocab_size})")
        tokens[end - length : end - 1] = doc
        tokens[end - 1] = eos_id
    fields = dict(manifest_extra or {}, vocabulary=dataclasses.asdict(vocabulary))
    manifest = json.dumps(fields, sort_keys=True)
    parts = [
        memoryview(tokens).cast("B"),
        b"\0" * (_align8(tokens.nbytes) - tokens.nbytes),
        ends.astype("<i8").tobytes(),
        np.array([b for _, b, _ in kept], dtype="<i8").tobytes(),
    ]
    flags = 0
    if loss_masks is not None:
        flags = FLAG_LOSS_MASK | (FLAG_PAIRS if pairs else 0)
        mask = np.concatenate(
            [np.ones(doc.size + 1, np.uint8) if m is None else np.asarray(m) for doc, _, m in kept]
            or [np.empty(0, np.uint8)]
        )
        mask = (mask != 0).astype(np.uint8)
        parts += [mask.tobytes(), b"\0" * (_align8(mask.size) - mask.size)]
    parts.append(manifest.encode("utf-8"))
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    header = ShardHeader(
        itemsize=itemsize,
        vocab_size=vocab_size,
        eos_id=eos_id,
        num_tokens=tokens.size,
        num_docs=len(kept),
        payload_crc32=crc,
        vocab_name=vocabulary.name,
        manifest_size=len(parts[-1]),
        flags=flags,
    )
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(encode_header(header))
            for part in parts:
                f.write(part)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
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
        mask_start = doc_start + 16 * header.num_docs
        manifest_start = mask_start
        # Per token, 1 where it trains as a target; None: every token does.
        self.loss_mask: Optional[np.ndarray] = None
        if header.has_loss_mask:
            self.loss_mask = np.frombuffer(self._map, np.uint8, header.num_tokens, mask_start)
            manifest_start += _align8(header.num_tokens)
        if header.is_pairs and header.num_docs % 2:
            raise TokenShardError(f"{path}: a preference-pair shard with an odd document count")
        manifest = self._map[manifest_start : manifest_start + header.manifest_size]
        self.vocabulary = read_manifest(manifest, header, path=path)
        self.manifest = json.loads(bytes(manifest).decode("utf-8")) if manifest else {}


def check_vocabulary(
    path: str,
    header: ShardHeader,
    *,
    vocab_name: Optional[str] = None,
    model_vocab_size: Optional[int] = None,
) -> None:
    """Raises if the shard at `path` (its header) was tokenized with another vocabulary
    than the model's: another name, or more ids than the model's vocab_size."""
    if vocab_name is not None and header.vocab_name != vocab_name:
        raise TokenShardError(
            f"{path}: tokenized with vocabulary '{header.vocab_name}', but the model "
            f"expects '{vocab_name}'"
        )
    if model_vocab_size is not None and header.vocab_size > model_vocab_size:
        raise TokenShardError(
            f"{path}: vocabulary '{header.vocab_name}' has {header.vocab_size} ids, more "
            f"than the model's vocab_size {model_vocab_size}; "
            f"{vocab_size_remedy(header.vocab_size)}"
        )


def vocab_size_remedy(shard_vocab_size: int) -> str:
    """What fixes shards whose vocabulary has more ids than the model: the launcher's
    override of the model's vocab_size (the inputs' copies follow it), or other shards."""
    return (
        f"raise the model's with --config_override=model.decoder.vocab_size={shard_vocab_size} "
        "(or larger), or build the shards with the model's vocabulary"
    )


def read_manifest(data: bytes, header: ShardHeader, *, path: str) -> VocabularyRecord:
    """The vocabulary record of a shard's manifest (from the header alone if it has none)."""
    fallback = VocabularyRecord.from_header(header.vocab_name, header.vocab_size, header.eos_id)
    if not data:
        return fallback
    try:
        record = VocabularyRecord(**json.loads(bytes(data).decode("utf-8"))["vocabulary"])
    except (ValueError, KeyError, TypeError) as e:
        raise TokenShardError(f"{path}: corrupt token shard manifest ({e})") from None
    if (record.name, record.size, record.eos_id) != (fallback.name, fallback.size, fallback.eos_id):
        raise TokenShardError(
            f"{path}: manifest vocabulary {record.describe()} (eos {record.eos_id}) disagrees "
            f"with the header {fallback.describe()} (eos {fallback.eos_id})"
        )
    return record


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
