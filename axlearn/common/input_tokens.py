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
    python -m axlearn.common.input_tokens build --vocab=VOCAB --output=DIR/train FILE...
        Tokenizes documents into DIR/train-00000.tok, ... (and DIR/validation-*.tok with
        --validation_fraction=F or --validation_files=FILE, repeatable). Inputs by name: `.jsonl`
        (field `--text_field`, default "text", per line), `.parquet` (that column per row),
        `.jsonl.gz` / `.jsonl.zst`, any other file one document. VOCAB: 'bytes', a
        SentencePiece `.model` or a Hugging Face `tokenizer.json` (`input_vocab`). Every
        document ends with the vocabulary's eos id (no bos is added; the shard manifest
        records eos, bos, pad, size and the model file's SHA-256). Batches pad with id 0
        whatever the vocabulary's pad id (the model masks targets equal to its
        `pad_token_id`). Uses `--num_workers` processes, default one per core; the output
        is the same for any number. A bad record is a one-line error naming its file and
        line (or Parquet row); a failed or interrupted build leaves nothing behind. The
        tokenizer file is copied into DIR, where generate and export find it from a run's
        data paths. Progress: a bar with the token rate on a terminal, else a line every
        PROGRESS_INTERVAL_S seconds; either way a closing line with the whole build's
        tokens and rate. An --output already holding shards is refused unless
        --overwrite, which replaces both splits' shards there.

    ... build --chat --vocab=HF_DIR [--train_on=assistant|all|last_turn]
          [--chat_template=FILE] --output=DIR/ FILE.jsonl...
        Chat and instruction records (`messages`, or `prompt`/`completion`) rendered with
        the tokenizer's chat template into shards with a per-token loss mask
        (`chat_template`; format in `input_token_format`). Batches of such shards carry
        `target_weights` [B, T] float32, 1 where the loss counts, which `causal_lm.Model`
        weights its loss by; their `target_num_bytes` count the trained text's bytes.
    ... build --pairs --max_sequence_length=T --vocab=HF_DIR --output=DIR/ FILE.jsonl...
        Preference pairs (`prompt`, `chosen`, `rejected`) into pair shards, read by
        `input_pairs.PreferencePairInput` (one pair per row, not packed).

