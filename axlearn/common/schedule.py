"""Learning-rate schedules: functions of the step.

Every public function here takes the schedule's hyper-parameters and returns a
`Schedule`, a callable `step -> value` that works on Python ints and on (traced) jax
integer scalars alike. Each can be written in a config with `config_for_function`, e.g.
`config_for_function(cosine_with_linear_warmup).set(peak_lr=1.0, max_step=1000,
warmup_steps=10)`; `as_schedule_fn` turns such a config, a callable or a plain number into
a schedule.

A schedule that AXLearn's `axlearn.common.schedule` also has takes AXLearn's arguments
and gives AXLearn's value at each step, with these deliberate exceptions: `inverse_sqrt`
is a schedule with a warmup here (AXLearn's is the bare `max(step, warmup) ** -0.5`),
and the warmup schedules start at `begin_value` at step 0 (AXLearn's segment-based ones
give 0 there, a step its learner never calls). Conventions:
- `step` counts updates already applied, so the first update uses `schedule(0)`
  (`segment_wise` keeps AXLearn's segments counted from step 1; see there).
- The warmup/decay schedules are continuous: a phase's last step reaches its end value
  exactly, and past their last step they hold their final value.
- Invalid hyper-parameters raise ConfigError (a ValueError, as AXLearn raises) when the
  schedule is built, not when it is called.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import jax.numpy as jnp

from axlearn.common.config import ConfigError, InstantiableConfig, register_configurable

Tensor = Any  # A jax or numpy scalar array.
Schedule = Callable[[Union[int, Tensor]], Tensor]
# A number (a constant schedule), a schedule, or a config that instantiates to one.
ScheduleLike = Union[float, Schedule, InstantiableConfig]


def as_schedule_fn(value: ScheduleLike) -> Schedule:
    """Turns a number, a schedule or a schedule config into a schedule."""
    if isinstance(value, InstantiableConfig):
        value = value.instantiate()
    if callable(value):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return constant_schedule(float(value))
    raise ConfigError(
        f"Expected a number, a schedule (step -> value) or a config of one; got {value!r}"
    )


def _as_float_step(step: Union[int, Tensor]) -> Tensor:
    return jnp.asarray(step, dtype=jnp.float32)


@register_configurable
def constant_schedule(value: float) -> Schedule:
    """`value` at every step."""

    def fn(step):
        return jnp.full(jnp.shape(step), value, dtype=jnp.float32)

    return fn


@register_configurable
def polynomial(
    *,
    begin_step: int = 0,
    begin_value: float = 0.0,
    end_step: int = 1,
    end_value: float = 0.0,
    power: float = 1.0,
) -> Schedule:
    """From `begin_value` at `begin_step` to `end_value` at `end_step` along
    `begin + fraction ** power * (end - begin)`; constant outside that range."""
    if end_step <= begin_step:
        raise ConfigError(
            f"polynomial: end_step ({end_step}) must exceed begin_step ({begin_step})"
        )

    def fn(step):
        fraction = jnp.clip((_as_float_step(step) - begin_step) / (end_step - begin_step), 0, 1)
        return begin_value + fraction**power * (end_value - begin_value)

    return fn


@register_configurable
def exponential(
    *,
    begin_step: int = 0,
    begin_value: float,
    end_step: int = 1,
    end_value: float,
) -> Schedule:
    """From `begin_value` at `begin_step` to `end_value` at `end_step` geometrically (a
    straight line in log space); constant outside that range. Both values must be
    positive."""
    if begin_value <= 0 or end_value <= 0:
        raise ConfigError(
            f"exponential: begin_value ({begin_value}) and end_value ({end_value}) must both "
            "be positive"
        )
    log_fn = polynomial(
        begin_step=begin_step,
        begin_value=math.log(begin_value),
        end_step=end_step,
        end_value=math.log(end_value),
    )

    def fn(step):
        return jnp.exp(log_fn(step))

    return fn


@register_configurable
def linear(*, begin_step: int = 0, begin_value: float, end_step: int, end_value: float) -> Schedule:
    """A straight line from (begin_step, begin_value) to (end_step, end_value)."""
    return polynomial(
        begin_step=begin_step,
        begin_value=begin_value,
        end_step=end_step,
        end_value=end_value,
        power=1.0,
    )


def _linear_warmup(step: Tensor, begin_value: float, peak: float, warmup_steps: int) -> Tensor:
    if warmup_steps <= 0:
        return jnp.full(jnp.shape(step), peak, dtype=jnp.float32)
    fraction = jnp.clip(step / warmup_steps, 0, 1)
    return begin_value + (peak - begin_value) * fraction


_DECAY_TYPES = ("linear", "cosine")


def _check_decay_type(decay_type: str) -> None:
    if decay_type not in _DECAY_TYPES:
        raise ConfigError(f"decay_type must be one of {_DECAY_TYPES}, got {decay_type!r}")


def _decay(fraction: Tensor, *, begin: float, end: float, decay_type: str) -> Tensor:
    """From `begin` at fraction 0 to `end` at fraction 1."""
    fraction = jnp.clip(fraction, 0, 1)
    if decay_type == "linear":
        return begin + (end - begin) * fraction
    return end + (begin - end) * 0.5 * (1 + jnp.cos(math.pi * fraction))  # Cosine.


@register_configurable
def cosine_with_linear_warmup(
    peak_lr: float,
    *,
    max_step: int,
    warmup_steps: int = 500,
    begin_value: float = 0.0,
    alpha: float = 0.0,
    decay_begin_step: Optional[int] = None,
) -> Schedule:
    """Linear warmup from `begin_value` at step 0 to `peak_lr` at `warmup_steps`, `peak_lr`
    until `decay_begin_step` (if it is past the warmup), then a cosine decay to
    `alpha * peak_lr` at `max_step`, held from then on."""
    decay_begin = warmup_steps
    # As in AXLearn, a decay_begin_step within the warmup is ignored.
    if decay_begin_step is not None and decay_begin_step > warmup_steps:
        decay_begin = decay_begin_step
    if not 0 <= warmup_steps <= decay_begin < max_step:
        raise ConfigError(
            f"cosine_with_linear_warmup: need 0 <= warmup_steps ({warmup_steps}) <= "
            f"decay_begin_step ({decay_begin}) < max_step ({max_step})"
        )

    def fn(step):
        step = _as_float_step(step)
        warm = _linear_warmup(step, begin_value, peak_lr, warmup_steps)
        decayed = _decay(
            (step - decay_begin) / (max_step - decay_begin),
            begin=peak_lr,
            end=alpha * peak_lr,
            decay_type="cosine",
        )
        return jnp.where(step < warmup_steps, warm, decayed)

    return fn


def _steps(value: Union[int, float], total: int, name: str) -> int:
    """A length given in steps (an int) or as a fraction of `total` (a float in [0, 1])."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number of steps or a fraction, got {value!r}")
    if isinstance(value, float):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{name}={value} as a fraction must lie in [0, 1]")
        return int(round(value * total))
    if value < 0:
        raise ConfigError(f"{name}={value} must be non-negative")
    return value


