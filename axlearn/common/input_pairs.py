"""Preference-pair batches (DPO) from pair shards, one pair per row.

`python -m axlearn.common.input_tokens build --pairs --max_sequence_length=T ...` renders
records `{"prompt": ..., "chosen": ..., "rejected": ...}` with the chat template into
pair shards (`input_token_format`: documents 2i and 2i + 1 are prompt + chosen and
prompt + rejected, the loss mask 1 on the response). `PreferencePairInput` makes of pair
k the row

    chosen_input_ids         EOS t_0 ... t_{n-2}    (t: prompt + chosen, then EOS)
    chosen_target_labels     t_0 t_1 ... t_{n-1}
    chosen_target_weights    1 on response targets, 0 on prompt targets

and the same for `rejected_*`, each [B, T]: int32 ids padded with 0, float32 weights
0 on padding. Rows are not packed; a sequence longer than T is cut to its first T
(the response's end is lost, its start kept: the build refuses prompts that leave no
response target within its --max_sequence_length, and this input those that leave none
within its T). Training visits pairs in a new order each epoch (a permutation drawn from
(seed, epoch)) and resumes from `{'batches_consumed': n}` exactly; evaluation reads them
in order once, the last batch padded with empty rows (all weights 0).

Reference log-probabilities computed ahead (DPO's frozen reference, summed over each
response's targets) come from `reference_logps`: a `.npy` file of float32 [pairs, 2],
(chosen, rejected) per pair in shard order; batches then add `reference_chosen_logps`
and `reference_rejected_logps` [B] (0 on padding rows).
"""

from collections.abc import Iterator, Sequence
from typing import Any, Optional

import numpy as np

from axlearn.common.config import REQUIRED, ConfigError, Required, config_class
from axlearn.common.input_base import BaseInput, Batch, InputError
from axlearn.common.input_prefetch import prefetch_indexed
from axlearn.common.input_token_format import check_vocabulary
from axlearn.common.input_tokens import check_same_vocabulary, expand_shard_paths, open_shard
from axlearn.common.module import Module

PAIR_KEYS = tuple(
    f"{side}_{key}"
    for side in ("chosen", "rejected")
    for key in ("input_ids", "target_labels", "target_weights")
)
REFERENCE_KEYS = ("reference_chosen_logps", "reference_rejected_logps")  # With reference_logps.


