"""Mixtures of token shard corpora: training batches whose rows come from several
sources in proportion to their weights.

Each row of global batch `step` draws its source from a generator seeded with
(seed, step), independently with probabilities `weights` (normalized). A source is a
`TokenShardInput`, packing its corpus as it would alone (its streams, its per-epoch
document order); a row drawn from it takes the next chunk of the source stream that
feeds that row, so each source's documents are consumed in order, none skipped, and a
small source with a large weight repeats epochs sooner. Every process makes the same
draws and reads only its own rows' chunks, so the batches do not depend on the process
count.

State: `{'batches_consumed': n, 'source_chunks': [[c, ...], ...]}`, the chunks each
source's streams have given so far; restoring it continues with batch n exactly.
"""

from collections.abc import Iterator, Sequence
from typing import Any, Optional, Union

import numpy as np

from axlearn.common.config import REQUIRED, ConfigError, Required, config_class
from axlearn.common.input_base import BaseInput, Batch, InputError
from axlearn.common.input_prefetch import prefetch_in_thread
from axlearn.common.input_tokens import TokenShardInput
from axlearn.common.module import Module

# Fields the mixture sets on every source: a source config leaves them unset or agrees.
_SHARED_FIELDS = ("global_batch_size", "max_sequence_length", "is_training")


class TokenShardMixtureInput(BaseInput):
    """Training rows drawn from several token shard sources by weight (see the module
    docstring)."""

    @config_class
    class Config(BaseInput.Config):
        """Configures TokenShardMixtureInput."""

        global_batch_size: Required[int] = REQUIRED  # Rows of a global batch, all processes.
        max_sequence_length: Required[int] = REQUIRED  # T: tokens per row.
        # The sources; their global_batch_size, max_sequence_length and is_training come
        # from the mixture.
        sources: Required[Sequence[TokenShardInput.Config]] = REQUIRED
        weights: Required[Sequence[float]] = REQUIRED  # One per source, positive; normalized.
        seed: int = 0  # Seeds the draw of each row's source.
        prefetch_batches: int = 2  # Batches computed ahead in a background thread (0: none).

    def __init__(self, cfg: Config, *, parent: Optional[Module], **kwargs):
        super().__init__(cfg, parent=parent, **kwargs)
        cfg = self.config
        if not cfg.is_training:
            raise ConfigError(
                f"{self.path()}.is_training: a mixture is a training input; evaluate on "
                "each source's validation shards with a TokenShardInput"
            )
        if not cfg.sources or len(cfg.weights) != len(cfg.sources):
            raise ConfigError(
                f"{self.path()}: {len(cfg.sources or ())} sources and "
                f"{len(cfg.weights or ())} weights; give one positive weight per source"
            )
        weights = np.asarray(cfg.weights, dtype=np.float64)
        if not np.all(np.isfinite(weights) & (weights > 0)):
            raise ConfigError(f"{self.path()}.weights: {list(cfg.weights)} must all be > 0")
        self._cumulative = np.cumsum(weights) / weights.sum()
        self._sources: list[TokenShardInput] = [
            self._add_child(f"source{i}", self._source_config(i), **self._process_overrides())
            for i in range(len(cfg.sources))
        ]
        self._check_vocabularies()
        self._source_chunks = [np.zeros(s.num_streams, dtype=np.int64) for s in self._sources]

    def _source_config(self, index: int) -> TokenShardInput.Config:
        cfg = self.config
        source = cfg.sources[index]
        for field in _SHARED_FIELDS:
            value = getattr(source, field)
            if value is not REQUIRED and value != getattr(cfg, field):
                raise ConfigError(
                    f"{self.path()}.sources[{index}].{field}={value!r} differs from the "
                    f"mixture's {getattr(cfg, field)!r}; leave it unset"
                )
        return source.clone(**{field: getattr(cfg, field) for field in _SHARED_FIELDS})

    def _check_vocabularies(self) -> None:
        first = self._sources[0].vocabulary
        for i, source in enumerate(self._sources[1:], start=1):
            if source.vocabulary != first:
                raise ConfigError(
                    f"{self.path()}.sources[{i}]: shards of vocabulary {source.vocabulary} "
                    f"(name, size, eos id), but sources[0]'s are of {first}"
                )

    # ----- the draws -----

    def row_sources(self, step: int) -> np.ndarray:
        """The source of each row of global batch `step`."""
        draws = np.random.default_rng([self.config.seed, step]).random(self.global_batch_size)
        sources = np.searchsorted(self._cumulative, draws, side="right")
        return np.minimum(sources, len(self._sources) - 1)  # Rounding at the top end.

    def _batch(self, step: int, source_chunks: list[np.ndarray]) -> Batch:
        """This process's rows of global batch `step`; advances `source_chunks` (in place)
        by the chunks every process's rows took from each source stream."""
        host = self.host_rows()
        parts: list[tuple[np.ndarray, Batch]] = []  # (host row indices, their features)
        row_sources = self.row_sources(step)
        for index, source in enumerate(self._sources):
            rows = np.flatnonzero(row_sources == index)
            streams = source.stream_of_rows(rows)
            for stream in np.unique(streams):
                stream_rows = rows[streams == stream]
                chunks = source_chunks[index][stream] + np.arange(stream_rows.size)
                source_chunks[index][stream] += stream_rows.size
                mine = (stream_rows >= host.start) & (stream_rows < host.stop)
                if mine.any():
                    features = source.stream_features(int(stream), chunks[mine])
                    parts.append((stream_rows[mine] - host.start, features))
        with_weights = any(source.has_loss_mask for source in self._sources)
        return _assemble_rows(parts, host.stop - host.start, with_weights=with_weights)

    # ----- batches and state -----

    def _host_batches(self, start: int) -> Iterator[Batch]:
        if start != self._batches_consumed:
            raise InputError(f"{self.path()}: a mixture continues from its state only")
        source_chunks = [chunks.copy() for chunks in self._source_chunks]

        def generate():
            step = start
            while True:
                batch = self._batch(step, source_chunks)
                yield [chunks.copy() for chunks in source_chunks], batch
                step += 1

        for chunks_after, batch in prefetch_in_thread(generate(), self.config.prefetch_batches):
            self._source_chunks = chunks_after  # Counted as the batch is handed over.
            yield batch

    def get_state(self) -> dict[str, Any]:
        return {
            **super().get_state(),
            "source_chunks": [chunks.tolist() for chunks in self._source_chunks],
        }

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        chunks = state.get("source_chunks")
        shapes = [source.num_streams for source in self._sources]
        if (
            not isinstance(chunks, list)
            or [len(c) if isinstance(c, list) else None for c in chunks] != shapes
            or not all(isinstance(n, int) and n >= 0 for c in chunks for n in c)
        ):
            raise InputError(
                f"{self.path()}: input state 'source_chunks' {chunks!r} is not a list of "
                f"chunk counts per source stream of lengths {shapes}"
            )
        self._source_chunks = [np.asarray(c, dtype=np.int64) for c in chunks]