@register_configurable
def warmup_stable_decay(
    peak_lr: float,
    *,
    max_step: int,
    warmup_steps: Union[int, float],
    decay_steps: Optional[Union[int, float]] = None,
    begin_value: float = 0.0,
    end_value: float = 0.0,
    decay_type: str = "linear",
    decay_begin_step: Optional[int] = None,
) -> Schedule:
    """Warmup-stable-decay (WSD): linear warmup to `peak_lr`, a stable phase at `peak_lr`,
    then a `decay_type` ('linear' or 'cosine') decay that reaches `end_value` at `max_step`.

    `warmup_steps` and `decay_steps` are step counts (ints) or fractions of `max_step`
    (floats); the stable phase is whatever remains. The decay's start is given either by
    `decay_steps` or, as in `cosine_with_linear_warmup`, by `decay_begin_step` (the decay
    then spans `max_step - decay_begin_step` steps); set exactly one of them.
    """
    if (decay_steps is None) == (decay_begin_step is None):
        raise ConfigError(
            "warmup_stable_decay: set exactly one of decay_steps and decay_begin_step, got "
            f"decay_steps={decay_steps!r}, decay_begin_step={decay_begin_step!r}"
        )
    warmup = _steps(warmup_steps, max_step, "warmup_steps")
    if decay_begin_step is not None:
        decay = max_step - _steps(decay_begin_step, max_step, "decay_begin_step")
        if decay < 0:
            raise ConfigError(
                f"warmup_stable_decay: decay_begin_step ({decay_begin_step}) exceeds "
                f"max_step ({max_step})"
            )
    else:
        decay = _steps(decay_steps, max_step, "decay_steps")
    if warmup + decay > max_step:
        raise ConfigError(
            f"warmup_stable_decay: warmup ({warmup}) + decay ({decay}) steps exceed "
            f"max_step ({max_step})"
        )
    _check_decay_type(decay_type)
    decay_begin = max_step - decay

    def fn(step):
        step = _as_float_step(step)
        warm = _linear_warmup(step, begin_value, peak_lr, warmup)
        if decay > 0:
            fraction = (step - decay_begin) / decay
            decayed = _decay(fraction, begin=peak_lr, end=end_value, decay_type=decay_type)
        else:
            decayed = jnp.where(step < max_step, peak_lr, end_value)
        return jnp.where(step < warmup, warm, jnp.where(step < decay_begin, peak_lr, decayed))

    return fn


