"""Accumulating summaries over many batches.

An evaluation runs a model over many batches; each call yields a nested dict of
summaries. `MetricAccumulator` combines them into one dict of the same structure:
a `WeightedScalar` becomes the weight-averaged mean with the total weight (so a loss per
token over uneven batches equals the loss over all tokens at once), and any other
numeric value becomes its plain average over the batches that reported it.

Accumulation stays on the device in float32 (no host round trip per batch) and uses the
running-mean update, which keeps float32 accurate over long evaluations.
"""

from collections.abc import Mapping
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from axlearn.common.config import Configurable, config_class
from axlearn.common.summary import WeightedScalar


@jax.jit
def _combine(mean: jax.Array, weight: jax.Array, new_mean: jax.Array, new_weight: jax.Array):
    """(mean, weight) of the union of two weighted sets."""
    total = weight + new_weight
    # Running-mean form: no large sums of mean * weight that lose float32 precision.
    running = mean + (new_mean - mean) * (new_weight / jnp.where(total > 0, total, 1))
    # A weightless side contributes nothing, not even a NaN mean (e.g. 0/0 of a batch
    # of padding only).
    combined = jnp.where(weight > 0, running, new_mean)
    combined = jnp.where(new_weight > 0, combined, mean)
    return combined, total


def _as_float(x: Any) -> Any:
    """float32 values; host values stay NumPy, so that under multi-process jit they are
    taken as replicated instead of as one process's device array."""
    if isinstance(x, jax.Array):
        return x.astype(jnp.float32)
    return np.asarray(x, dtype=np.float32)


class _Entry:
    """The running (mean, weight) of one summary path."""

    def __init__(self, path: str, weighted: bool, mean: jax.Array, weight: jax.Array):
        self.path = path
        self.weighted = weighted
        self.mean = mean
        self.weight = weight

    def add(self, weighted: bool, mean: jax.Array, weight: jax.Array) -> None:
        if weighted != self.weighted:
            kinds = ("a plain value", "a WeightedScalar")
            raise TypeError(
                f"Summary '{self.path}' was {kinds[self.weighted]} and now is {kinds[weighted]}"
            )
        if mean.shape != self.mean.shape:
            raise ValueError(
                f"Summary '{self.path}' changed shape from {self.mean.shape} to {mean.shape}"
            )
        self.mean, self.weight = _combine(self.mean, self.weight, mean, weight)

    def value(self) -> Any:
        return WeightedScalar(self.mean, self.weight) if self.weighted else self.mean


class MetricAccumulator(Configurable):
    """Combines the summaries of many batches (WeightedScalar by weight, others averaged)."""

    @config_class
    class Config(Configurable.Config):
        """Configures MetricAccumulator."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        # Nested like the summaries; leaves are _Entry.
        self._entries: dict[str, Any] = {}

    def reset(self) -> None:
        """Forgets everything accumulated so far."""
        self._entries = {}

    def update(self, summaries: Mapping[str, Any]) -> None:
        """Adds one batch's (nested) summaries; None values and empty dicts are skipped."""
        self._update(self._entries, summaries, prefix="")

    def _update(self, entries: dict[str, Any], summaries: Mapping[str, Any], prefix: str) -> None:
        for key, value in summaries.items():
            path = f"{prefix}/{key}" if prefix else str(key)
            if isinstance(value, Mapping):
                child = entries.setdefault(key, {})
                if not isinstance(child, dict):
                    raise TypeError(f"Summary '{path}' was a value and now is a dict")
                self._update(child, value, path)
                continue
            if value is None:
                continue
            weighted, mean, weight = self._parse(path, value)
            entry: Optional[Any] = entries.get(key)
            if entry is None:
                entries[key] = _Entry(path, weighted, mean, weight)
            elif isinstance(entry, dict):
                raise TypeError(f"Summary '{path}' was a dict and now is a value")
            else:
                entry.add(weighted, mean, weight)

    @staticmethod
    def _parse(path: str, value: Any) -> tuple[bool, jax.Array, jax.Array]:
        if isinstance(value, WeightedScalar):
            return True, _as_float(value.mean), _as_float(value.weight)
        error = TypeError(f"Summary '{path}' is a {type(value).__name__}; expected a number")
        if isinstance(value, (str, bytes)):
            raise error
        try:
            return False, _as_float(value), _as_float(1.0)
        except (TypeError, ValueError) as e:
            raise error from e

    def summaries(self) -> dict[str, Any]:
        """The accumulated summaries, nested like the inputs.

        WeightedScalar(mean over all weight, total weight) for weighted summaries; the
        average over batches (a float32 jax array) for the others.
        """

        def build(entries: dict[str, Any]) -> dict[str, Any]:
            out = {}
            for key, entry in entries.items():
                value = build(entry) if isinstance(entry, dict) else entry.value()
                if not (isinstance(value, dict) and not value):
                    out[key] = value
            return out

        return build(self._entries)
