"""Tests of axlearn.common.param_init: AXLearn's meaning of each initializer setting, and
AXLearn's words for it in the `_init` golden files."""

import jax
import numpy as np
import pytest

from axlearn.common.param_init import FanAxes, WeightInitializer, weight_initializer_config

_AXES = "axes=FanAxes(in_axis=-2, out_axis=-1, batch_axis=())"


@pytest.mark.parametrize(
    "distribution, fan, expected",
    [
        ("normal", "fan_in", f"normal(0, 2.0 / fan_in), shape=(4, 5), {_AXES}"),
        (
            "uniform",
            "fan_avg",
            f"uniform(-sqrt(6.0 / fan_avg), sqrt(6.0 / fan_avg)), shape=(4, 5), {_AXES}",
        ),
        (
            "truncated_normal",
            "fan_out",
            f"truncated_normal(-2, 2) * sqrt(2.0 / fan_out) / 0.88, shape=(4, 5), {_AXES}",
        ),
        ("normal", None, "normal(0, 2.0^2)"),
        ("uniform", None, "uniform(-2.0, 2.0)"),
        ("truncated_normal", None, "truncated_normal(-2, 2) * 2.0 / 0.88"),
    ],
)
def test_weight_initializers_describe_themselves_in_axlearns_words(distribution, fan, expected):
    init = weight_initializer_config(distribution=distribution, fan=fan, scale=2.0).instantiate()
    assert init.debug_string("w", (4, 5), FanAxes()) == expected


def test_a_shape_is_written_as_declared_list_or_tuple():
    init = weight_initializer_config().instantiate()
    assert "shape=[4, 5]," in init.debug_string("w", [4, 5], FanAxes())
    assert "shape=(4, 5)," in init.debug_string("w", (4, 5), FanAxes())


def _draw(distribution: str, fan, scale: float, shape=(128, 256), axes=None) -> np.ndarray:
    init = WeightInitializer.default_config().set(distribution=distribution, fan=fan, scale=scale)
    values = init.instantiate().initialize(
        "w", prng_key=jax.random.PRNGKey(0), shape=shape, dtype=np.float32, axes=axes
    )
    return np.asarray(values)


@pytest.mark.parametrize("distribution", ["normal", "truncated_normal"])
def test_without_a_fan_scale_is_the_standard_deviation(distribution):
    np.testing.assert_allclose(np.std(_draw(distribution, None, 0.5)), 0.5, rtol=0.03)


def test_without_a_fan_uniform_scale_is_the_half_width():
    values = _draw("uniform", None, 0.5)
    assert values.min() >= -0.5 and values.max() <= 0.5
    np.testing.assert_allclose(np.std(values), 0.5 / np.sqrt(3.0), rtol=0.03)


def test_with_a_fan_the_variance_is_scale_over_fan():
    values = _draw("uniform", "fan_in", 2.0, shape=(128, 256), axes=FanAxes())
    np.testing.assert_allclose(np.var(values), 2.0 / 128, rtol=0.03)


def test_axes_named_nowhere_multiply_both_fans_as_in_jax():
    # A convolution's window [3, 5] x in 4 x out 6: fans count the window, as
    # jax.nn.initializers.variance_scaling does; the batch axis counts in neither.
    shape = (2, 3, 5, 4, 6)
    fans = FanAxes(in_axis=-2, out_axis=-1, batch_axis=(0,)).fans(shape)
    assert fans == dict(fan_in=60, fan_out=90, fan_avg=75.0)