def _assemble_rows(
    parts: Sequence[tuple[np.ndarray, Batch]], num_rows: int, *, with_weights: bool = False
) -> Batch:
    """One batch of `num_rows` rows from (row indices, features of those rows) parts.

    `with_weights` (a source has chat shards' loss mask): the batch has 'target_weights',
    1 on the rows of sources without one (every live target trains, as without the key)."""
    batch = {
        key: np.zeros((num_rows, *value.shape[1:]), value.dtype)
        for key, value in parts[0][1].items()
        if key != "target_weights"
    }
    if with_weights:
        batch["target_weights"] = np.zeros((num_rows, *batch["input_ids"].shape[1:]), np.float32)
    for rows, features in parts:
        if with_weights and "target_weights" not in features:
            batch["target_weights"][rows] = 1.0
        for key, value in features.items():
            batch[key][rows] = value
    return batch


SourceSpec = Union[str, Sequence[str], TokenShardInput.Config]


def token_shard_mixture(
    sources: Sequence[tuple[SourceSpec, float]], **fields: Any
) -> TokenShardMixtureInput.Config:
    """A mixture config from (source, weight) pairs, a source being a TokenShardInput
    config or its shard paths (a glob, or a list of them); `fields` set the mixture's own
    (global_batch_size, max_sequence_length, seed, ...)."""
    configs = []
    for source, _ in sources:
        if isinstance(source, str):
            source = [source]
        if not isinstance(source, TokenShardInput.Config):
            source = TokenShardInput.default_config().set(paths=list(source))
        configs.append(source)
    return TokenShardMixtureInput.default_config().set(
        is_training=True, sources=configs, weights=[float(w) for _, w in sources], **fields
    )
