"""Summary values that modules add to their output collection.

Scalars that are averages carry their weight, so that averages over microbatches,
devices and evaluation batches are exact (`WeightedScalar`).
"""

import dataclasses
from typing import Any, Union

import jax
import jax.numpy as jnp


@dataclasses.dataclass
class WeightedScalar:
    """A mean and the total weight behind it (e.g. loss per token and the token count)."""

    mean: Union[jax.Array, float]
    weight: Union[jax.Array, float]

    def __add__(self, other: "WeightedScalar") -> "WeightedScalar":
        weight = self.weight + other.weight
        mean = (self.mean * self.weight + other.mean * other.weight) / jnp.maximum(weight, 1e-30)
        return WeightedScalar(mean=mean, weight=weight)


jax.tree_util.register_dataclass(WeightedScalar, data_fields=["mean", "weight"], meta_fields=[])


def is_weighted_scalar(x: Any) -> bool:
    return isinstance(x, WeightedScalar)


def scalar_value(x: Any) -> Any:
    """The number a summary writer records: a WeightedScalar's mean, else the value."""
    return x.mean if isinstance(x, WeightedScalar) else x
