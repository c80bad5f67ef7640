"""Tests of axlearn.common.metrics.MetricAccumulator."""

import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common.metrics import MetricAccumulator
from axlearn.common.summary import WeightedScalar


def _accumulator() -> MetricAccumulator:
    return MetricAccumulator.default_config().instantiate()


def _uneven_batches(seed: int = 0):
    """Per-token losses of batches of very different sizes."""
    rng = np.random.default_rng(seed)
    return [rng.uniform(0.0, 8.0, size=n) for n in (3, 200, 1, 57, 9)]


def test_weighted_scalars_equal_the_mean_over_all_weight_at_once():
    batches = _uneven_batches()
    acc = _accumulator()
    for losses in batches:
        acc.update({"loss": WeightedScalar(jnp.asarray(losses.mean()), jnp.asarray(losses.size))})
    result = acc.summaries()["loss"]
    everything = np.concatenate(batches)
    np.testing.assert_allclose(float(result.mean), everything.mean(), rtol=1e-6)
    assert float(result.weight) == everything.size
    # Weights matter: the unweighted mean of batch means is far from the answer.
    assert abs(np.mean([b.mean() for b in batches]) - everything.mean()) > 1e-2


def test_plain_values_are_averaged_over_batches():
    values = [1.0, np.float32(4.0), jnp.asarray(10.0)]
    acc = _accumulator()
    for v in values:
        acc.update({"count": v})
    np.testing.assert_allclose(np.asarray(acc.summaries()["count"]), 5.0, rtol=1e-7)


def test_arrays_are_averaged_elementwise():
    rng = np.random.default_rng(1)
    arrays = [rng.normal(size=(4,)) for _ in range(3)]
    acc = _accumulator()
    for a in arrays:
        acc.update({"vec": a})
    np.testing.assert_allclose(
        np.asarray(acc.summaries()["vec"]), np.mean(arrays, axis=0), rtol=1e-5, atol=1e-6
    )


def test_nested_summaries_keep_their_structure():
    acc = _accumulator()
    acc.update({"a": {"b": WeightedScalar(1.0, 1.0), "empty": {}}, "c": 2.0, "skip": None})
    acc.update({"a": {"b": WeightedScalar(4.0, 2.0)}, "c": 4.0})
    result = acc.summaries()
    assert set(result) == {"a", "c"}
    assert set(result["a"]) == {"b"}
    np.testing.assert_allclose(float(result["a"]["b"].mean), 3.0, rtol=1e-7)
    np.testing.assert_allclose(float(result["a"]["b"].weight), 3.0)
    np.testing.assert_allclose(float(result["c"]), 3.0)


def test_zero_total_weight_gives_mean_zero_not_nan():
    acc = _accumulator()
    acc.update({"loss": WeightedScalar(jnp.asarray(0.0), jnp.asarray(0.0))})
    acc.update({"loss": WeightedScalar(jnp.asarray(0.0), jnp.asarray(0.0))})
    assert float(acc.summaries()["loss"].mean) == 0.0


def test_a_zero_weight_batch_does_not_change_the_mean():
    acc = _accumulator()
    acc.update({"loss": WeightedScalar(jnp.asarray(2.0), jnp.asarray(5.0))})
    acc.update({"loss": WeightedScalar(jnp.asarray(100.0), jnp.asarray(0.0))})
    assert float(acc.summaries()["loss"].mean) == 2.0


def test_reset_forgets_everything():
    acc = _accumulator()
    acc.update({"loss": WeightedScalar(1.0, 1.0)})
    acc.reset()
    assert acc.summaries() == {}
    acc.update({"loss": WeightedScalar(3.0, 2.0)})
    assert float(acc.summaries()["loss"].mean) == 3.0


def test_switching_between_weighted_and_plain_is_an_error():
    acc = _accumulator()
    acc.update({"loss": WeightedScalar(1.0, 1.0)})
    with pytest.raises(TypeError, match="'loss'"):
        acc.update({"loss": 1.0})


def test_non_numeric_values_are_an_error_naming_the_summary():
    acc = _accumulator()
    with pytest.raises(TypeError, match="'x/name'"):
        acc.update({"x": {"name": "text"}})


def test_a_weightless_batch_with_nan_mean_is_ignored():
    acc = _accumulator()
    acc.update({"loss": WeightedScalar(jnp.asarray(jnp.nan), jnp.asarray(0.0))})
    acc.update({"loss": WeightedScalar(jnp.asarray(2.0), jnp.asarray(5.0))})
    acc.update({"loss": WeightedScalar(jnp.asarray(jnp.nan), jnp.asarray(0.0))})
    assert float(acc.summaries()["loss"].mean) == 2.0
