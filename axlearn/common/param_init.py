"""Parameter initializers.

A layer declares its parameters as `ParameterSpec`s; a spec either carries its own
initializer (norm scales start at one, biases at zero) or is initialized by the layer's
`param_init`, a `DefaultInitializer` that maps parameter-name regexes to
`WeightInitializer`s. Every initializer describes itself in one line for the `_init`
golden files, in AXLearn's words: `constant(1.0)`, or for a weight scaled by its fans
`normal(0, 1.0 / fan_in), shape=(8, 32), axes=FanAxes(in_axis=-2, out_axis=-1, batch_axis=())`
(the shape as the layer declares it, a list or a tuple).
"""

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any, Optional, Protocol, Union

import jax
import jax.numpy as jnp

from axlearn.common.config import ConfigError, Configurable, config_class

AxisOrAxes = Union[int, tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class FanAxes:
    """Which axes of a weight count as its fan-in, fan-out and batch (e.g. stacked layers)."""

    in_axis: AxisOrAxes = -2
    out_axis: AxisOrAxes = -1
    batch_axis: AxisOrAxes = ()

    def prepend_axis(self) -> "FanAxes":
        """The same axes for a weight with one more leading (batch) dimension."""

        def shift(axes: AxisOrAxes) -> AxisOrAxes:
            if isinstance(axes, int):
                return axes + 1 if axes >= 0 else axes
            return tuple(a + 1 if a >= 0 else a for a in axes)

        batch = (self.batch_axis,) if isinstance(self.batch_axis, int) else self.batch_axis
        return FanAxes(
            in_axis=shift(self.in_axis),
            out_axis=shift(self.out_axis),
            batch_axis=(0,) + tuple(shift(tuple(batch))),
        )

    def fans(self, shape: Sequence[int]) -> dict[str, float]:
        """fan_in, fan_out and fan_avg of a weight of `shape`.

        As `jax.nn.initializers.variance_scaling` counts them: axes named nowhere (a
        convolution's window) multiply both fans; batch axes count in neither.
        """

        def size(axes: AxisOrAxes) -> int:
            axes = (axes,) if isinstance(axes, int) else axes
            return math.prod(shape[a] for a in axes)

        in_size, out_size = size(self.in_axis), size(self.out_axis)
        receptive = math.prod(shape) // (in_size * out_size * size(self.batch_axis))
        fan_in, fan_out = in_size * receptive, out_size * receptive
        return dict(fan_in=fan_in, fan_out=fan_out, fan_avg=(fan_in + fan_out) / 2)


class Initializer(Protocol):
    """Creates one parameter's initial value."""

    def initialize(
        self,
        name: str,
        *,
        prng_key: jax.Array,
        shape: Sequence[int],
        dtype: jnp.dtype,
        axes: Optional[FanAxes],
    ) -> jax.Array: ...

    def debug_string(self, name: str, shape: Sequence[int], axes: Optional[FanAxes]) -> str: ...


@dataclasses.dataclass(frozen=True)
class ConstantInitializer:
    """Every element is `value`."""

    value: float

    def initialize(self, name, *, prng_key, shape, dtype, axes) -> jax.Array:
        del name, prng_key, axes
        return jnp.full(shape, self.value, dtype=dtype)

    def debug_string(self, name, shape, axes) -> str:
        del name, shape, axes
        return f"constant({self.value})"


def constant_initializer(value: float) -> ConstantInitializer:
    return ConstantInitializer(value)


_TRUNCATED_NORMAL_STDDEV = 0.87962566103423978  # Std of a unit normal truncated to [-2, 2].


class WeightInitializer(Configurable):
    """Variance scaling: variance = scale / fan, with fan taken from the weight's FanAxes.

    Without a fan, `scale` is the standard deviation (normal, truncated_normal) or the
    half-width (uniform) itself, as in AXLearn.
    """

    @config_class
    class Config(Configurable.Config):
        """Configures WeightInitializer."""

        distribution: str = "normal"  # normal, truncated_normal or uniform.
        fan: Optional[str] = None  # fan_in, fan_out, fan_avg; None: scale is the std itself.
        scale: float = 1.0

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        if cfg.distribution not in ("normal", "truncated_normal", "uniform"):
            raise ConfigError(
                f"WeightInitializer.distribution: '{cfg.distribution}' is not one of "
                "normal, truncated_normal, uniform"
            )
        if cfg.fan not in (None, "fan_in", "fan_out", "fan_avg"):
            raise ConfigError(f"WeightInitializer.fan: '{cfg.fan}' is not one of fan_in, fan_out, fan_avg")

    def _spread(self, name: str, shape: Sequence[int], axes: Optional[FanAxes]) -> float:
        """The standard deviation (normal, truncated_normal) or half-width (uniform)."""
        cfg = self.config
        if cfg.fan is None:
            return cfg.scale
        if axes is None:
            raise ConfigError(f"Parameter '{name}' has no FanAxes, but its initializer uses {cfg.fan}")
        variance = cfg.scale / axes.fans(shape)[cfg.fan]
        return math.sqrt(3.0 * variance if cfg.distribution == "uniform" else variance)

    def initialize(self, name, *, prng_key, shape, dtype, axes) -> jax.Array:
        cfg = self.config
        spread = self._spread(name, shape, axes)
        if cfg.distribution == "normal":
            values = jax.random.normal(prng_key, shape, jnp.float32) * spread
        elif cfg.distribution == "truncated_normal":
            std = spread / _TRUNCATED_NORMAL_STDDEV
            values = jax.random.truncated_normal(prng_key, -2.0, 2.0, shape, jnp.float32) * std
        else:
            values = jax.random.uniform(prng_key, shape, jnp.float32, -spread, spread)
        return values.astype(dtype)

    def debug_string(self, name, shape, axes) -> str:
        """AXLearn's words for the distribution; with a fan, the shape (list or tuple, as
        declared) and fan axes it was computed from."""
        del name
        cfg = self.config
        scale, fan = cfg.scale, cfg.fan
        if fan is None:
            return {
                "normal": f"normal(0, {scale}^2)",
                "truncated_normal": f"truncated_normal(-2, 2) * {scale} / 0.88",
                "uniform": f"uniform({-scale}, {scale})",
            }[cfg.distribution]
        law = {
            "normal": f"normal(0, {scale} / {fan})",
            "truncated_normal": f"truncated_normal(-2, 2) * sqrt({scale} / {fan}) / 0.88",
            "uniform": f"uniform(-sqrt({3 * scale} / {fan}), sqrt({3 * scale} / {fan}))",
        }[cfg.distribution]
        return f"{law}, shape={shape}, axes={axes}"


class DefaultInitializer(Configurable):
    """Initializes a parameter with the first entry whose regex matches its path."""

    @config_class
    class Config(Configurable.Config):
        """Configures DefaultInitializer."""

        # Regex (searched in the '/'-joined parameter path) -> WeightInitializer config.
        init_by_param_name: dict[str, Any] = {}

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self._rules = [
            (re.compile(pattern), init.instantiate())
            for pattern, init in cfg.init_by_param_name.items()
        ]

    def _find(self, name: str) -> WeightInitializer:
        for pattern, initializer in self._rules:
            if pattern.fullmatch(name):
                return initializer
        raise ConfigError(
            f"No param_init.init_by_param_name rule matches parameter '{name}' "
            f"(rules: {[p.pattern for p, _ in self._rules]})"
        )

    def initialize(self, name, *, prng_key, shape, dtype, axes) -> jax.Array:
        return self._find(name).initialize(
            name, prng_key=prng_key, shape=shape, dtype=dtype, axes=axes
        )

    def debug_string(self, name, shape, axes) -> str:
        return self._find(name).debug_string(name, shape, axes)


def weight_initializer_config(
    distribution: str = "normal", fan: Optional[str] = "fan_in", scale: float = 1.0
) -> WeightInitializer.Config:
    return WeightInitializer.default_config().set(distribution=distribution, fan=fan, scale=scale)


def default_initializer_config(
    regex: str = ".*weight$", **weight_init_kwargs
) -> DefaultInitializer.Config:
    """`DefaultInitializer` with one rule: `regex` -> `weight_initializer_config(...)`."""
    return DefaultInitializer.default_config().set(
        init_by_param_name={regex: weight_initializer_config(**weight_init_kwargs)}
    )