@register_configurable
def cyclic_warmup_stable_decay(
    peak_lr: float,
    *,
    cycle_ends: Sequence[int],
    warmup_steps: Union[int, float],
    decay_steps: Union[int, float],
    begin_value: float = 0.0,
    end_value: float = 0.0,
    decay_type: str = "linear",
) -> Schedule:
    """Cyclic WSD (WSD-S): one warmup, then cycles that each stay at `peak_lr` and decay to
    `end_value` at their end step; the next cycle resumes at `peak_lr` without re-warmup.

    Cycle i spans (cycle_ends[i-1], cycle_ends[i]] (the first starts at step 0), so a
    checkpoint taken at each cycle end is a fully decayed model. `warmup_steps` is in steps
    or a fraction of the first cycle; `decay_steps` is in steps or a fraction of each
    cycle's length. Past the last cycle end the schedule holds `end_value`.
    """
    ends = list(cycle_ends)
    if not ends or any(b <= a for a, b in zip([0] + ends, ends)):
        raise ConfigError(f"cycle_ends must be positive and strictly increasing, got {ends}")
    warmup = _steps(warmup_steps, ends[0], "warmup_steps")
    starts = [0] + ends[:-1]
    decays = [_steps(decay_steps, end - start, "decay_steps") for start, end in zip(starts, ends)]
    for i, (start, end, decay) in enumerate(zip(starts, ends, decays)):
        if decay > end - start or (i == 0 and warmup + decay > end):
            raise ConfigError(
                f"cyclic_warmup_stable_decay: cycle {i} ({start}, {end}] is too short for "
                f"{decay} decay steps" + (f" after {warmup} warmup steps" if i == 0 else "")
            )
    _check_decay_type(decay_type)

    def fn(step):
        step = _as_float_step(step)
        value = jnp.full(jnp.shape(step), end_value, dtype=jnp.float32)  # Past the last end.
        for i, (start, end, decay) in enumerate(zip(starts, ends, decays)):
            decay_begin = end - decay
            if decay > 0:
                fraction = (step - decay_begin) / decay
                decayed = _decay(fraction, begin=peak_lr, end=end_value, decay_type=decay_type)
            else:
                decayed = jnp.where(step < end, peak_lr, end_value)
            in_cycle = (step <= end) if i == 0 else (step > start) & (step <= end)
            value = jnp.where(in_cycle, jnp.where(step < decay_begin, peak_lr, decayed), value)
        warm = _linear_warmup(step, begin_value, peak_lr, warmup)
        return jnp.where(step < warmup, warm, value)

    return fn