class PreferencePairInput(BaseInput):
    """Pair batches from pair shards (see the module docstring)."""

    @config_class
    class Config(BaseInput.Config):
        """Configures PreferencePairInput."""

        global_batch_size: Required[int] = REQUIRED  # Pairs of a global batch, all processes.
        max_sequence_length: Required[int] = REQUIRED  # T: tokens per row (each side).
        # Pair shard files or glob patterns (local paths or storage URLs).
        paths: Required[Sequence[str]] = REQUIRED
        seed: int = 0  # Seeds the per-epoch pair order.
        shuffle: bool = True  # Training only: a new pair order every epoch.
        # The model's vocabulary: shards made with another name, or with more ids than the
        # model's vocab_size, are rejected. None: not checked.
        vocab_name: Optional[str] = None
        model_vocab_size: Optional[int] = None
        prefetch_batches: int = 2  # Batches computed ahead in a background thread (0: none).
        verify_checksums: bool = True  # CRC-check each shard's payload when opening it.
        # A .npy file of float32 [pairs, 2]: the reference model's (chosen, rejected)
        # response log-probabilities per pair, in shard order. None: not given.
        reference_logps: Optional[str] = None

    def __init__(self, cfg: Config, *, parent: Optional[Module], **kwargs):
        super().__init__(cfg, parent=parent, **kwargs)
        cfg = self.config
        if cfg.max_sequence_length <= 0 or cfg.global_batch_size <= 0:
            raise ConfigError(
                f"{self.path()}: global_batch_size and max_sequence_length must be positive"
            )
        paths = [cfg.paths] if isinstance(cfg.paths, str) else cfg.paths
        paths = expand_shard_paths(paths)
        if not paths:
            raise InputError(f"{self.path()}: no pair shards configured")
        shards = [open_shard(path, verify_checksum=cfg.verify_checksums) for path in paths]
        for shard in shards:
            check_vocabulary(
                shard.path,
                shard.header,
                vocab_name=cfg.vocab_name,
                model_vocab_size=cfg.model_vocab_size,
            )
            if not shard.header.is_pairs:
                raise InputError(
                    f"{self.path()}: {shard.path} holds no preference pairs; build pair shards "
                    "with `python -m axlearn.common.input_tokens build --pairs`"
                )
        check_same_vocabulary([(shard.path, shard.header) for shard in shards])
        self._shards = shards
        self.eos_id = shards[0].header.eos_id
        # Per document: (shard, start, end) of its stored tokens; pair k = documents 2k, 2k+1.
        shard_of, starts, ends = [], [], []
        for i, shard in enumerate(shards):
            doc_ends = shard.doc_ends.astype(np.int64)
            doc_starts = np.concatenate([[0], doc_ends[:-1]])
            self._check_prompts(shard, doc_starts, doc_ends)
            shard_of.append(np.full(doc_ends.size, i))
            starts.append(doc_starts)
            ends.append(doc_ends)
        self._doc_shard = np.concatenate(shard_of)
        self._doc_starts = np.concatenate(starts)
        self._doc_ends = np.concatenate(ends)
        self.num_pairs = self._doc_starts.size // 2
        if self.num_pairs == 0:
            raise InputError(f"{self.path()}: the shards {paths} hold no pairs")
        self._reference = None
        if cfg.reference_logps is not None:
            self._reference = self._load_reference(cfg.reference_logps)

    def _load_reference(self, path: str) -> np.ndarray:
        try:
            values = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise InputError(
                f"{self.path()}.reference_logps: {path}: not a readable .npy file ({e})"
            ) from None
        if values.shape != (self.num_pairs, 2) or not np.issubdtype(values.dtype, np.floating):
            raise InputError(
                f"{self.path()}.reference_logps: {path} holds {values.dtype} {values.shape}, "
                f"expected float [{self.num_pairs}, 2] (one (chosen, rejected) row per pair)"
            )
        return values.astype(np.float32)

    def _check_prompts(self, shard: Any, starts: np.ndarray, ends: np.ndarray) -> None:
        """Refuses a pair whose prompt leaves no response target within T."""
        if not starts.size:
            return
        length = self.config.max_sequence_length
        index = np.arange(shard.header.num_tokens, dtype=np.int64)
        trained = np.where(shard.loss_mask != 0, index, np.iinfo(np.int64).max)
        first = np.minimum.reduceat(trained, starts) - starts  # Prompt targets of each document.
        long = np.flatnonzero((first >= length) | (first >= ends - starts))
        if long.size:
            doc = int(long[0])
            raise InputError(
                f"{self.path()}: {shard.path}: pair {doc // 2}'s prompt is {int(first[doc])} "
                f"tokens, leaving no response token in a row of max_sequence_length={length}"
            )

    # ----- batches -----

    @property
    def num_eval_batches(self) -> int:
        """Global batches of one evaluation pass (the last one padded)."""
        return -(-self.num_pairs // self.global_batch_size)

    def element_spec(self) -> dict[str, Any]:
        import jax  # pylint: disable=import-outside-toplevel

        shape = (self.global_batch_size, self.max_sequence_length)
        spec = {
            key: jax.ShapeDtypeStruct(
                shape, np.float32 if key.endswith("weights") else np.int32
            )
            for key in PAIR_KEYS
        }
        if self._reference is not None:
            for key in REFERENCE_KEYS:
                spec[key] = jax.ShapeDtypeStruct((self.global_batch_size,), np.float32)
        return spec

    def pair_indices(self, step: int) -> np.ndarray:
        """The pair of each of this process's rows of global batch `step` (-1: padding)."""
        cfg = self.config
        rows = self.host_rows()
        k = step * self.global_batch_size + np.arange(rows.start, rows.stop, dtype=np.int64)
        if not cfg.is_training:
            return np.where(k < self.num_pairs, k, -1)
        epochs, offsets = k // self.num_pairs, k % self.num_pairs
        pairs = np.empty_like(k)
        for epoch in np.unique(epochs):
            if cfg.shuffle:
                order = np.random.default_rng([cfg.seed, int(epoch)]).permutation(self.num_pairs)
            else:
                order = np.arange(self.num_pairs)
            where = epochs == epoch
            pairs[where] = order[offsets[where]]
        return pairs

    def host_batch(self, step: int) -> Batch:
        """This process's rows of global batch `step`."""
        length = self.max_sequence_length
        pairs = self.pair_indices(step)
        batch = {
            key: np.zeros((pairs.size, length), np.float32 if key.endswith("weights") else np.int32)
            for key in PAIR_KEYS
        }
        if self._reference is not None:
            for column, key in enumerate(REFERENCE_KEYS):
                batch[key] = np.where(pairs >= 0, self._reference[pairs, column], 0.0).astype(
                    np.float32
                )
        for row, pair in enumerate(pairs):
            if pair < 0:
                continue
            for side, doc in (("chosen", 2 * pair), ("rejected", 2 * pair + 1)):
                shard = self._shards[self._doc_shard[doc]]
                start = int(self._doc_starts[doc])
                end = min(int(self._doc_ends[doc]), start + length)
                n = end - start
                targets = shard.tokens[start:end]
                batch[f"{side}_target_labels"][row, :n] = targets
                batch[f"{side}_input_ids"][row, 0] = self.eos_id
                batch[f"{side}_input_ids"][row, 1:n] = targets[:-1]
                batch[f"{side}_target_weights"][row, :n] = shard.loss_mask[start:end]
        return batch

    def _host_batches(self, start: int) -> Iterator[Batch]:
        cfg = self.config
        stop = None if cfg.is_training else self.num_eval_batches
        return prefetch_indexed(self.host_batch, start=start, stop=stop, size=cfg.prefetch_batches)
