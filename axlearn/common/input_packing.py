"""How documents become fixed-length language-model examples (the packing contract).

Both input paths (tf.data in `input_tf_data`, token shards in `input_tokens`) implement
exactly this, so they yield identical batches for the same corpus and vocabulary.

A document of n tokens `t_0 .. t_{n-1}` (empty documents are skipped) becomes a *block*
of n + 1 aligned positions:

    inputs   EOS  t_0  t_1 ... t_{n-1}
    targets  t_0  t_1  t_2 ... EOS

so EOS doubles as the start-of-document token and every document, EOS included, is
predicted in full. Blocks are concatenated into one aligned stream (for training,
epoch after epoch, documents in a per-epoch order). Equivalently: the token stream
`EOS d_0 EOS d_1 EOS ...` split into chunks of T + 1 tokens overlapping by one, with
`input_ids = chunk[:T]` and `target_labels = chunk[1:]`.

Chunk c is stream positions [c*T, (c+1)*T). Per position:
- `input_segment_ids`: 1 for the first document seen in the chunk, +1 at each later
  document start; 0 on padding (past the end of a finite stream).
- `input_positions`: the offset from the segment's start *within the chunk* (a document
  cut by a chunk boundary restarts at 0, consistent with the segment mask; positions
  never exceed T - 1); 0 on padding.
- `target_num_bytes` (per chunk): the UTF-8 bytes of the text behind its targets. A
  document of B bytes spreads them over its n + 1 targets as
  `floor(B*(j+1)/(n+1)) - floor(B*j/(n+1))` for target j, so chunk sums are integers
  and a full pass over a corpus counts every byte exactly once (bits per byte =
  total nats / ln 2 / total bytes).
Padding positions have input, target, segment and position 0 (pad id 0 is never a token).
"""

from collections.abc import Sequence

import numpy as np

from axlearn.common.input_vocab import EOS_ID

FEATURE_KEYS = (
    "input_ids",
    "target_labels",
    "input_segment_ids",
    "input_positions",
    "target_num_bytes",
)


def byte_shares(
    num_bytes: np.ndarray, offsets: np.ndarray, block_lengths: np.ndarray
) -> np.ndarray:
    """Bytes credited to target `offsets` of blocks of `block_lengths` covering `num_bytes`."""
    num_bytes = num_bytes.astype(np.int64)
    offsets = offsets.astype(np.int64)
    block_lengths = block_lengths.astype(np.int64)
    return (num_bytes * (offsets + 1)) // block_lengths - (num_bytes * offsets) // block_lengths


def chunk_features(
    inputs: np.ndarray,
    targets: np.ndarray,
    starts: np.ndarray,
    shares: np.ndarray,
    valid: np.ndarray,
) -> dict[str, np.ndarray]:
    """Batch features from aligned per-position arrays of shape [rows, T].

    `starts` marks positions where a document block begins, `shares` are the bytes per
    target, `valid` is False on padding.
    """
    valid = valid.astype(bool)
    starts = starts.astype(bool) & valid
    # The first live position of a row opens a segment even if its document began earlier.
    starts[:, 0] |= valid[:, 0]
    segment_ids = np.cumsum(starts, axis=1, dtype=np.int32) * valid
    index = np.arange(inputs.shape[1], dtype=np.int32)
    last_start = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    positions = (index - last_start) * valid
    return {
        "input_ids": np.where(valid, inputs, 0).astype(np.int32),
        "target_labels": np.where(valid, targets, 0).astype(np.int32),
        "input_segment_ids": segment_ids.astype(np.int32),
        "input_positions": positions.astype(np.int32),
        "target_num_bytes": np.where(valid, shares, 0).sum(axis=1).astype(np.int32),
    }


def pack_documents(
    documents: Sequence[Sequence[int]], num_bytes: Sequence[int], max_sequence_length: int
) -> dict[str, np.ndarray]:
    """Packs a finite list of tokenized documents (no EOS) into [num_chunks, T] features.

    The reference implementation of the contract above, for one pass with no shuffling.
    """
    inputs, targets, starts, shares = [], [], [], []
    for tokens, size in zip(documents, num_bytes):
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.size == 0:
            continue
        length = tokens.size + 1
        inputs.append(np.concatenate([[EOS_ID], tokens]))
        targets.append(np.concatenate([tokens, [EOS_ID]]))
        starts.append(np.arange(length) == 0)
        offsets = np.arange(length)
        shares.append(byte_shares(np.full(length, size), offsets, np.full(length, length)))
    total = sum(len(x) for x in inputs)
    num_chunks = -(-total // max_sequence_length)
    padded = num_chunks * max_sequence_length

    def rows(parts, dtype):
        flat = np.zeros(padded, dtype=dtype)
        if parts:
            flat[:total] = np.concatenate(parts)
        return flat.reshape(num_chunks, max_sequence_length)

    valid = rows([np.ones(len(x), dtype=bool) for x in inputs], bool)
    return chunk_features(
        rows(inputs, np.int64),
        rows(targets, np.int64),
        rows(starts, bool),
        rows(shares, np.int64),
        valid,
    )