@register_configurable
def inverse_sqrt(
    peak_lr: float,
    *,
    warmup_steps: int,
    begin_value: float = 0.0,
    timescale: Optional[int] = None,
) -> Schedule:
    """Linear warmup to `peak_lr`, then `peak_lr * sqrt(timescale / (timescale + steps
    after warmup))`. `timescale` defaults to `warmup_steps`, which gives the classic
    `peak_lr * sqrt(warmup_steps / step)`."""
    timescale = warmup_steps if timescale is None else timescale
    if timescale <= 0:
        raise ConfigError(
            f"inverse_sqrt: timescale must be positive (set it when warmup_steps={warmup_steps})"
        )

    def fn(step):
        step = _as_float_step(step)
        warm = _linear_warmup(step, begin_value, peak_lr, warmup_steps)
        after = jnp.maximum(step - warmup_steps, 0.0)
        decayed = peak_lr * jnp.sqrt(timescale / (timescale + after))
        return jnp.where(step < warmup_steps, warm, decayed)

    return fn


@register_configurable
def adafactor_decay_rate(c: float = 0.8, step_offset: int = 0) -> Schedule:
    """Adafactor's second-moment decay `1 - (t + 1) ** -c` (Shazeer & Stern, 2018), where
    t counts updates already applied, so the first update (t=0) uses decay 0."""

    def fn(step):
        t = jnp.maximum(_as_float_step(step) - step_offset, 0.0) + 1.0
        return 1.0 - t ** (-c)

    return fn


@register_configurable
def adafactor(
    scale: float = 1.0,
    *,
    warmup_steps: int = 10_000,
    decay_power: float = -0.5,
    step_offset: int = 0,
) -> Schedule:
    """The Transformer's schedule (Vaswani et al., 2017, eq. 3), as used with Adafactor:
    `scale * min(t * warmup_steps ** (decay_power - 1), t ** decay_power)` with
    `t = step + step_offset`, i.e. a linear rise to `scale * warmup_steps ** decay_power` at
    `warmup_steps`, then a `t ** decay_power` decay. `step_offset=1` matches Lingvo."""
    if warmup_steps <= 0:
        raise ConfigError(f"adafactor: warmup_steps ({warmup_steps}) must be positive")

    def fn(step):
        t = _as_float_step(step) + step_offset
        # t ** decay_power is inf at t=0; the minimum then picks the warmup branch (0).
        return scale * jnp.minimum(t * warmup_steps ** (decay_power - 1.0), t**decay_power)

    return fn


@register_configurable
def decay_bias_correction(decay: float) -> Schedule:
    """Bias-corrected EMA decay (Shazeer & Stern, 2018, section 7.1):
    `decay * (1 - decay ** t) / (1 - decay ** (t + 1))` at step t.

    With it, `ema = ema * d_t + x_t * (1 - d_t)` from ema = 0 is the decay-weighted mean
    of the values so far: step 0 (the first update here) gives d_0 = 0, so the EMA starts
    at x_0 instead of at 0. AXLearn counts the first update as step 1 and writes the same
    rule with `t - 1` and `t`; the values per update are the same.
    """
    if not 0.0 < decay < 1.0:
        raise ConfigError(f"decay_bias_correction: decay ({decay}) must lie in (0, 1)")

    def fn(step):
        t = _as_float_step(step)
        return decay * (1.0 - decay**t) / (1.0 - decay ** (t + 1.0))

    return fn


def _check_start_steps(name: str, steps: Sequence[int]) -> None:
    if any(step < 0 for step in steps) or any(b < a for a, b in zip(steps, steps[1:])):
        raise ConfigError(f"{name} must be non-negative and non-decreasing, got {list(steps)}")


@register_configurable
def stepwise(sub: Sequence[ScheduleLike], start_step: Sequence[int]) -> Schedule:
    """Schedules in sequence: `sub[0]` from step 0, `sub[i]` from `start_step[i-1]` on,
    each called with the steps since its own start (so it does not depend on the others).

    `start_step` has one entry fewer than `sub` and must be non-decreasing (AXLearn
    documents that; here it is checked).
    """
    if len(sub) != len(start_step) + 1:
        raise ConfigError(
            f"stepwise: {len(sub)} sub-schedules need {len(sub) - 1} start steps, got "
            f"{len(start_step)}"
        )
    _check_start_steps("stepwise: start_step", start_step)
    fns = [as_schedule_fn(s) for s in sub]
    starts = [0] + list(start_step)

    def fn(step):
        step = jnp.asarray(step)
        value = jnp.asarray(fns[0](step), dtype=jnp.float32)
        for start, sub_fn in zip(starts[1:], fns[1:]):
            value = jnp.where(step >= start, sub_fn(jnp.maximum(step - start, 0)), value)
        return value

    return fn


