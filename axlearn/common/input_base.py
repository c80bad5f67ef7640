"""The interface every input shares, as the trainer and evalers use it.

An input is a `Module` whose config has `is_training` and a global batch size. It yields
*host-local* batches: dicts of NumPy arrays holding this process's rows of each global
batch (`global_batch_size // process_count` rows; process i holds rows [i*b, (i+1)*b)):

    input_ids          [b, T] int32   tokens fed to the model
    target_labels      [b, T] int32   next-token targets; 0 = padding (no loss)
    input_segment_ids  [b, T] int32   1, 2, 3... per packed document; 0 on padding
    input_positions    [b, T] int32   position within the document's segment
    target_num_bytes   [b]    int32   UTF-8 bytes behind the live targets (0 if unknown)
    target_weights     [b, T] float32 optional (chat shards' loss mask): 1 where the
                                      target trains; absent, every live target does

(see `input_packing` for the exact packing contract).

- Training inputs repeat forever. Their position is counted in consumed batches:
  `get_state()` after n batches returns a JSON-able dict from which `set_state()` makes
  the next `dataset()` continue with batch n, exactly as if never interrupted. (Keep one
  training iterator alive at a time: each one advances the same count.)
- Evaluation inputs (`is_training=False`) are finite; every `dataset()` call starts a
  new pass. The last global batch is filled with padding rows (all-zero targets) so
  every batch has the same shape, and every process yields the same number of batches.
"""

import re
from collections.abc import Callable, Iterator
from typing import Any, Optional

import jax
import numpy as np

from axlearn.common.config import (
    REQUIRED,
    ConfigError,
    Required,
    config_class,
    register_configurable,
)
from axlearn.common.input_packing import FEATURE_KEYS
from axlearn.common.module import Module
from axlearn.common.sharding import maybe_shard
from axlearn.common.utils import tree_paths

Batch = dict[str, np.ndarray]


# (path regex or None, rank) -> partition spec of the input arrays of that path and rank.
PathRankToPartition = dict[tuple[Optional[str], int], Any]


@register_configurable
def partition_by_path_rank(path_rank_to_partition: PathRankToPartition) -> Callable[[Any], Any]:
    """An input partitioner: shards each array of a global batch by its '/'-joined path
    and rank. The first key (regex, rank) whose regex fully matches the path and whose
    rank is the array's wins; a None regex matches every path. Returns fn(batch) -> batch
    that applies the specs as sharding constraints (inside the jitted step, on a mesh).

    Example: {(None, 1): P(batch_axes), (None, 2): P(batch_axes, 'seq')} splits [B] and
    [B, T] inputs over the batch axes, and sequences over 'seq'.
    """
    rules = [
        (None if path is None else re.compile(path), rank, spec)
        for (path, rank), spec in path_rank_to_partition.items()
    ]

    def partition(batch: Any) -> Any:
        def shard(path: str, x: Any) -> Any:
            for regex, rank, spec in rules:
                if x.ndim == rank and (regex is None or regex.fullmatch(path)):
                    return maybe_shard(x, spec)
            raise ValueError(
                f"partition_by_path_rank: no rule for input '{path}' of rank {x.ndim}; "
                f"rules: {list(path_rank_to_partition)}"
            )

        paths = tree_paths(batch)
        return jax.tree.map(shard, paths, batch)

    return partition


class InputError(ValueError):
    """Input data that cannot be read as configured (missing, empty, corrupt, mismatched)."""


