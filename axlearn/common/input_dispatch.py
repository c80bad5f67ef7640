"""Feeding a global batch that has fewer rows than the mesh needs, or fewer than one
per process.

The model trains on a *logical* batch of `global_logical_batch_size` rows. Processes
("physical feeds") hand the devices a *physical* batch: at least one row per device and
the same rows per process. The rows come from the first `num_logical_feeds` processes
(`logical_feed_indices`), each reading `feed_logical_batch_size` rows of the logical
batch; every process then pads its rows up to `feed_physical_batch_size` with padding
rows (all zeros: no targets, so no loss and no weight in any metric). A process that is
no logical feed sends padding only. The physical batch thus trains exactly as the
logical batch would, on a mesh of any size.

Example: a logical batch of 32 rows on 64 devices over 8 processes: 8 logical feeds of
4 rows each, padded to a physical batch of 64 rows, 8 per process.
"""

from collections.abc import Sequence
from typing import Any, Optional

import jax
import numpy as np

from axlearn.common.config import REQUIRED, ConfigError, Required, config_class
from axlearn.common.module import Module

Batch = dict[str, Any]


class SpmdInputDispatcher(Module):
    """Maps per-process logical batches to a physical batch (see the module docstring)."""

    @config_class
    class Config(Module.Config):
        """Configures SpmdInputDispatcher."""

        global_logical_batch_size: Required[int] = REQUIRED  # Rows the model trains on.
        # Rows of the batch handed to the devices; None: the logical rows of a feed times
        # the feeds, or the device count if larger, rounded up to a multiple of the feeds.
        global_physical_batch_size: Optional[int] = None
        # How the physical batch is laid out over the mesh; its first entry names the mesh
        # axes the rows split over (the trainer shards input rows over them). None: the
        # trainer's batch_axis_names.
        partition_spec: Optional[Any] = None
        # Processes feeding the devices, and this one's index; None: jax's process count
        # and index (the input fills them in).
        num_physical_feeds: Optional[int] = None
        physical_feed_index: Optional[int] = None
        # The processes that read logical rows, in logical order; None: the first
        # min(global_logical_batch_size, num_physical_feeds) processes.
        logical_feed_indices: Optional[Sequence[int]] = None

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        # Derived on first use: reading jax's process and device counts here would start
        # the backends before jax.distributed.initialize().
        self._layout: Optional[dict[str, Any]] = None

    def _resolved(self) -> dict[str, Any]:
        if self._layout is None:
            self._layout = self._derive_layout()
        return self._layout

    def _derive_layout(self) -> dict[str, Any]:
        cfg, where = self.config, self.path()
        num_feeds = cfg.num_physical_feeds or jax.process_count()
        index = jax.process_index() if cfg.physical_feed_index is None else cfg.physical_feed_index
        if not 0 <= index < num_feeds:
            raise ConfigError(f"{where}.physical_feed_index: {index} is not in [0, {num_feeds})")
        logical = cfg.logical_feed_indices
        if logical is None:
            logical = range(min(cfg.global_logical_batch_size, num_feeds))
        logical = list(logical)
        if not logical or len(set(logical)) != len(logical) or not all(
            0 <= i < num_feeds for i in logical
        ):
            raise ConfigError(
                f"{where}.logical_feed_indices: {logical} must be distinct feed indices in "
                f"[0, {num_feeds})"
            )
        if cfg.global_logical_batch_size % len(logical):
            raise ConfigError(
                f"{where}.global_logical_batch_size: {cfg.global_logical_batch_size} rows do "
                f"not split evenly over {len(logical)} logical feeds"
            )
        feed_logical = cfg.global_logical_batch_size // len(logical)
        physical = cfg.global_physical_batch_size
        if physical is None:
            rows = max(feed_logical * num_feeds, jax.device_count())
            physical = -(-rows // num_feeds) * num_feeds
        if physical % num_feeds or physical // num_feeds < feed_logical:
            raise ConfigError(
                f"{where}.global_physical_batch_size: {physical} rows must split evenly "
                f"over {num_feeds} feeds with at least {feed_logical} rows each"
            )
        return dict(num_feeds=num_feeds, index=index, logical=logical, physical=physical)

    @property
    def num_physical_feeds(self) -> int:
        return self._resolved()["num_feeds"]

    @property
    def num_logical_feeds(self) -> int:
        return len(self._resolved()["logical"])

    @property
    def logical_feed_index(self) -> Optional[int]:
        """This process's place among the logical feeds; None: it feeds padding only."""
        layout = self._resolved()
        if layout["index"] in layout["logical"]:
            return layout["logical"].index(layout["index"])
        return None

    @property
    def feed_logical_batch_size(self) -> int:
        return self.config.global_logical_batch_size // self.num_logical_feeds

    @property
    def global_physical_batch_size(self) -> int:
        return self._resolved()["physical"]

    @property
    def feed_physical_batch_size(self) -> int:
        return self.global_physical_batch_size // self.num_physical_feeds

    def feed_read_config(self) -> dict[str, int]:
        """Which share of the logical rows this process reads: {'num_shards', 'shard_index'}.
        A process that feeds padding only reads some logical feed's share (its rows are
        zeroed), so that every process runs the same pipeline."""
        index = self.logical_feed_index
        return dict(num_shards=self.num_logical_feeds, shard_index=0 if index is None else index)

    def logical_to_physical(self, batch: Batch) -> Batch:
        """This process's logical rows [feed_logical_batch_size, ...] -> its physical rows
        [feed_physical_batch_size, ...]: padded with zero rows, all zeros where this
        process is no logical feed."""
        logical, physical = self.feed_logical_batch_size, self.feed_physical_batch_size
        feeds_padding = self.logical_feed_index is None

        def pad(path: str, x: Any) -> np.ndarray:
            x = np.asarray(x)
            if x.ndim == 0 or x.shape[0] != logical:
                raise ValueError(
                    f"{self.path()}: input '{path}' has shape {x.shape}; expected "
                    f"{logical} logical rows first"
                )
            rows = np.zeros_like(x) if feeds_padding else x
            padding = np.zeros((physical - logical,) + x.shape[1:], x.dtype)
            return np.concatenate([rows, padding], axis=0)

        return {key: pad(key, value) for key, value in batch.items()}