@register_configurable
def segment_wise(segments: Sequence[ScheduleLike], *, segment_steps: Sequence[int]) -> Schedule:
    """AXLearn's segment-wise schedule, whose steps count from 1: segment k serves steps
    `sum(segment_steps[:k]) + 1 .. sum(segment_steps[:k+1])` (the last one every step
    after) and is called with `step - sum(segment_steps[:k])`, i.e. from 1; steps <= 0
    give 0.

    Kept as AXLearn defines it, so that ported schedules give the same values at the
    same step. This library calls schedules from step 0 (see the module docstring); for
    sub-schedules that count from 0 use `stepwise`.
    """
    if len(segments) != len(segment_steps) + 1:
        raise ConfigError(
            f"segment_wise: {len(segments)} segments need {len(segments) - 1} segment_steps, "
            f"got {len(segment_steps)}"
        )
    if any(n < 0 for n in segment_steps):
        raise ConfigError(f"segment_wise: segment_steps must be >= 0, got {list(segment_steps)}")
    fns = [as_schedule_fn(s) for s in segments]
    offsets = [0]
    for n in segment_steps:
        offsets.append(offsets[-1] + n)

    def fn(step):
        step = jnp.asarray(step)
        value = jnp.zeros(jnp.shape(step), dtype=jnp.float32)
        # Later segments win where they start, so walk them last to first.
        for k in reversed(range(len(fns))):
            in_segment = step >= offsets[k] + 1
            if k + 1 < len(offsets):
                in_segment = in_segment & (step <= offsets[k + 1])
            seg_value = fns[k](jnp.maximum(step - offsets[k], 1))
            value = jnp.where(in_segment, seg_value, value)
        return value

    return fn


@register_configurable
def constant_with_linear_warmup(
    peak_lr: float, *, warmup_steps: int = 500, begin_value: float = 0.0
) -> Schedule:
    """Linear warmup from `begin_value` at step 0 to `peak_lr` at `warmup_steps`, then
    `peak_lr`. `warmup_steps=0` means no warmup (AXLearn raises there)."""
    if warmup_steps < 0:
        raise ConfigError(f"constant_with_linear_warmup: warmup_steps ({warmup_steps}) < 0")

    def fn(step):
        return _linear_warmup(_as_float_step(step), begin_value, peak_lr, warmup_steps)

    return fn


@register_configurable
def linear_schedule_with_warmup(
    peak_lr: float,
    *,
    max_step: int,
    warmup_steps: int,
    begin_value: float = 0.0,
    end_value: float = 0.0,
) -> Schedule:
    """Linear warmup from `begin_value` at step 0 to `peak_lr` at `warmup_steps`, then a
    straight line to `end_value` at `max_step`, held from then on."""
    if not 0 <= warmup_steps < max_step:
        raise ConfigError(
            f"linear_schedule_with_warmup: need 0 <= warmup_steps ({warmup_steps}) < "
            f"max_step ({max_step})"
        )

    def fn(step):
        step = _as_float_step(step)
        warm = _linear_warmup(step, begin_value, peak_lr, warmup_steps)
        decayed = _decay(
            (step - warmup_steps) / (max_step - warmup_steps),
            begin=peak_lr,
            end=end_value,
            decay_type="linear",
        )
        return jnp.where(step < warmup_steps, warm, decayed)

    return fn


@register_configurable
def ema_schedule(decay: float = 0.9999, *, warmup_steps: int = 1) -> Schedule:
    """An EMA decay of `step / (step + 1)` (0, 1/2, 2/3, ...: the running mean) before
    `warmup_steps`, then `decay`."""
    if warmup_steps <= 0:
        raise ConfigError(f"ema_schedule: warmup_steps ({warmup_steps}) must be positive")

    def fn(step):
        step = _as_float_step(step)
        return jnp.where(step < warmup_steps, step / (1.0 + step), decay)

    return fn