class BaseInput(Module):
    """A source of host-local batches (see the module docstring)."""

    @config_class
    class Config(Module.Config):
        """Configures BaseInput."""

        is_training: Required[bool] = REQUIRED  # Training: repeat and shuffle; else one pass.

    def __init__(
        self,
        cfg: Config,
        *,
        parent: Optional[Module],
        process_index: Optional[int] = None,
        process_count: Optional[int] = None,
    ):
        """`process_index` / `process_count` override jax's (tests simulate several hosts).

        jax's values are read on first use, not here: building an input must not start the
        jax backends before `jax.distributed.initialize()`.
        """
        super().__init__(cfg, parent=parent)
        if process_index is not None and process_count is not None:
            if not 0 <= process_index < process_count:
                raise ConfigError(
                    f"{self.path()}: process_index {process_index} is not in [0, {process_count})"
                )
        self._process_index = process_index
        self._process_count = process_count
        self._batches_consumed = 0

    # ----- what subclasses provide -----

    @property
    def global_batch_size(self) -> int:
        """Rows of a global batch: the config's `global_batch_size` unless overridden."""
        return self._config_field("global_batch_size")

    @property
    def max_sequence_length(self) -> int:
        """Tokens per row: the config's `max_sequence_length` unless overridden."""
        return self._config_field("max_sequence_length")

    def _config_field(self, name: str) -> int:
        if name not in self._config.keys():
            raise NotImplementedError(f"{type(self).__name__} must define {name}")
        return getattr(self._config, name)

    def _host_batches(self, start: int) -> Iterator[Batch]:
        """This process's batches, beginning with global batch `start`."""
        raise NotImplementedError(type(self))

    # ----- the interface -----

    @property
    def process_index(self) -> int:
        return jax.process_index() if self._process_index is None else self._process_index

    @property
    def process_count(self) -> int:
        return jax.process_count() if self._process_count is None else self._process_count

    def _process_overrides(self) -> dict[str, Optional[int]]:
        """The constructor's process arguments, to hand on to a child input."""
        return dict(process_index=self._process_index, process_count=self._process_count)

    @property
    def host_batch_size(self) -> int:
        """Rows per process: global_batch_size // process_count."""
        global_batch_size, process_count = self.global_batch_size, self.process_count
        if global_batch_size % process_count:
            raise ConfigError(
                f"{self.path()}: global batch size {global_batch_size} is not divisible by the "
                f"process count {process_count}"
            )
        return global_batch_size // process_count

    def host_rows(self) -> slice:
        """This process's rows of a global batch."""
        size = self.host_batch_size
        return slice(self.process_index * size, (self.process_index + 1) * size)

    def dataset(self) -> Iterator[Batch]:
        """Host-local batches: training continues from the current state, eval restarts."""
        if self.config.is_training:
            return self._counted(self._host_batches(self._batches_consumed))
        return self._checked_eval(self._host_batches(0))

    def __iter__(self) -> Iterator[Batch]:
        return self.dataset()

    def element_spec(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes and dtypes of one *global* batch."""
        batch, length = self.global_batch_size, self.max_sequence_length
        spec = {key: jax.ShapeDtypeStruct((batch, length), np.int32) for key in FEATURE_KEYS}
        spec["target_num_bytes"] = jax.ShapeDtypeStruct((batch,), np.int32)
        return spec

    def get_state(self) -> dict[str, Any]:
        """A JSON-able position: the number of global batches consumed so far."""
        return {"batches_consumed": self._batches_consumed}

    def set_state(self, state: dict[str, Any]) -> None:
        """Makes the next `dataset()` continue right after the batches `state` counts."""
        consumed = state.get("batches_consumed") if isinstance(state, dict) else None
        if not isinstance(consumed, int) or consumed < 0:
            raise InputError(
                f"{self.path()}: input state {state!r} is not of the form "
                "{'batches_consumed': <int >= 0>}"
            )
        self._batches_consumed = consumed

    def partition_batch(self, batch: Any) -> Any:
        """The global batch as the train step shards it (inside jit): unchanged unless the
        input has a partitioner (`input_tf_data.Input.input_partitioner`)."""
        return batch

    # ----- helpers -----

    def _counted(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        produced = 0
        for batch in batches:
            # Count before handing the batch over: once next() returns, it is consumed.
            self._batches_consumed += 1
            produced += 1
            yield batch
        if produced == 0:
            raise InputError(f"{self.path()}: the training input produced no batches")

    def _checked_eval(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        produced = 0
        for batch in batches:
            produced += 1
            yield batch
        if produced == 0:
            raise InputError(f"{self.path()}: the evaluation input produced no batches")
