"""The TF-free input path: packed language-model batches from memory-mapped token shards.

`TokenShardInput` reads shards written by the `build` command (format in
`input_token_format`) and packs them as `input_packing` specifies. Every batch is
computed directly from its index (no sequential state), which makes it

- deterministic: training visits documents in a new order each epoch, a permutation
  drawn from (seed, epoch);
- resumable: restoring `{'batches_consumed': n}` continues with batch n exactly;
- fast: a batch is a few vectorized NumPy gathers from the memory map, produced
  `prefetch_batches` ahead in a background thread; the trainer puts each on the devices
  as it dispatches the step.

Streams and processes. Training cuts the corpus (shards in path order, each one's
documents in order) into `num_streams` = G contiguous ranges of whole documents holding
about equal tokens; stream g packs range g, in its own order each epoch, into rows
[g*B/G, (g+1)*B/G) of every global batch of B rows. A process computes the rows it owns
(`host_rows`) and opens only the shards of their streams: with G a multiple of the
process count P, processes read disjoint shares of the documents, each opening about
1/P of the shards (a shard where two ranges meet is opened by both). Batches depend on
G, never on P: one process produces what several produce together, and a run resumes
on another number of hosts with the same data. G = 1 is a single stream, which every
process reads whole; it is the default for a single shard, and for corpora too small to
give each stream `min_stream_tokens`. Evaluation reads one stream in order (every
process opens every shard for its rows of each batch), so its results depend on neither
G nor P.

Building the input reads every shard's header (vocabulary and size checks, stream
ranges); a shard's payload is mapped and checksummed when a stream first needs it, so a
truncated or corrupt shard is reported at the first batch that reads it.

Shard paths may be storage URLs (`gs://`, `s3://`, ..., see `file_system`), globs
included. Shards are memory-mapped, so a shard at a URL is first copied whole to a local
temporary file (in $TMPDIR, removed once mapped: the mapping keeps its data).

Commands:
    python -m axlearn.common.input_tokens build --vocab=bytes --output=DIR/train FILE...
        Tokenizes text files (one document each) or JSON lines (`.jsonl`, field "text"
        per line) into DIR/train-00000.tok, ...
    python -m axlearn.common.input_tokens bench --global_batch_size=4 --max_sequence_length=4096
        Measures batches/s of the loader on synthetic shards.
"""

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Optional

import numpy as np

from axlearn.common import file_system
from axlearn.common.config import REQUIRED, ConfigError, Required, config_class
from axlearn.common.input_base import BaseInput, Batch, InputError
from axlearn.common.input_packing import byte_shares, chunk_features
from axlearn.common.input_prefetch import prefetch_in_thread
from axlearn.common.input_token_format import (
    HEADER_SIZE,
    ShardHeader,
    TokenShard,
    TokenShardError,
    decode_header,
    expand_paths,
    write_shard,
)
from axlearn.common.input_vocab import ByteVocabulary, load_vocabulary, vocabulary_name
from axlearn.common.module import Module