The loader's throughput for a named config: `python -m axlearn.bench --input_only`.
"""

import contextlib
import dataclasses
import functools
import gzip
import hashlib
import io
import itertools
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, BinaryIO, Optional

import numpy as np
from absl import flags

from axlearn.common import file_system
from axlearn.common.command_flags import parse_command_flags, usage_error
from axlearn.common.config import REQUIRED, ConfigError, Required, config_class
from axlearn.common.input_base import BaseInput, Batch, InputError
from axlearn.common.input_packing import FEATURE_KEYS
from axlearn.common.input_prefetch import prefetch_indexed
from axlearn.common.input_tokenize import map_in_order, tokenize_documents
from axlearn.common.input_token_format import (
    HEADER_SIZE,
    ShardHeader,
    TokenShard,
    TokenShardError,
    VocabularyRecord,
    check_vocabulary,
    decode_header,
    expand_paths,
    write_shard,
)
from axlearn.common.input_vocab import (
    HF_TOKENIZER_FILE,
    VocabularyError,
    file_sha256,
    load_vocabulary,
    require_package,
    vocabulary_name,
)
from axlearn.common.module import Module

log = logging.getLogger(__name__)


class TokenCorpus:
    """Documents of consecutive shards, seen as one corpus, and the packed stream over it.

    `start_range` = (lo, hi) keeps only the documents that start at token positions
    [lo, hi) of the shards' concatenation (a stream's share); None keeps them all.
    Where a shard has a loss mask (chat data), chunks carry `target_weights` (1 where
    the target trains; a shard without one trains everywhere) and credit each document's
    bytes (those of its trained text) to its trained targets only.
    """

    def __init__(
        self,
        shards: Sequence[TokenShard],
        *,
        seed: Sequence[int],
        shuffle: bool,
        start_range: Optional[tuple[int, int]] = None,
        target_weights: Optional[bool] = None,
    ):
        """`target_weights`: whether chunks carry them (None: where a shard has a loss mask)."""
        if not shards:
            raise TokenShardError("No token shards given")
        check_same_vocabulary([(shard.path, shard.header) for shard in shards])
        self.paths = [shard.path for shard in shards]
        self.eos_id = shards[0].header.eos_id
        self._seed = list(seed)
        self._shuffle = shuffle
        self._tokens = [shard.tokens for shard in shards]
        self._masks = [shard.loss_mask for shard in shards]
        self.has_loss_mask = (
            any(mask is not None for mask in self._masks)
            if target_weights is None
            else target_weights
        )
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
        # Targets that train, per document (all of them without a loss mask).
        trained = lengths.copy()
        if self.has_loss_mask:
            first = 0
            for shard in shards:
                count = shard.header.num_docs
                if shard.loss_mask is not None and count:
                    local_starts = np.concatenate([[0], shard.doc_ends[:-1].astype(np.int64)])
                    trained[first : first + count] = np.add.reduceat(
                        shard.loss_mask, local_starts, dtype=np.int64
                    )
                first += count
        if start_range is not None:
            keep = (starts >= start_range[0]) & (starts < start_range[1])
            lengths, starts, doc_bytes = lengths[keep], starts[keep], doc_bytes[keep]
            trained = trained[keep]
        self.doc_trained = trained
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

    def _gather_mask(self, index: np.ndarray) -> np.ndarray:
        """The loss mask (1 for shards without one) at corpus positions `index`."""
        out = np.ones(index.shape, dtype=np.uint8)
        shard = np.searchsorted(self._shard_starts, index, side="right") - 1
        for i, mask in enumerate(self._masks):
            if mask is None:
                continue
            where = shard == i
            if where.any():
                out[where] = mask[index[where] - self._shard_starts[i]]
        return out

    def _trained_between(self, start: int, end: int) -> int:
        """Trained targets at corpus positions [start, end) (within one shard)."""
        i = int(np.searchsorted(self._shard_starts, start, side="right")) - 1
        mask = self._masks[i]
        if mask is None:
            return end - start
        base = int(self._shard_starts[i])
        return int(np.sum(mask[start - base : end - base], dtype=np.int64))

    def _blocks(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(documents, stream position of each one's block) of the blocks overlapping
        stream positions [start, end), in stream order, epochs repeating the corpus."""
        docs, block_starts = [], []
        while start < end:
            epoch = start // self.num_tokens
            base = epoch * self.num_tokens
            stop = min(end, base + self.num_tokens)
            order, ends = self._order(epoch)
            first = np.searchsorted(ends, start - base, side="right")
            last = np.searchsorted(ends, stop - 1 - base, side="right")
            docs.append(order[first : last + 1])
            block_starts.append(base + ends[first : last + 1] - self.doc_lengths[docs[-1]])
            start = stop
        return np.concatenate(docs), np.concatenate(block_starts)

    def chunks(self, first: int, count: int, length: int, *, repeat: bool) -> Batch:
        """Features of `count` consecutive chunks of `length` positions from chunk `first`
        (see input_packing): the stream repeats epoch after epoch if `repeat`, else it
        ends after one and later positions are padding.

        The chunks are cut into pieces, each one document's part within one row; features
        follow per piece (a piece's tokens are consecutive in its shard), so the work per
        position is a few array passes and one gather, whatever the documents' lengths.
        """
        start = first * length
        live = count * length if repeat else max(0, min(count * length, self.num_tokens - start))
        batch = {key: np.zeros((count, length), np.int32) for key in FEATURE_KEYS[:-1]}
        if self.has_loss_mask:
            batch["target_weights"] = np.zeros((count, length), np.float32)
        num_bytes = np.zeros(count, np.int64)
        if live:
            docs, block_starts = self._blocks(start, start + live)
            doc_piece_starts = np.maximum(block_starts, start)
            row_starts = start + np.arange(-(-live // length), dtype=np.int64) * length
            piece_starts = np.union1d(doc_piece_starts, row_starts)  # Sorted, unique.
            which = np.searchsorted(doc_piece_starts, piece_starts, side="right") - 1
            doc = docs[which]
            offset = piece_starts - block_starts[which]  # j of the piece's first position.
            sizes = np.diff(piece_starts, append=start + live)
            rel = piece_starts - start
            position = np.arange(live, dtype=np.int64)
            index = position + np.repeat(self.doc_starts[doc] + offset - rel, sizes)
            targets = self._gather(index)
            inputs = np.empty_like(targets)
            inputs[1:] = targets[:-1]  # Within a piece, the input is the previous target.
            before = self._gather(np.maximum(self.doc_starts[doc] + offset - 1, 0))
            inputs[rel] = np.where(offset == 0, self.eos_id, before)
            row = rel // length
            rank = np.arange(row.size) - np.searchsorted(row, row, side="left")
            flat = {
                "input_ids": inputs,
                "target_labels": targets,
                # Each piece of a row is its next segment; positions restart at its start.
                "input_segment_ids": np.repeat(rank + 1, sizes),
                "input_positions": position - np.repeat(rel, sizes),
            }
            lengths, doc_bytes = self.doc_lengths[doc], self.doc_bytes[doc]
            if self.has_loss_mask:
                # Bytes go to trained targets only: a piece gets its document's share of
                # those it holds (the ones before it counted for a continued document).
                weights = self._gather_mask(index)
                flat["target_weights"] = weights
                in_piece = np.add.reduceat(weights, rel, dtype=np.int64)
                before = np.zeros(rel.size, np.int64)
                for i in np.flatnonzero(offset > 0):
                    doc_start = int(self.doc_starts[doc[i]])
                    before[i] = self._trained_between(doc_start, doc_start + int(offset[i]))
                trained = np.maximum(self.doc_trained[doc], 1)
                piece_bytes = (
                    doc_bytes * (before + in_piece) // trained - doc_bytes * before // trained
                )
            else:
                piece_bytes = (
                    doc_bytes * (offset + sizes) // lengths - doc_bytes * offset // lengths
                )
            for key, values in flat.items():
                batch[key].reshape(-1)[:live] = values
            np.add.at(num_bytes, row, piece_bytes)
        batch["target_num_bytes"] = num_bytes.astype(np.int32)
        return batch


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
        for path, header in zip(self._paths, self._headers):
            if header.is_pairs:
                raise InputError(
                    f"{self.path()}: {path} holds preference pairs (built with --pairs); read "
                    "it with input_pairs.PreferencePairInput"
                )
        # Chat shards carry a loss mask: every batch then has 'target_weights'.
        self.has_loss_mask = any(header.has_loss_mask for header in self._headers)
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
                target_weights=self.has_loss_mask,
            )
        if corpus is None or corpus.num_tokens == 0:
            raise InputError(
                f"{self.path()}: stream {stream} of {self._num_streams} holds no document "
                f"(none starts at its tokens [{lo}, {hi})); use fewer num_streams"
            )
        log.info(
            "%s: stream %d of %d reads %s", self.path(), stream, self._num_streams,
            " ".join(os.path.basename(self._paths[i]) for i in shards),
        )
        return corpus

    def stream_features(self, stream: int, chunks: np.ndarray) -> Batch:
        """Features of chunks `chunks` of stream `stream`, a row each."""
        cfg = self.config
        corpus = self._stream(stream)
        chunks = np.asarray(chunks, dtype=np.int64)
        # Runs of consecutive chunks (a batch takes one run from each stream).
        runs = np.split(chunks, np.flatnonzero(np.diff(chunks) != 1) + 1) if chunks.size else []
        parts = [
            corpus.chunks(int(run[0]), run.size, cfg.max_sequence_length, repeat=cfg.is_training)
            for run in runs
        ]
        return concatenate_rows(parts)

    # ----- batches -----

    def element_spec(self) -> dict[str, Any]:
        """The base keys, and 'target_weights' [B, T] float32 for shards with a loss mask."""
        spec = super().element_spec()
        if self.has_loss_mask:
            import jax  # pylint: disable=import-outside-toplevel

            spec["target_weights"] = jax.ShapeDtypeStruct(
                (self.global_batch_size, self.max_sequence_length), np.float32
            )
        return spec

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
        stop = None if cfg.is_training else self.num_eval_batches
        return prefetch_indexed(self.host_batch, start=start, stop=stop, size=cfg.prefetch_batches)


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
#
# `build` reads documents in the main process, tokenizes them on every core
# (`input_tokenize`: results in input order, so any worker count writes the same bytes),
# and writes each split's shards under temporary names beside their final paths
# (`<final>.partial-<pid>`, which no `*.tok` glob matches). Only a build that succeeds
# renames them into place and removes the split's older shards with the same prefix;
# any failure, Ctrl-C included, removes the temporaries.

def _compression(path: str) -> str:
    """'gz', 'zst' or '' by the file name's last suffix."""
    for suffix in ("gz", "zst"):
        if path.endswith("." + suffix):
            return suffix
    return ""


def _file_format(path: str) -> str:
    """'jsonl', 'parquet' or 'text' (one document per file), after any compression suffix."""
    compression = _compression(path)
    base = path[: -len(compression) - 1] if compression else path
    if base.endswith(".jsonl"):
        return "jsonl"
    if base.endswith(".parquet"):
        if compression:
            raise InputError(f"{path}: Parquet files compress internally; give the .parquet file")
        return "parquet"
    return "text"


def _open_input(path: str) -> tuple[BinaryIO, tuple[type, ...]]:
    """`path` opened for binary reading, decompressed by suffix, and the errors a bad
    stream raises while it is read."""
    errors: tuple[type, ...] = (OSError, EOFError, zlib.error)
    compression = _compression(path)
    if compression == "gz":
        return gzip.open(path, "rb"), errors
    if compression == "zst":
        zstandard = require_package(
            "zstandard", needed_by=f"{path}: reading it", error=InputError
        )
        raw = open(path, "rb")  # pylint: disable=consider-using-with
        reader = zstandard.ZstdDecompressor().stream_reader(
            raw, read_across_frames=True, closefd=True
        )
        return io.BufferedReader(reader), errors + (zstandard.ZstdError,)
    return open(path, "rb"), errors  # pylint: disable=consider-using-with


def _utf8(data: bytes, *, path: str, first_line: int = 1) -> str:
    """`data` decoded; a non-UTF-8 byte is named by file, line and column."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + data.count(b"\n", 0, e.start)
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise InputError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at column {column})"
        ) from None


def json_records(path: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) of each non-blank line; errors name the file and line."""
    stream, errors = _open_input(path)
    with stream:
        lines = iter(stream)
        lineno = 0
        while True:
            try:
                raw = next(lines)
            except StopIteration:
                return
            except errors as e:
                raise InputError(f"{path}:{lineno + 1}: cannot read ({e})") from None
            lineno += 1
            line = _utf8(raw, path=path, first_line=lineno)
            if lineno == 1:
                line = line.removeprefix("\ufeff")  # A byte-order mark is not JSON.
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: not a JSON line: {e}") from None
            yield lineno, record


def _json_lines(path: str, *, text_field: str) -> Iterator[str]:
    """The `text_field` of each non-blank line; errors name the file and line."""
    for lineno, record in json_records(path):
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            found = f"fields {sorted(record)}" if isinstance(record, dict) else "no object"
            hint = "choose the field with --text_field"
            if isinstance(record, dict) and ("messages" in record or "prompt" in record):
                hint += "; chat records build with --chat, preference pairs with --pairs"
            raise InputError(
                f"{path}:{lineno}: expected an object with a string field '{text_field}' "
                f"(found {found}); {hint}"
            )
        yield record[text_field]


def _whole_file(path: str) -> str:
    stream, errors = _open_input(path)
    with stream:
        try:
            data = stream.read()
        except errors as e:
            raise InputError(f"{path}: cannot read ({e})") from None
    return _utf8(data, path=path)


def _parquet_rows(path: str, *, text_field: str) -> Iterator[str]:
    """Column `text_field` of each row; errors name the file and row (counted from 0)."""
    pyarrow = require_package("pyarrow", needed_by=f"{path}: reading it", error=InputError)
    require_package("pyarrow.parquet", needed_by=f"{path}: reading it", error=InputError)
    try:
        parquet = pyarrow.parquet.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as e:
        raise InputError(f"{path}: not a Parquet file ({_one_line(e)})") from None
    schema = parquet.schema_arrow
    if text_field not in schema.names:
        raise InputError(
            f"{path}: no column '{text_field}' (columns: {schema.names}); choose one with "
            "--text_field"
        )
    column_type = schema.field(text_field).type
    types = pyarrow.types
    if not any(
        test(column_type)
        for test in (types.is_string, types.is_large_string, types.is_binary, types.is_large_binary)
    ):
        raise InputError(f"{path}: column '{text_field}' holds {column_type}, not text")
    row = 0
    with parquet:
        batches = parquet.iter_batches(columns=[text_field], batch_size=1024)
        while True:
            try:
                values = next(batches).column(0).to_pylist()
            except StopIteration:
                return
            except (pyarrow.ArrowException, OSError, UnicodeDecodeError) as e:
                raise InputError(
                    f"{path}: row {row} or after: cannot read ({_one_line(e)})"
                ) from None
            for value in values:
                if value is None:
                    raise InputError(f"{path}: row {row}: column '{text_field}' is null")
                if isinstance(value, bytes):
                    try:
                        value = value.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise InputError(
                            f"{path}: row {row}: not UTF-8 text (byte 0x{value[e.start]:02x} at "
                            f"offset {e.start})"
                        ) from None
                yield value
                row += 1


def read_documents(path: str, *, text_field: str = "text") -> Iterator[str]:
    """The documents of one input file, by its name (see `build --help`)."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: input text file does not exist")
    kind = _file_format(path)
    if kind == "jsonl":
        yield from _json_lines(path, text_field=text_field)
    elif kind == "parquet":
        yield from _parquet_rows(path, text_field=text_field)
    else:
        yield _whole_file(path)


def iter_documents(paths: Iterable[str], *, text_field: str = "text") -> Iterator[str]:
    """The documents of `paths`, file after file."""
    for path in paths:
        yield from read_documents(path, text_field=text_field)


def validation_share(text: str) -> float:
    """A stable number in [0, 1) from the text's SHA-256: below F puts it in validation."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


class _Staging:
    """Shards written under temporary names, renamed into place together or all removed."""

    def __init__(self):
        self._moves: list[tuple[str, str]] = []  # (temporary, final) paths.
        self._created_dirs: list[str] = []  # Directories this build made, deepest first.

    def temporary(self, final: str) -> str:
        """Where to write the shard `final` for now (its directory is made if missing)."""
        directory = os.path.dirname(os.path.abspath(final))
        missing = []
        while not os.path.isdir(directory):
            missing.append(directory)
            directory = os.path.dirname(directory)
        for directory in reversed(missing):
            os.mkdir(directory)
        self._created_dirs = missing + self._created_dirs
        temporary = f"{final}.partial-{os.getpid()}"
        self._moves.append((temporary, final))
        return temporary

    def commit(self) -> None:
        """Renames every temporary to its final path."""
        for temporary, final in self._moves:
            os.replace(temporary, final)
        self._moves.clear()

    def discard(self) -> None:
        """Removes every temporary, and the directories made for them if left empty."""
        for temporary, _ in self._moves:
            if os.path.exists(temporary):
                os.remove(temporary)
        self._moves.clear()
        for directory in self._created_dirs:
            if os.path.isdir(directory) and not os.listdir(directory):
                os.rmdir(directory)


class _SplitWriter:
    """Collects one split's documents into shards `<prefix>-00000.tok`, ...

    `loss_masks`: documents come with loss masks (chat data); `pairs`: in pairs, which a
    shard never splits; `manifest_extra`: more manifest fields of every shard."""

    def __init__(
        self,
        prefix: str,
        vocabulary: VocabularyRecord,
        tokens_per_shard: int,
        staging: _Staging,
        *,
        loss_masks: bool = False,
        pairs: bool = False,
        manifest_extra: Optional[dict] = None,
    ):
        self.prefix = prefix
        self.paths: list[str] = []  # Final paths of the shards written so far.
        self.num_docs = 0
        self._vocabulary = vocabulary
        self._tokens_per_shard = tokens_per_shard
        self._staging = staging
        self._with_masks = loss_masks or pairs
        self._pairs = pairs
        self._manifest_extra = manifest_extra
        self._documents: list[np.ndarray] = []
        self._bytes: list[int] = []
        self._masks: list[np.ndarray] = []
        self._pending = 0

    def add(
        self, ids: np.ndarray, num_bytes: int, mask: Optional[np.ndarray] = None, *, flush=True
    ) -> None:
        """Adds a document (`mask`: its loss mask, with the EOS's); `flush`: a shard may end
        after it."""
        self._documents.append(ids)
        self._bytes.append(num_bytes)
        if self._with_masks:
            self._masks.append(mask)
        self._pending += ids.size + 1
        self.num_docs += 1
        if flush and self._pending >= self._tokens_per_shard:
            self.flush()

    def flush(self) -> None:
        if not self._documents:
            return
        final = f"{self.prefix}-{len(self.paths):05d}.tok"
        write_shard(
            self._staging.temporary(final),
            self._documents,
            self._bytes,
            vocabulary=self._vocabulary,
            loss_masks=self._masks if self._with_masks else None,
            pairs=self._pairs,
            manifest_extra=self._manifest_extra,
        )
        self.paths.append(final)
        self._documents, self._bytes, self._masks, self._pending = [], [], [], 0


def _stale_shards(prefix: str, keep: Sequence[str]) -> list[str]:
    """Shards `<prefix>-NNNNN.tok` of an earlier build that this one did not write."""
    directory = os.path.dirname(os.path.abspath(prefix))
    pattern = re.compile(re.escape(os.path.basename(prefix)) + r"-\d{5}\.tok")
    kept = {os.path.abspath(p) for p in keep}
    return sorted(
        path
        for path in (os.path.join(directory, name) for name in os.listdir(directory))
        if pattern.fullmatch(os.path.basename(path)) and path not in kept
    )


def vocabulary_record(vocab: Any) -> VocabularyRecord:
    """What a shard's manifest records of `vocab` (see `input_token_format`)."""
    return VocabularyRecord(
        name=vocabulary_name(vocab),
        size=int(vocab.vocab_size),
        eos_id=int(vocab.eos_id),
        kind=getattr(vocab, "kind", ""),
        sha256=getattr(vocab, "file_sha256", ""),
        bos_id=int(getattr(vocab, "bos_id", -1)),
        pad_id=int(getattr(vocab, "pad_id", -1)),
    )


# Seconds between the build's progress lines where stderr is no terminal (a log file).
PROGRESS_INTERVAL_S = 10.0


class _ProgressLines:
    """The build's progress where no terminal shows a bar: every `interval_s` seconds, a
    line on `stream` with the tokens, their rate and the documents so far."""

    def __init__(self, stream: Any, *, interval_s: float, clock: Any = time.monotonic):
        self._stream = stream
        self._interval_s = interval_s
        self._clock = clock
        self._start = self._last = clock()
        self.tokens = 0
        self.documents = 0

    def update(self, tokens: int, documents: int) -> None:
        self.tokens += tokens
        self.documents = documents
        now = self._clock()
        if now - self._last >= self._interval_s:
            self._last = now
            print(f"tokenizing: {self._summary(now)}", file=self._stream, flush=True)

    def _summary(self, now: float) -> str:
        rate = self.tokens / max(now - self._start, 1e-9)
        return (
            f"{self.tokens:,} tokens, {rate:,.0f} tok/s, {self.documents:,} documents, "
            f"{now - self._start:.0f}s"
        )

    def finish(self) -> None:
        """The closing line: the whole build's tokens, rate, documents and time."""
        print(f"tokenized: {self._summary(self._clock())}", file=self._stream, flush=True)


class _ProgressBar(_ProgressLines):
    """The build's progress as a tqdm bar of tokens, with their rate and the documents;
    the closing line as off a terminal once the bar is gone."""

    def __init__(self, bar: Any, stream: Any):
        super().__init__(stream, interval_s=math.inf)
        self._bar = bar

    def update(self, tokens: int, documents: int) -> None:
        super().update(tokens, documents)
        self._bar.set_postfix(documents=documents, refresh=False)
        self._bar.update(tokens)


@contextlib.contextmanager
def _build_progress(show: bool, *, stream: Any = None, interval_s: Optional[float] = None):
    """A progress report with `update(tokens, documents so far)`: a bar where `stream`
    (default stderr) is a terminal or AXLEARN_PROGRESS_BARS=1, lines every `interval_s`
    (None: PROGRESS_INTERVAL_S) elsewhere (a log shows them as they come), None where not
    `show`n or AXLEARN_PROGRESS_BARS=0. A build that completes ends either with one
    closing line: its tokens, their rate, the documents and the time."""
    if not show:
        yield None
        return
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.progress import PROGRESS_BARS_ENV, progress_bar

    stream = stream or sys.stderr
    setting = os.environ.get(PROGRESS_BARS_ENV, "").strip()
    if setting == "0":
        yield None
    elif setting == "1" or stream.isatty():
        with progress_bar(total=None, desc="tokenizing", unit="tok") as bar:
            bar.unit_scale = True
            report = _ProgressBar(bar, stream)
            yield report
        report.finish()
    else:
        interval_s = PROGRESS_INTERVAL_S if interval_s is None else interval_s
        report = _ProgressLines(stream, interval_s=interval_s)
        yield report
        report.finish()


@dataclasses.dataclass
class BuildSummary:
    """What `build_splits` wrote."""

    paths: dict[str, list[str]]  # Split -> its shard paths.
    documents_read: int
    documents_skipped: int  # Read, but without any token (e.g. empty texts).
    removed_stale: list[str]  # Shards of an earlier build with the same prefix, now removed.


def build_splits(
    documents: Iterable[tuple[str, Optional[str]]],
    *,
    vocab: Any,
    prefixes: dict[str, str],
    validation_fraction: float = 0.0,
    tokens_per_shard: int = 1 << 28,
    replace_newlines_with: Optional[str] = None,
    num_workers: int = 1,
    sources: Sequence[str] = (),
    progress: bool = False,
    progress_stream: Any = None,
) -> BuildSummary:
    """Tokenizes (text, split) pairs into the shards of each split.

    A split of None is decided by `validation_share(text) < validation_fraction`.
    `prefixes` maps every split that receives documents to its shard path prefix. A split
    that ends with no tokens is refused, naming `sources`. Documents without tokens are
    skipped. The result is the same for any `num_workers`. `progress` reports on
    `progress_stream` (default stderr; `_build_progress`).
    """
    if validation_fraction and "validation" not in prefixes:
        raise ValueError("validation_fraction needs a 'validation' prefix")
    record = vocabulary_record(vocab)

    def with_splits() -> Iterator[tuple[str, str]]:
        for text, split in documents:
            if split is None:
                is_validation = validation_share(text) < validation_fraction
                split = "validation" if is_validation else "train"
            yield text, split

    def fill(writers: dict[str, _SplitWriter]) -> int:
        num_read = 0
        chunks = tokenize_documents(
            with_splits(),
            vocab=vocab,
            replace_newlines_with=replace_newlines_with,
            num_workers=num_workers,
        )
        with contextlib.closing(chunks), _build_progress(progress, stream=progress_stream) as bar:
            for ids, counts, splits in chunks:
                ends = np.cumsum(counts[:, 0])
                for end, (length, num_bytes), split in zip(ends, counts, splits):
                    if length:
                        writers[split].add(ids[end - length : end], int(num_bytes))
                num_read += len(splits)
                if bar is not None:  # Tokens, each document's EOS too.
                    bar.update(int(ends[-1]) + len(splits), num_read)
        return num_read

    return _write_splits(
        prefixes,
        fill,
        new_writer=functools.partial(
            _SplitWriter, vocabulary=record, tokens_per_shard=tokens_per_shard
        ),
        validation_fraction=validation_fraction,
        sources=sources,
    )


def _write_splits(
    prefixes: dict[str, str],
    fill: Callable[[dict[str, _SplitWriter]], int],
    *,
    new_writer: Callable[..., _SplitWriter],
    validation_fraction: float,
    sources: Sequence[str],
    records: bool = False,
) -> BuildSummary:
    """The shards of each split of `prefixes`, all or none: `fill(writers)` adds every
    document to its split's `new_writer(prefix, staging=...)` and returns how many documents
    (`records`: chat records, each one or more documents) it read. A split left without
    any is refused, naming `sources`; on any failure the shards written so far are
    removed. Then the shards are renamed into place, and an earlier build's shards of the
    same prefixes that this one did not write are removed."""
    staging = _Staging()
    writers = {split: new_writer(prefix, staging=staging) for split, prefix in prefixes.items()}
    try:
        num_read = fill(writers)
        for split, writer in writers.items():
            writer.flush()
            if not writer.num_docs:
                message = _empty_split_message(split, num_read, validation_fraction, sources)
                raise InputError(message.replace("documents", "records") if records else message)
        staging.commit()
    except BaseException:
        staging.discard()
        raise
    removed = []
    for writer in writers.values():
        for path in _stale_shards(writer.prefix, writer.paths):
            os.remove(path)
            removed.append(path)
    num_docs = sum(writer.num_docs for writer in writers.values())
    return BuildSummary(
        paths={split: writer.paths for split, writer in writers.items()},
        documents_read=num_read,
        documents_skipped=0 if records else num_read - num_docs,
        removed_stale=removed,
    )


def _empty_split_message(
    split: str, num_read: int, validation_fraction: float, sources: Sequence[str]
) -> str:
    inputs = ", ".join(sources) if sources else "the given texts"
    if not num_read:
        return f"No documents in {inputs}: nothing to tokenize"
    message = f"No document of {inputs} ({num_read} read) gives the {split} split any token"
    if validation_fraction:
        message += f" (validation_fraction={validation_fraction})"
    return message


def build_token_shards(
    texts: Iterable[str],
    *,
    vocab: Any,
    output_prefix: str,
    tokens_per_shard: int = 1 << 28,
    replace_newlines_with: Optional[str] = None,
    num_workers: int = 1,
) -> list[str]:
    """Tokenizes `texts` into shards `{output_prefix}-00000.tok`, ...; returns their paths."""
    return build_splits(
        ((text, "train") for text in texts),
        vocab=vocab,
        prefixes={"train": output_prefix},
        tokens_per_shard=tokens_per_shard,
        replace_newlines_with=replace_newlines_with,
        num_workers=num_workers,
    ).paths["train"]


def build_chat_splits(
    records: Iterable[tuple[str, Any, Optional[str]]],
    *,
    vocab: Any,
    template: Any,
    prefixes: dict[str, str],
    train_on: str = "assistant",
    pairs: bool = False,
    max_sequence_length: Optional[int] = None,
    validation_fraction: float = 0.0,
    tokens_per_shard: int = 1 << 28,
    num_workers: int = 1,
    sources: Sequence[str] = (),
    progress: bool = False,
    progress_stream: Any = None,
) -> BuildSummary:
    """Renders (where, JSON record, split) chat records with the `chat_template.ChatTemplate`
    `template` into shards with a loss mask (see `chat_template`): SFT records trained as
    `train_on` says, or with `pairs` preference pairs, each response trained, whose prompts
    must leave a response token within `max_sequence_length`. A split of None is decided by
    a hash of the record. Records are rendered and tokenized in `num_workers` processes;
    the output is the same for any number. Like `build_splits`, a failure leaves nothing
    behind; errors name `where` (file:line), the first bad record's in input order."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common import chat_template as chat

    if train_on not in chat.TRAIN_ON:
        raise InputError(f"--train_on={train_on}: expected one of {', '.join(chat.TRAIN_ON)}")
    if pairs and (max_sequence_length is None or max_sequence_length < 1):
        raise InputError("--pairs needs --max_sequence_length=T, the tokens of a pair's row")
    if validation_fraction and "validation" not in prefixes:
        raise ValueError("validation_fraction needs a 'validation' prefix")
    record = vocabulary_record(vocab)
    template_sha256 = hashlib.sha256(template.source.encode("utf-8")).hexdigest()
    about = dict(template=os.path.basename(template.origin), template_sha256=template_sha256)
    if pairs:
        extra = {"pairs": dict(about, max_sequence_length=max_sequence_length)}
    else:
        extra = {"chat": dict(about, train_on=train_on)}

    def fill(writers: dict[str, _SplitWriter]) -> int:
        num_read = 0
        encoded_chunks = map_in_order(
            _encode_record_chunk,
            _record_chunks(records),
            initializer=chat.init_record_worker,
            initargs=(template, vocab, train_on, pairs, max_sequence_length),
            num_workers=num_workers,
        )
        with contextlib.closing(encoded_chunks), _build_progress(
            progress, stream=progress_stream
        ) as bar:
            for chunk, encoded_records in encoded_chunks:
                tokens = 0
                for (_, value, split), documents in zip(chunk, encoded_records):
                    if split is None:
                        share = validation_share(json.dumps(value, sort_keys=True))
                        split = "validation" if share < validation_fraction else "train"
                    for i, (ids, mask, num_bytes, _) in enumerate(documents):
                        writers[split].add(ids, num_bytes, mask, flush=i == len(documents) - 1)
                        tokens += ids.size + 1
                num_read += len(chunk)
                if bar is not None:
                    bar.update(tokens, num_read)
        return num_read

    return _write_splits(
        prefixes,
        fill,
        new_writer=functools.partial(
            _SplitWriter,
            vocabulary=record,
            tokens_per_shard=tokens_per_shard,
            loss_masks=True,
            pairs=pairs,
            manifest_extra=extra,
        ),
        validation_fraction=validation_fraction,
        sources=sources,
        records=True,
    )


_RECORD_CHUNK = 128  # Chat records sent to a build worker at a time.


def _record_chunks(
    records: Iterable[tuple[str, Any, Optional[str]]]
) -> Iterator[list[tuple[str, Any, Optional[str]]]]:
    chunk = []
    for item in records:
        chunk.append(item)
        if len(chunk) >= _RECORD_CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _encode_record_chunk(chunk: Sequence[tuple[str, Any, Optional[str]]]) -> tuple[list, list]:
    """(the chunk, its records' encoded documents), in a build worker."""
    from axlearn.common import chat_template  # pylint: disable=import-outside-toplevel

    return chunk, chat_template.encode_records([(where, value) for where, value, _ in chunk])


def iter_chat_records(
    paths: Iterable[str], split: Optional[str]
) -> Iterator[tuple[str, Any, Optional[str]]]:
    """(file:line, JSON record, `split`) of each record of JSON-lines `paths`."""
    for path in paths:
        if _file_format(path) != "jsonl":
            raise InputError(
                f"{path}: chat and pair records are read from JSON lines (.jsonl, .jsonl.gz, "
                ".jsonl.zst)"
            )
        for lineno, value in json_records(path):
            yield f"{path}:{lineno}", value, split


def output_prefixes(output: str, *, with_validation: bool) -> dict[str, str]:
    """Shard prefixes by split for `--output`.

    A directory (an existing one, or a name ending in '/') gets `train-*.tok` and
    `validation-*.tok`; any other name is the train split's prefix, and validation shards
    go beside it as `validation-*.tok` (so `--output=data/golf/train` writes
    `data/golf/train-*.tok` and `data/golf/validation-*.tok`).
    """
    if output.endswith(("/", os.sep)) or os.path.isdir(output):
        train = os.path.join(output, "train")
    else:
        train = output
    prefixes = {"train": train}
    if with_validation:
        validation = os.path.join(os.path.dirname(train), "validation")
        if os.path.abspath(validation) == os.path.abspath(train):
            raise InputError(
                f"--output={output}: the train shards would take the validation split's name; "
                "give another prefix, e.g. DIR/train"
            )
        prefixes["validation"] = validation
    return prefixes


def _split_prefixes(train_prefix: str) -> list[str]:
    """The shard prefixes of both splits for the train split's `train_prefix` (the
    validation split's beside it, `output_prefixes`)."""
    validation = os.path.join(os.path.dirname(train_prefix), "validation")
    same = os.path.abspath(validation) == os.path.abspath(train_prefix)
    return [train_prefix] if same else [train_prefix, validation]


def earlier_shards(train_prefix: str) -> list[str]:
    """The shards of either split that an earlier build left for `train_prefix`."""
    if not os.path.isdir(os.path.dirname(os.path.abspath(train_prefix))):
        return []
    return sorted(p for prefix in _split_prefixes(train_prefix) for p in _stale_shards(prefix, []))


# ----- the tokenizer beside the shards -----

_HF_TOKENIZER_CONFIG = "tokenizer_config.json"  # Names a tokenizer.json's special tokens.
_HF_CHAT_TEMPLATE = "chat_template.jinja"  # Newer transformers' place for the chat template.


def tokenizer_destination(vocab: Any, shard_dir: str) -> Optional[str]:
    """Where `store_tokenizer` puts the vocabulary's model file: `shard_dir/<its name>`,
    the name the shards' manifest records; None for a vocabulary without a file (bytes).
    Raises InputError where another file of that name is there already."""
    source = getattr(vocab, "model_file", None)
    if not source:
        return None
    destination = os.path.join(shard_dir, os.path.basename(source))
    if (
        os.path.exists(destination)
        and not os.path.samefile(source, destination)
        and file_sha256(destination) != file_sha256(source)
    ):
        raise InputError(
            f"{destination}: another tokenizer file of that name is beside the shards; the "
            f"shards' tokenizer ({source}) goes there: move it, or write the shards elsewhere"
        )
    return destination


def store_tokenizer(vocab: Any, shard_dir: str) -> Optional[str]:
    """Copies the vocabulary's model file beside the shards (`tokenizer_destination`),
    with a Hugging Face tokenizer's tokenizer_config.json where one is beside it, so that
    the tokenizer of a run on these shards is found from its recorded data paths
    (`trainer_dir.recorded_tokenizer`, by the manifest's name and SHA-256). Returns the
    path; None for a vocabulary without a file."""
    destination = tokenizer_destination(vocab, shard_dir)
    if destination is None:
        return None
    source = vocab.model_file
    copies = [(source, destination)]
    for name in (_HF_TOKENIZER_CONFIG, _HF_CHAT_TEMPLATE):  # Its special tokens and template.
        config = os.path.join(os.path.dirname(source), name)
        if os.path.basename(source) == HF_TOKENIZER_FILE and os.path.isfile(config):
            config_destination = os.path.join(shard_dir, name)
            if not os.path.exists(config_destination):
                copies.append((config, config_destination))
    for src, dst in copies:
        if os.path.exists(dst) and os.path.samefile(src, dst):
            continue
        tmp = f"{dst}.partial-{os.getpid()}"
        try:
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return destination


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


# ----- commands -----


def _chat_mode(args: flags.FlagValues) -> bool:
    """Whether the build renders chat records (--chat or --pairs); refuses flags that the
    chosen mode would not use."""
    if args.chat and args.pairs:
        raise InputError("Give --chat (SFT records) or --pairs (preference pairs), not both")
    chat_mode = args.chat or args.pairs
    given = lambda name: args[name].present  # pylint: disable=unnecessary-lambda-assignment
    unused = []
    if args.pairs:
        unused = ("text_field", "replace_newlines_with", "train_on")
    elif args.chat:
        unused = ("text_field", "replace_newlines_with", "max_sequence_length")
    else:
        unused = ("train_on", "chat_template", "max_sequence_length")
    for name in unused:
        if given(name):
            mode = "--pairs" if args.pairs else "--chat" if args.chat else "a text build"
            raise InputError(f"--{name} does not apply to {mode}")
    return chat_mode


def _build_command(args: flags.FlagValues, files: Sequence[str]) -> None:
    validation_files = list(args.validation_files)
    if not 0 <= args.validation_fraction < 1:
        raise InputError(f"--validation_fraction={args.validation_fraction}: expected 0 <= F < 1")
    if validation_files and args.validation_fraction:
        raise InputError("Give --validation_fraction or --validation_files, not both")
    both = sorted(set(files) & set(validation_files))
    if both:
        raise InputError(f"{both[0]}: given both as a training file and in --validation_files")
    if args.num_workers < 1 or args.tokens_per_shard < 1:
        raise InputError("--num_workers and --tokens_per_shard must be positive")
    sources = [*files, *validation_files]
    for path in sources:
        if not os.path.isfile(path):
            raise InputError(f"{path}: input text file does not exist")
        _file_format(path)  # Refuses unsupported names before any work.
    chat_mode = _chat_mode(args)
    vocab = load_vocabulary(
        args.vocab, any_special_ids=True, eos_token=args.eos_token, bos_token=args.bos_token
    )
    template = None
    if chat_mode:
        from axlearn.common import chat_template  # pylint: disable=import-outside-toplevel

        template = chat_template.load_chat_template(
            getattr(vocab, "model_file", None), chat_template_file=args.chat_template
        )
    prefixes = output_prefixes(
        args.output, with_validation=bool(validation_files or args.validation_fraction)
    )
    shard_dir = os.path.dirname(os.path.abspath(prefixes["train"]))
    earlier = earlier_shards(prefixes["train"])
    if earlier and not args.overwrite:
        raise InputError(
            f"--output={args.output} already holds the shards of a build ({earlier[0]}"
            f"{f' and {len(earlier) - 1} more' if len(earlier) > 1 else ''}): pass --overwrite "
            "to replace them (every train and validation shard there goes), or write elsewhere"
        )
    tokenizer_destination(vocab, shard_dir)  # Refused before any work, not after.
    train_split = None if args.validation_fraction else "train"  # None: by document hash.
    if chat_mode:
        summary = build_chat_splits(
            itertools.chain(
                iter_chat_records(files, train_split),
                iter_chat_records(validation_files, "validation"),
            ),
            vocab=vocab,
            template=template,
            prefixes=prefixes,
            train_on=args.train_on,
            pairs=args.pairs,
            max_sequence_length=args.max_sequence_length,
            validation_fraction=args.validation_fraction,
            tokens_per_shard=args.tokens_per_shard,
            num_workers=args.num_workers,
            sources=sources,
            progress=True,
        )
    else:
        field = args.text_field
        documents = itertools.chain(
            ((text, train_split) for text in iter_documents(files, text_field=field)),
            ((text, "validation") for text in iter_documents(validation_files, text_field=field)),
        )
        summary = build_splits(
            documents,
            vocab=vocab,
            prefixes=prefixes,
            validation_fraction=args.validation_fraction,
            tokens_per_shard=args.tokens_per_shard,
            replace_newlines_with=args.replace_newlines_with,
            num_workers=args.num_workers,
            sources=sources,
            progress=True,
        )
    written = [path for paths in summary.paths.values() for path in paths]
    for split_prefix in _split_prefixes(prefixes["train"]):
        if split_prefix not in prefixes.values():  # A split this build did not write.
            for path in _stale_shards(split_prefix, written):
                os.remove(path)
                summary.removed_stale.append(path)
    record = vocabulary_record(vocab)
    for paths in summary.paths.values():
        for path in paths:
            header = TokenShard(path, verify_checksum=False).header
            print(
                f"{path}: {header.num_docs} documents, {header.num_tokens} tokens "
                f"({header.vocab_name})"
            )
    print(
        f"vocabulary {record.describe()}: eos {record.eos_id}, bos {record.bos_id}, "
        f"pad {record.pad_id} (-1: none); {summary.documents_read} documents read, "
        f"{summary.documents_skipped} without tokens skipped"
    )
    for path in summary.removed_stale:
        print(f"{path}: removed (a shard of an earlier build with this prefix)")
    stored = store_tokenizer(vocab, shard_dir)
    if stored is not None:
        print(f"{stored}: the shards' tokenizer (generate and export find it there)")


COMMANDS = ("build",)  # The command's subcommands: build tokenizes files into shards.


def define_flags(flag_values: flags.FlagValues) -> None:
    """The flags of `build`, on `flag_values`."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_string(
        "vocab",
        "bytes",
        "'bytes', a SentencePiece .model, or a Hugging Face tokenizer.json (or the directory "
        "holding it); a name, or a path (relative names not found are looked up in "
        "$AXLEARN_VOCAB_DIR). Its file is copied beside the shards, where generate and "
        "export find it.",
        **fv,
    )
    flags.DEFINE_string(
        "eos_token",
        None,
        "The token that ends every document, if not the tokenizer's own eos.",
        **fv,
    )
    flags.DEFINE_string(
        "bos_token", None, "Hugging Face tokenizers: the bos token (recorded only).", **fv
    )
    flags.DEFINE_string(
        "output",
        None,
        "Shard path prefix, e.g. data/golf/train (writes data/golf/train-00000.tok, ...; a "
        "validation split goes beside it as validation-*.tok), or a directory (ending in '/') "
        "for DIR/train-*.tok and DIR/validation-*.tok.",
        **fv,
    )
    flags.DEFINE_string(
        "text_field", "text", "JSON field or Parquet column holding the text.", **fv
    )
    flags.DEFINE_bool(
        "overwrite",
        False,
        "Replace the shards an earlier build left at --output (both splits' train-*.tok and "
        "validation-*.tok go, also a split this build does not write); without it such an "
        "--output is refused.",
        **fv,
    )
    flags.DEFINE_float(
        "validation_fraction",
        0.0,
        "Share of documents held out for validation, chosen by a hash of each text.",
        **fv,
    )
    flags.DEFINE_multi_string(
        "validation_files",
        [],
        "An input file of the validation split; repeat the flag for several.",
        **fv,
    )
    flags.DEFINE_integer(
        "num_workers",
        os.cpu_count() or 1,
        "Tokenizing processes (default: one per core); the output does not depend on it.",
        **fv,
    )
    flags.DEFINE_integer("tokens_per_shard", 1 << 28, "Tokens (EOS included) per shard.", **fv)
    flags.DEFINE_string(
        "replace_newlines_with",
        None,
        "Replaces '\\n' before tokenizing, for vocabularies without a newline token.",
        **fv,
    )
    flags.DEFINE_bool(
        "chat",
        False,
        "JSON-lines records of `messages` ([{role, content}]) or `prompt`/`completion`, "
        "rendered with the tokenizer's chat template into shards with a loss mask (see "
        "axlearn.common.chat_template).",
        **fv,
    )
    flags.DEFINE_bool(
        "pairs",
        False,
        "JSON-lines preference pairs (`prompt` with `chosen` and `rejected`, strings or "
        "messages) rendered with the chat template into pair shards (input_pairs), each "
        "response trained. Needs --max_sequence_length.",
        **fv,
    )
    flags.DEFINE_enum(
        "train_on",
        "assistant",
        ["all", "assistant", "last_turn"],
        "--chat: the tokens that train: the whole conversation, every assistant turn, or "
        "the last one.",
        **fv,
    )
    flags.DEFINE_string(
        "chat_template",
        None,
        "--chat/--pairs: a Jinja chat template file, instead of the tokenizer's own "
        "(chat_template.jinja or tokenizer_config.json beside --vocab).",
        **fv,
    )
    flags.DEFINE_integer(
        "max_sequence_length",
        None,
        "--pairs: the tokens of a pair's row; a record whose prompt leaves no response token "
        "in it is refused.",
        **fv,
    )
    flags.mark_flag_as_required("output", flag_values=flag_values)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """`build FILES...`: tokenizes documents into token shards (see the module doc)."""
    program = "axlearn.common.input_tokens"
    args, positional = parse_command_flags(
        define_flags, argv, program=program, doc=__doc__, free_positional=True
    )
    if not positional or positional[0] not in COMMANDS:
        usage_error(program, f"give a command first, one of {', '.join(COMMANDS)}")
    files = positional[1:]
    if not files:
        usage_error(program, "build: give the input FILES to tokenize")
    _build_command(args, files)


def _cli(argv: Sequence[str]) -> int:
    """`main` as a command: bad input is a one-line error and exit status 1."""
    import jax  # pylint: disable=import-outside-toplevel

    jax.config.update("jax_platforms", "cpu")  # Host-only commands: never claim an accelerator.
    try:
        main(argv)
    except (InputError, VocabularyError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: nothing written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(_cli(sys.argv[1:]))