class TokenCorpus:
    """Documents of consecutive shards, seen as one corpus, and the packed stream over it.

    `start_range` = (lo, hi) keeps only the documents that start at token positions
    [lo, hi) of the shards' concatenation (a stream's share); None keeps them all.
    """

    def __init__(
        self,
        shards: Sequence[TokenShard],
        *,
        seed: Sequence[int],
        shuffle: bool,
        start_range: Optional[tuple[int, int]] = None,
    ):
        if not shards:
            raise TokenShardError("No token shards given")
        check_same_vocabulary([(shard.path, shard.header) for shard in shards])
        self.paths = [shard.path for shard in shards]
        self.eos_id = shards[0].header.eos_id
        self._seed = list(seed)
        self._shuffle = shuffle
        self._tokens = [shard.tokens for shard in shards]
        sizes = np.array([shard.header.num_tokens for shard in shards], dtype=np.int64)
        self._shard_starts = np.concatenate([[0], np.cumsum(sizes)])
        ends = np.concatenate(
            [
                shard.doc_ends.astype(np.int64) + start
                for shard, start in zip(shards, self._shard_starts)
            ]
        )
        lengths = np.diff(ends, prepend=0)
        starts = ends - lengths
        doc_bytes = np.concatenate([shard.doc_bytes.astype(np.int64) for shard in shards])
        if start_range is not None:
            keep = (starts >= start_range[0]) & (starts < start_range[1])
            lengths, starts, doc_bytes = lengths[keep], starts[keep], doc_bytes[keep]
        self.doc_lengths = lengths
        self.doc_starts = starts
        self.doc_bytes = doc_bytes
        self.num_tokens = int(lengths.sum())  # Aligned positions per epoch.
        self._orders: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(documents in epoch order, end of each one's block within the epoch)."""
        if epoch not in self._orders:
            num_docs = self.doc_lengths.size
            if self._shuffle:
                order = np.random.default_rng([*self._seed, epoch]).permutation(num_docs)
            else:
                order = np.arange(num_docs)
            if len(self._orders) >= 4:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = (order, np.cumsum(self.doc_lengths[order]))
        return self._orders[epoch]

    def _gather(self, index: np.ndarray) -> np.ndarray:
        if len(self._tokens) == 1:
            return self._tokens[0][index]
        out = np.empty(index.shape, dtype=np.int64)
        shard = np.searchsorted(self._shard_starts, index, side="right") - 1
        for i, tokens in enumerate(self._tokens):
            mask = shard == i
            if mask.any():
                out[mask] = tokens[index[mask] - self._shard_starts[i]]
        return out

    def features(self, positions: np.ndarray, valid: np.ndarray) -> Batch:
        """Batch features of aligned stream positions [rows, T] (see input_packing)."""
        flat = np.where(valid, positions, 0).ravel()
        epoch = flat // self.num_tokens
        offset = flat - epoch * self.num_tokens
        doc = np.empty_like(flat)
        block_start = np.empty_like(flat)
        first, last = int(epoch.min()), int(epoch.max())
        for e in range(first, last + 1):
            mask = slice(None) if first == last else epoch == e
            order, ends = self._order(e)
            block = np.searchsorted(ends, offset[mask], side="right")
            doc[mask] = order[block]
            block_start[mask] = ends[block] - self.doc_lengths[order[block]]
        j = offset - block_start  # Offset of the position within its document's block.
        index = self.doc_starts[doc] + j
        targets = self._gather(index)
        inputs = np.where(j == 0, self.eos_id, self._gather(np.maximum(index - 1, 0)))
        shares = byte_shares(self.doc_bytes[doc], j, self.doc_lengths[doc])
        shape = positions.shape
        return chunk_features(
            inputs.reshape(shape),
            targets.reshape(shape),
            (j == 0).reshape(shape),
            shares.reshape(shape),
            valid,
        )


class TokenShardInput(BaseInput):
    """Packed LM batches from token shards (see the module docstring)."""

    @config_class
    class Config(BaseInput.Config):
        """Configures TokenShardInput."""

        global_batch_size: Required[int] = REQUIRED  # Rows of a global batch, all processes.
        max_sequence_length: Required[int] = REQUIRED  # T: tokens per row.
        # Shard files or glob patterns: local paths or storage URLs.
        paths: Required[Sequence[str]] = REQUIRED
        seed: int = 0  # Seeds the per-epoch document order.
        shuffle: bool = True  # Training only: a new document order every epoch.
        # The model's vocabulary: shards made with another name, or with more ids than the
        # model's vocab_size, are rejected. None: not checked.
        vocab_name: Optional[str] = None
        model_vocab_size: Optional[int] = None
        # Training: streams the corpus is cut into, each feeding its own block of rows (see
        # the module docstring); must divide global_batch_size. None: 1 for a single shard,
        # else the most streams that leave each at least min_stream_tokens tokens.
        num_streams: Optional[int] = None
        min_stream_tokens: int = 1 << 22  # Smallest stream num_streams=None makes.
        prefetch_batches: int = 2  # Batches computed ahead in a background thread (0: none).
        verify_checksums: bool = True  # CRC-check each shard's payload when opening it.

    def __init__(self, cfg: Config, *, parent: Optional[Module], **kwargs):
        super().__init__(cfg, parent=parent, **kwargs)
        cfg = self.config
        if cfg.max_sequence_length <= 0 or cfg.global_batch_size <= 0:
            raise ConfigError(
                f"{self.path()}: global_batch_size and max_sequence_length must be positive"
            )
        self._paths = self._shard_paths()
        if not self._paths:
            raise InputError(f"{self.path()}: no token shards configured")
        self._headers = read_shard_headers(self._paths)
        for path, header in zip(self._paths, self._headers):
            check_vocabulary(
                path, header, vocab_name=cfg.vocab_name, model_vocab_size=cfg.model_vocab_size
            )
        check_same_vocabulary(list(zip(self._paths, self._headers)))
        sizes = [header.num_tokens for header in self._headers]
        self._shard_starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self._num_tokens = int(self._shard_starts[-1])
        if self._num_tokens == 0:
            raise InputError(f"{self.path()}: the shards {self._paths} hold no documents")
        self._num_streams = self._resolve_num_streams() if cfg.is_training else 1
        self._shards: dict[str, TokenShard] = {}  # Opened on first use.
        self._streams: dict[int, TokenCorpus] = {}
        self._lock = threading.Lock()

    def _shard_paths(self) -> list[str]:
        paths = self.config.paths
        if isinstance(paths, str):
            paths = [paths]
        return expand_shard_paths(paths)

    def _resolve_num_streams(self) -> int:
        cfg = self.config
        batch = cfg.global_batch_size
        if cfg.num_streams is None:
            if len(self._paths) == 1:
                return 1
            fitting = [
                n
                for n in range(1, batch + 1)
                if batch % n == 0 and self._num_tokens // n >= cfg.min_stream_tokens
            ]
            return max(fitting, default=1)
        if cfg.num_streams <= 0 or batch % cfg.num_streams:
            raise ConfigError(
                f"{self.path()}.num_streams: {cfg.num_streams} does not divide "
                f"global_batch_size {batch}"
            )
        return cfg.num_streams

    # ----- the corpus and its streams -----

    @property
    def num_streams(self) -> int:
        """Streams of the global batch (1 for evaluation)."""
        return self._num_streams

    @property
    def vocabulary(self) -> tuple[str, int, int]:
        """(vocabulary name, vocabulary size, eos id) of the shards."""
        header = self._headers[0]
        return header.vocab_name, header.vocab_size, header.eos_id

    @property
    def opened_paths(self) -> list[str]:
        """The shards this process has opened so far (its streams' shares)."""
        with self._lock:
            return sorted(self._shards)

    def stream_of_rows(self, rows: np.ndarray) -> np.ndarray:
        """The stream feeding each row of a global batch."""
        return rows // (self.global_batch_size // self._num_streams)

    def stream_share(self, stream: int) -> tuple[list[int], tuple[int, int]]:
        """(indices of the shards holding `stream`'s documents, the corpus token positions
        [lo, hi) where its documents start)."""
        lo = stream * self._num_tokens // self._num_streams
        hi = (stream + 1) * self._num_tokens // self._num_streams
        starts, ends = self._shard_starts[:-1], self._shard_starts[1:]
        return np.flatnonzero((starts < hi) & (ends > lo)).tolist(), (lo, hi)

    def _shard(self, path: str, header: ShardHeader) -> TokenShard:
        if path not in self._shards:
            shard = open_shard(path, verify_checksum=self.config.verify_checksums)
            if shard.header != header:
                raise TokenShardError(f"{path}: token shard changed since the input was built")
            self._shards[path] = shard
        return self._shards[path]

    def _stream(self, stream: int) -> TokenCorpus:
        """Stream `stream`'s corpus, opened on first use."""
        with self._lock:
            if stream not in self._streams:
                self._streams[stream] = self._open_stream(stream)
            return self._streams[stream]

    def _open_stream(self, stream: int) -> TokenCorpus:
        cfg = self.config
        shards, (lo, hi) = self.stream_share(stream)
        corpus = None
        if shards:
            offset = int(self._shard_starts[shards[0]])
            corpus = TokenCorpus(
                [self._shard(self._paths[i], self._headers[i]) for i in shards],
                seed=[cfg.seed] if self._num_streams == 1 else [cfg.seed, stream],
                shuffle=cfg.shuffle and cfg.is_training,
                start_range=(lo - offset, hi - offset),
            )
        if corpus is None or corpus.num_tokens == 0:
            raise InputError(
                f"{self.path()}: stream {stream} of {self._num_streams} holds no document "
                f"(none starts at its tokens [{lo}, {hi})); use fewer num_streams"
            )
        return corpus

    def stream_features(self, stream: int, chunks: np.ndarray) -> Batch:
        """Features of chunks `chunks` of stream `stream`, a row each."""
        cfg = self.config
        corpus = self._stream(stream)
        length = cfg.max_sequence_length
        positions = np.asarray(chunks, dtype=np.int64)[:, None] * length + np.arange(length)
        if cfg.is_training:
            valid = np.ones(positions.shape, dtype=bool)
        else:
            valid = positions < corpus.num_tokens
        return corpus.features(positions, valid)

    # ----- batches -----

    @property
    def num_eval_batches(self) -> int:
        """Global batches of one evaluation pass (the last one padded)."""
        num_chunks = -(-self._num_tokens // self.max_sequence_length)
        return -(-num_chunks // self.global_batch_size)

    def host_batch(self, step: int) -> Batch:
        """This process's rows of global batch `step`: in each stream, batch `step` takes
        the stream's next chunk for each of its rows."""
        host_rows = self.host_rows()
        rows = np.arange(host_rows.start, host_rows.stop, dtype=np.int64)
        rows_per_stream = self.global_batch_size // self._num_streams
        streams = self.stream_of_rows(rows)
        chunks = step * rows_per_stream + rows - streams * rows_per_stream
        # Rows are in stream order: the streams' parts concatenate to the rows in order.
        parts = [self.stream_features(s, chunks[streams == s]) for s in np.unique(streams)]
        return concatenate_rows(parts)

    def _host_batches(self, start: int) -> Iterator[Batch]:
        cfg = self.config

        def generate():
            step = start
            while cfg.is_training or step < self.num_eval_batches:
                yield self.host_batch(step)
                step += 1

        return prefetch_in_thread(generate(), cfg.prefetch_batches)


def concatenate_rows(parts: Sequence[Batch]) -> Batch:
    """Batches of consecutive rows, as one."""
    if len(parts) == 1:
        return parts[0]
    return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}


# ----- shards at local paths and URLs -----


def expand_shard_paths(patterns: Iterable[str]) -> list[str]:
    """Shards named by `patterns` (globs allowed, local or URLs), each pattern's sorted;
    raises for a pattern matching none."""
    paths = []
    for pattern in patterns:
        if "://" not in pattern:
            paths.extend(expand_paths([pattern]))
            continue
        is_glob = any(c in pattern for c in "*?[")
        matches = file_system.glob(pattern) if is_glob else [pattern]
        if not matches:
            raise TokenShardError(f"{pattern}: no token shard files match this pattern")
        for match in matches:
            if not file_system.isfile(match):
                raise TokenShardError(f"{match}: token shard file does not exist")
        paths.extend(matches)
    return paths


def read_shard_headers(paths: Sequence[str]) -> list[ShardHeader]:
    """The headers of the shards at `paths` (local paths or URLs), from their first bytes
    only; the reads of URLs are issued together."""
    headers: list[Optional[ShardHeader]] = [None] * len(paths)
    reads = {}
    for i, path in enumerate(paths):
        if file_system.is_local(path):
            local = file_system.local_path(path)
            if not os.path.isfile(local):
                raise TokenShardError(f"{path}: token shard file does not exist")
            with open(local, "rb") as f:
                headers[i] = decode_header(f.read(HEADER_SIZE), path=path)
        else:
            reads[i] = _url_store(path).read(b"", byte_range=slice(0, HEADER_SIZE))
    for i, future in reads.items():
        try:
            result = future.result()
        except ValueError:  # Shorter than a header: read it all, for the error naming its size.
            result = _url_store(paths[i]).read(b"").result()
        if result.state != "value":
            raise TokenShardError(f"{paths[i]}: token shard file does not exist")
        headers[i] = decode_header(bytes(result.value), path=paths[i])
    return headers


def _url_store(path: str) -> Any:
    """A TensorStore key-value store whose key b'' is the object at URL `path`."""
    import tensorstore as ts  # pylint: disable=import-outside-toplevel

    spec = file_system.kvstore_spec(path)
    return ts.KvStore.open(spec, context=file_system.context()).result()


def check_vocabulary(
    path: str,
    header: ShardHeader,
    *,
    vocab_name: Optional[str] = None,
    model_vocab_size: Optional[int] = None,
) -> None:
    """Raises if the shard was tokenized with another vocabulary than the model's."""
    if vocab_name is not None and header.vocab_name != vocab_name:
        raise TokenShardError(
            f"{path}: tokenized with vocabulary '{header.vocab_name}', but the model "
            f"expects '{vocab_name}'"
        )
    if model_vocab_size is not None and header.vocab_size > model_vocab_size:
        raise TokenShardError(
            f"{path}: vocabulary '{header.vocab_name}' has {header.vocab_size} ids, more "
            f"than the model's vocab_size {model_vocab_size}"
        )


def check_same_vocabulary(shards: Sequence[tuple[str, ShardHeader]]) -> None:
    """Raises naming the first of (path, header) `shards` made with another vocabulary
    (name, size or EOS id) than the first."""
    first_path, first = shards[0]
    for path, header in shards[1:]:
        if (header.vocab_name, header.vocab_size, header.eos_id) != (
            first.vocab_name,
            first.vocab_size,
            first.eos_id,
        ):
            raise TokenShardError(
                f"{path}: vocabulary '{header.vocab_name}' (size {header.vocab_size}) "
                f"differs from '{first.vocab_name}' (size {first.vocab_size}) of {first_path}"
            )


def open_shard(path: str, *, verify_checksum: bool = True) -> TokenShard:
    """The shard at a local path or URL; one at a URL is copied to a local temporary file
    first (see the module docstring)."""
    if file_system.is_local(path):
        return TokenShard(file_system.local_path(path), verify_checksum=verify_checksum)
    try:
        data = file_system.read_bytes(path)
    except FileNotFoundError as e:
        raise TokenShardError(f"{path}: token shard file does not exist") from e
    with tempfile.NamedTemporaryFile(prefix="axlearn-shard-", suffix=".tok") as f:
        f.write(data)
        f.flush()
        del data
        try:
            shard = TokenShard(f.name, verify_checksum=verify_checksum)
        except TokenShardError as e:
            raise TokenShardError(str(e).replace(f.name, path)) from None
    shard.path = path
    return shard


# ----- building shards -----


def iter_documents(paths: Iterable[str], *, text_field: str = "text") -> Iterator[str]:
    """Texts of `paths`: `.jsonl` files give one per line (field `text_field`), others one each."""
    for path in paths:
        if not os.path.isfile(path):
            raise InputError(f"{path}: input text file does not exist")
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise InputError(f"{path}:{lineno}: not a JSON line: {e}") from e
                    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                        raise InputError(
                            f"{path}:{lineno}: expected an object with a string field "
                            f"'{text_field}'"
                        )
                    yield record[text_field]
        else:
            with open(path, "rb") as f:
                data = f.read()
            try:
                yield data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"{path}: not UTF-8 text ({e})") from e


def tokenize(
    vocab: Any, text: str, *, replace_newlines_with: Optional[str] = None
) -> tuple[np.ndarray, int]:
    """(token ids, UTF-8 bytes of the original text); newlines are replaced before encoding."""
    num_bytes = len(text.encode("utf-8"))
    if replace_newlines_with is not None:
        text = text.replace("\n", replace_newlines_with)
    if isinstance(vocab, ByteVocabulary):
        return vocab.encode_bytes(text.encode("utf-8")), num_bytes
    return np.asarray(vocab.encode(text), dtype=np.int64), num_bytes


def build_token_shards(
    texts: Iterable[str],
    *,
    vocab: Any,
    output_prefix: str,
    tokens_per_shard: int = 1 << 28,
    replace_newlines_with: Optional[str] = None,
) -> list[str]:
    """Tokenizes `texts` into shards `{output_prefix}-00000.tok`, ...; returns their paths."""
    name, size, eos = vocabulary_name(vocab), vocab.vocab_size, vocab.eos_id
    paths: list[str] = []
    documents: list[np.ndarray] = []
    num_bytes: list[int] = []
    pending = 0

    def flush():
        path = f"{output_prefix}-{len(paths):05d}.tok"
        write_shard(path, documents, num_bytes, vocab_name=name, vocab_size=size, eos_id=eos)
        paths.append(path)
        documents.clear()
        num_bytes.clear()

    for text in texts:
        ids, count = tokenize(vocab, text, replace_newlines_with=replace_newlines_with)
        if ids.size == 0:
            continue
        documents.append(ids)
        num_bytes.append(count)
        pending += ids.size + 1
        if pending >= tokens_per_shard:
            flush()
            pending = 0
    if documents or not paths:
        flush()
    return paths


# ----- commands -----


def _build_command(args: argparse.Namespace) -> None:
    vocab = load_vocabulary(args.vocab)
    paths = build_token_shards(
        iter_documents(args.files, text_field=args.text_field),
        vocab=vocab,
        output_prefix=args.output,
        tokens_per_shard=args.tokens_per_shard,
        replace_newlines_with=args.replace_newlines_with,
    )
    for path in paths:
        header = TokenShard(path).header
        print(
            f"{path}: {header.num_docs} documents, {header.num_tokens} tokens "
            f"({header.vocab_name})"
        )


def _synthetic_shard(
    path: str, *, num_tokens: int, mean_doc_tokens: int, vocab_size: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    docs, sizes, total = [], [], 0
    while total < num_tokens:
        length = max(1, int(rng.exponential(mean_doc_tokens)))
        docs.append(rng.integers(3, vocab_size, size=length, dtype=np.int64))
        sizes.append(4 * length)  # About 4 bytes of text per BPE token.
        total += length + 1
    write_shard(path, docs, sizes, vocab_name="synthetic", vocab_size=vocab_size, eos_id=1)


def _bench_command(args: argparse.Namespace) -> None:
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench-00000.tok")
        _synthetic_shard(
            path,
            num_tokens=args.num_tokens,
            mean_doc_tokens=args.mean_doc_tokens,
            vocab_size=args.vocab_size,
            seed=0,
        )
        for prefetch in (0, 2):
            cfg = TokenShardInput.default_config().set(
                name="bench",
                is_training=True,
                global_batch_size=args.global_batch_size,
                max_sequence_length=args.max_sequence_length,
                paths=[path],
                prefetch_batches=prefetch,
            )
            batches = cfg.instantiate(parent=None).dataset()
            for _ in range(3):  # Warm up: first epoch order, page cache.
                next(batches)
            start = time.perf_counter()
            for _ in range(args.steps):
                next(batches)
            elapsed = time.perf_counter() - start
            batches.close()
            rate = args.steps / elapsed
            print(
                f"prefetch_batches={prefetch}: {rate:.1f} batches/s, "
                f"{rate * args.global_batch_size:.1f} examples/s, "
                f"{rate * args.global_batch_size * args.max_sequence_length / 1e6:.2f} M tokens/s "
                f"(global batch {args.global_batch_size} x {args.max_sequence_length}, "
                f"cpu {'any' if args.cpu is None else args.cpu})"
            )


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m axlearn.common.input_tokens")
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="Tokenize text / JSON-lines files into shards.")
    build.add_argument("files", nargs="+", help="Text files (one document each) or .jsonl files.")
    build.add_argument(
        "--vocab", default="bytes", help="'bytes' or a SentencePiece model name or path."
    )
    build.add_argument("--output", required=True, help="Shard path prefix, e.g. /data/owt/train.")
    build.add_argument("--text_field", default="text", help="JSON field holding the text.")
    build.add_argument("--tokens_per_shard", type=int, default=1 << 28)
    build.add_argument("--replace_newlines_with", default=None)
    bench = commands.add_parser("bench", help="Measure loader throughput on synthetic shards.")
    bench.add_argument("--global_batch_size", type=int, default=4)
    bench.add_argument("--max_sequence_length", type=int, default=4096)
    bench.add_argument("--steps", type=int, default=200)
    bench.add_argument("--num_tokens", type=int, default=50_000_000)
    bench.add_argument("--mean_doc_tokens", type=int, default=1000)
    bench.add_argument("--vocab_size", type=int, default=50_000)
    bench.add_argument("--cpu", type=int, default=0, help="Pin to this CPU core (-1: no pinning).")
    args = parser.parse_args(argv)
    if args.command == "build":
        _build_command(args)
    else:
        args.cpu = None if args.cpu < 0 else args.cpu
        _bench_command(args)


if __name__ == "__main__":
    main(sys.argv[1:])
