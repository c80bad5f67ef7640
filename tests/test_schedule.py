"""Learning-rate schedules: values at phase boundaries, against closed-form references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import schedule
from axlearn.common.config import ConfigError, config_for_function


def values(fn, steps):
    return [float(fn(s)) for s in steps]


def test_constant_schedule_is_constant():
    fn = schedule.constant_schedule(0.3)
    np.testing.assert_allclose(values(fn, [0, 1, 10**6]), [0.3] * 3, rtol=1e-7)


def test_polynomial_hits_both_ends_and_holds_outside():
    fn = schedule.polynomial(begin_step=10, begin_value=1.0, end_step=20, end_value=0.1, power=2.0)
    got = values(fn, [0, 10, 15, 20, 30])
    # AXLearn's form: begin + fraction ** power * (end - begin).
    expected = [1.0, 1.0, 1.0 - 0.9 * 0.5**2, 0.1, 0.1]
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_linear_is_a_straight_line():
    fn = schedule.linear(begin_value=0.0, end_step=4, end_value=2.0)
    np.testing.assert_allclose(values(fn, [0, 1, 2, 4, 5]), [0, 0.5, 1.0, 2.0, 2.0], rtol=1e-6)


def test_cosine_with_linear_warmup_boundaries():
    peak, warmup, max_step, alpha, begin = 2.0, 100, 1100, 0.1, 0.2
    fn = schedule.cosine_with_linear_warmup(
        peak, max_step=max_step, warmup_steps=warmup, begin_value=begin, alpha=alpha
    )
    mid = warmup + (max_step - warmup) // 2
    got = values(fn, [0, warmup // 2, warmup, mid, max_step, max_step + 500])
    cos_mid = alpha * peak + (peak - alpha * peak) * 0.5 * (1 + math.cos(math.pi * 0.5))
    expected = [begin, (begin + peak) / 2, peak, cos_mid, alpha * peak, alpha * peak]
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_cosine_with_linear_warmup_from_config_like_the_spec():
    cfg = config_for_function(schedule.cosine_with_linear_warmup).set(
        peak_lr=1.0, max_step=750000, warmup_steps=5000, begin_value=0.0, alpha=0.005
    )
    fn = schedule.as_schedule_fn(cfg)
    np.testing.assert_allclose(values(fn, [0, 2500, 5000, 750000]), [0, 0.5, 1, 0.005], rtol=1e-5)


def test_warmup_stable_decay_derives_the_stable_phase_from_fractions():
    # 10% warmup, 20% decay of 1000 steps: stable from 100 to 800.
    fn = schedule.warmup_stable_decay(
        1.0, max_step=1000, warmup_steps=0.1, decay_steps=0.2, end_value=0.0
    )
    got = values(fn, [0, 50, 100, 500, 800, 900, 1000, 1200])
    np.testing.assert_allclose(got, [0, 0.5, 1, 1, 1, 0.5, 0, 0], atol=1e-6)


def test_warmup_stable_decay_with_cosine_decay_in_steps():
    fn = schedule.warmup_stable_decay(
        2.0, max_step=100, warmup_steps=10, decay_steps=40, end_value=0.5, decay_type="cosine"
    )
    quarter = 0.5 + 1.5 * 0.5 * (1 + math.cos(math.pi * 0.25))
    got = values(fn, [10, 60, 70, 100, 101])
    np.testing.assert_allclose(got, [2.0, 2.0, quarter, 0.5, 0.5], rtol=1e-6)


def test_warmup_stable_decay_rejects_phases_longer_than_training():
    with pytest.raises(ConfigError, match="exceed max_step"):
        schedule.warmup_stable_decay(1.0, max_step=100, warmup_steps=60, decay_steps=50)


def test_cyclic_wsd_decays_at_every_cycle_end_and_resumes_at_peak():
    fn = schedule.cyclic_warmup_stable_decay(
        1.0, cycle_ends=[100, 200, 400], warmup_steps=10, decay_steps=0.5, end_value=0.0
    )
    # Cycle 0: warmup to 10, stable to 50, decay to 0 at 100. Cycle 1: (100, 200], decay
    # from 150. Cycle 2: (200, 400], decay from 300.
    steps = [0, 5, 10, 50, 75, 100, 101, 150, 175, 200, 201, 300, 350, 400, 500]
    expected = [0, 0.5, 1, 1, 0.5, 0, 1, 1, 0.5, 0, 1, 1, 0.5, 0, 0]
    np.testing.assert_allclose(values(fn, steps), expected, atol=1e-6)


def test_cyclic_wsd_rejects_unsorted_cycle_ends():
    with pytest.raises(ConfigError, match="strictly increasing"):
        schedule.cyclic_warmup_stable_decay(
            1.0, cycle_ends=[100, 50], warmup_steps=1, decay_steps=1
        )


def test_inverse_sqrt_with_warmup_warms_up_then_decays_as_one_over_sqrt_step():
    fn = schedule.inverse_sqrt_with_warmup(1.0, warmup_steps=100)
    got = values(fn, [0, 50, 100, 400, 10000])
    np.testing.assert_allclose(got, [0, 0.5, 1.0, 0.5, 0.1], rtol=1e-6)


@pytest.mark.parametrize(
    "fn",
    [
        schedule.warmup_stable_decay(
            1.0, max_step=1000, warmup_steps=100, decay_steps=200, decay_type="cosine"
        ),
        schedule.stepwise([0.1, schedule.adafactor(warmup_steps=10)], start_step=[100]),
        schedule.segment_wise(
            [0.1, schedule.ema_schedule(0.9, warmup_steps=5)], segment_steps=[99]
        ),
    ],
)
def test_schedules_run_under_jit_with_traced_steps(fn):
    steps = jnp.array([0, 50, 100, 799, 800, 900, 1000, 1001])
    np.testing.assert_allclose(jax.jit(fn)(steps), values(fn, list(np.asarray(steps))), rtol=1e-6)


def test_as_schedule_fn_accepts_numbers_callables_and_configs():
    assert float(schedule.as_schedule_fn(3)(7)) == 3.0
    assert float(schedule.as_schedule_fn(lambda step: step * 2.0)(4)) == 8.0
    cfg = config_for_function(schedule.constant_schedule).set(value=0.5)
    assert float(schedule.as_schedule_fn(cfg)(9)) == 0.5
    with pytest.raises(ConfigError, match="Expected a number"):
        schedule.as_schedule_fn("fast")


STEPS = np.arange(0, 3001, 7)


def test_polynomial_matches_numpy_at_many_steps():
    fn = schedule.polynomial(begin_step=100, begin_value=2.0, end_step=2500, end_value=0.5, power=3)
    frac = np.clip((STEPS - 100) / 2400, 0, 1)
    np.testing.assert_allclose(fn(jnp.asarray(STEPS)), 2.0 + frac**3 * (0.5 - 2.0), rtol=1e-5)


def test_exponential_is_geometric_between_its_ends():
    fn = schedule.exponential(begin_step=200, begin_value=1e-2, end_step=2200, end_value=1e-5)
    frac = np.clip((STEPS - 200) / 2000, 0, 1)
    expected = 1e-2 * (1e-5 / 1e-2) ** frac
    np.testing.assert_allclose(fn(jnp.asarray(STEPS)), expected, rtol=1e-4)


def test_exponential_rejects_non_positive_values():
    with pytest.raises(ConfigError, match="must both be positive"):
        schedule.exponential(begin_value=0.0, end_value=1.0)


@pytest.mark.parametrize("step_offset", [0, 1])
def test_adafactor_is_the_transformer_schedule(step_offset):
    scale, warmup, power = 2.0, 500, -0.5
    fn = schedule.adafactor(scale, warmup_steps=warmup, decay_power=power, step_offset=step_offset)
    t = (STEPS + step_offset).astype(np.float64)
    with np.errstate(divide="ignore"):
        expected = scale * np.minimum(t * warmup ** (power - 1), t**power)
    np.testing.assert_allclose(fn(jnp.asarray(STEPS)), expected, rtol=1e-5)
    # The peak, at warmup_steps, is scale * warmup_steps ** decay_power.
    np.testing.assert_allclose(float(fn(warmup - step_offset)), scale * warmup**power, rtol=1e-6)


def test_adafactor_from_config_in_golden_text_form():
    cfg = config_for_function(schedule.adafactor).set(scale=1.0, warmup_steps=10000)
    fn = schedule.as_schedule_fn(cfg)
    np.testing.assert_allclose(values(fn, [0, 10000, 40000]), [0, 0.01, 0.005], rtol=1e-5)


def _np_linear_warmup(steps, begin, peak, warmup):
    return begin + (peak - begin) * np.clip(steps / warmup, 0, 1)


@pytest.mark.parametrize("decay_begin_step", [None, 50, 400])
def test_cosine_with_linear_warmup_holds_the_peak_until_decay_begin_step(decay_begin_step):
    peak, warmup, max_step, alpha, begin = 3.0, 100, 2500, 0.1, 0.3
    fn = schedule.cosine_with_linear_warmup(
        peak,
        max_step=max_step,
        warmup_steps=warmup,
        begin_value=begin,
        alpha=alpha,
        decay_begin_step=decay_begin_step,
    )
    # AXLearn's rule: a decay_begin_step within the warmup is ignored.
    start = warmup if decay_begin_step is None or decay_begin_step <= warmup else decay_begin_step
    t = np.clip((STEPS - start) / (max_step - start), 0, 1)
    cosine = peak * ((1 - alpha) * 0.5 * (1 + np.cos(np.pi * t)) + alpha)
    expected = np.where(STEPS < warmup, _np_linear_warmup(STEPS, begin, peak, warmup), cosine)
    np.testing.assert_allclose(fn(jnp.asarray(STEPS)), expected, rtol=1e-5, atol=1e-6)


def test_warmup_stable_decay_takes_decay_begin_step_instead_of_decay_steps():
    by_begin = schedule.warmup_stable_decay(
        1.0, max_step=2000, warmup_steps=100, decay_begin_step=1500, decay_type="cosine"
    )
    t = np.clip((STEPS - 1500) / 500, 0, 1)
    decayed = 0.5 * (1 + np.cos(np.pi * t))
    expected = np.where(
        STEPS < 100, _np_linear_warmup(STEPS, 0.0, 1.0, 100), np.where(STEPS < 1500, 1.0, decayed)
    )
    np.testing.assert_allclose(by_begin(jnp.asarray(STEPS)), expected, rtol=1e-5, atol=1e-6)


def test_warmup_stable_decay_wants_exactly_one_decay_start():
    with pytest.raises(ConfigError, match="exactly one of decay_steps and decay_begin_step"):
        schedule.warmup_stable_decay(
            1.0, max_step=100, warmup_steps=10, decay_steps=20, decay_begin_step=80
        )
    with pytest.raises(ConfigError, match="exactly one"):
        schedule.warmup_stable_decay(1.0, max_step=100, warmup_steps=10)


def test_decay_bias_correction_makes_the_ema_a_weighted_mean():
    decay = 0.9
    fn = schedule.decay_bias_correction(decay)
    steps = STEPS[STEPS >= 1]  # Step 0 (0 / 0) is no update's.
    t = steps.astype(np.float64)
    expected = decay * (1 - decay ** (t - 1)) / (1 - decay**t)
    np.testing.assert_allclose(fn(jnp.asarray(steps)), expected, rtol=1e-5, atol=1e-7)
    # An EMA driven by it from step 1 equals the decay-weighted mean of the values so far.
    rng = np.random.default_rng(0)
    xs = rng.normal(size=20)
    ema = 0.0
    for step, x in enumerate(xs, start=1):
        d = float(fn(step))
        ema = ema * d + x * (1 - d)
    weights = decay ** np.arange(len(xs))[::-1]
    np.testing.assert_allclose(ema, np.sum(weights * xs) / np.sum(weights), rtol=1e-5)


def test_stepwise_calls_each_sub_schedule_with_its_own_steps():
    sub = [
        config_for_function(schedule.polynomial).set(begin_value=0.0, end_step=100, end_value=1.0),
        0.5,
        config_for_function(schedule.polynomial).set(begin_value=0.5, end_step=1000, end_value=0.0),
    ]
    fn = schedule.stepwise(sub, start_step=[100, 700])
    rel = STEPS - 700
    expected = np.where(
        STEPS < 100,
        np.clip(STEPS / 100, 0, 1),
        np.where(STEPS < 700, 0.5, 0.5 - 0.5 * np.clip(rel / 1000, 0, 1)),
    )
    np.testing.assert_allclose(fn(jnp.asarray(STEPS)), expected, rtol=1e-5, atol=1e-6)


def test_stepwise_rejects_mismatched_lengths_and_unsorted_starts():
    with pytest.raises(ConfigError, match="need 1 start steps"):
        schedule.stepwise([1.0, 2.0], start_step=[])
    with pytest.raises(ConfigError, match="non-decreasing"):
        schedule.stepwise([1.0, 2.0, 3.0], start_step=[10, 5])


def test_segment_wise_counts_each_segment_from_one():
    fn = schedule.segment_wise(
        [lambda s: 1000.0 + s, lambda s: 2000.0 + s, lambda s: 3000.0 + s],
        segment_steps=[10, 5],
    )
    steps = np.arange(-2, 40)
    got = fn(jnp.asarray(steps))
    # AXLearn: 0 for step <= 0; segment k serves (offset_k, offset_k+1] with step - offset_k.
    expected = np.select(
        [steps <= 0, steps <= 10, steps <= 15],
        [0.0, 1000.0 + steps, 2000.0 + steps - 10],
        3000.0 + steps - 15,
    )
    np.testing.assert_allclose(got, expected)


def test_constant_with_linear_warmup_matches_numpy():
    fn = schedule.constant_with_linear_warmup(2.0, warmup_steps=300, begin_value=0.2)
    np.testing.assert_allclose(
        fn(jnp.asarray(STEPS)), _np_linear_warmup(STEPS, 0.2, 2.0, 300), rtol=1e-5
    )


def test_linear_schedule_with_warmup_matches_numpy():
    fn = schedule.linear_schedule_with_warmup(
        1.5, max_step=2000, warmup_steps=200, begin_value=0.1, end_value=0.05
    )
    down = 1.5 + (0.05 - 1.5) * np.clip((STEPS - 200) / 1800, 0, 1)
    expected = np.where(STEPS < 200, _np_linear_warmup(STEPS, 0.1, 1.5, 200), down)
    np.testing.assert_allclose(fn(jnp.asarray(STEPS)), expected, rtol=1e-5)


def test_ema_schedule_is_the_running_mean_then_constant():
    fn = schedule.ema_schedule(0.999, warmup_steps=50)
    t = STEPS.astype(np.float64)
    expected = np.where(t < 50, t / (t + 1), 0.999)
    np.testing.assert_allclose(fn(jnp.asarray(STEPS)), expected, rtol=1e-6)


def test_new_schedules_are_golden_text_and_override_ready():
    from axlearn.common.config import apply_overrides
    from axlearn.common.golden_text import parse_flat_text

    cfg = config_for_function(schedule.linear_schedule_with_warmup).set(
        peak_lr=1.0, max_step=100, warmup_steps=10
    )
    text = cfg.debug_string()
    assert "fn: 'axlearn.common.schedule.linear_schedule_with_warmup'" in text
    parsed = parse_flat_text(text)
    assert parsed.debug_string() == text
    apply_overrides(parsed, ["end_value=0.5", "max_step=20"])
    np.testing.assert_allclose(float(parsed.instantiate()(20)), 0.5, rtol=1e-6)


# ----- AXLearn's expectations (its schedule_test.py's cases, checked here independently) --


def test_axlearn_inverse_sqrt_is_one_over_sqrt_step_constant_in_warmup():
    for step in range(1, 11):
        assert float(schedule.inverse_sqrt(step)) == pytest.approx(1 / math.sqrt(step))
    for step in range(1, 15):
        expected = 1 / math.sqrt(max(step, 10))
        assert float(schedule.inverse_sqrt(step, warmup_steps=10)) == pytest.approx(expected)
    with pytest.raises(ValueError, match="> 0"):
        schedule.inverse_sqrt(1, warmup_steps=0)


def test_axlearn_t5_schedule_is_a_linear_warmup_then_inverse_sqrt():
    fn = jax.jit(
        schedule.stepwise(
            start_step=[100],
            sub=[
                schedule.polynomial(end_step=100, end_value=0.1),
                lambda step: schedule.inverse_sqrt(step + 100),
            ],
        )
    )
    for step in range(200):
        expected = step / 100 * 0.1 if step <= 100 else 1 / math.sqrt(step)
        assert float(fn(step)) == pytest.approx(expected, rel=1e-6, abs=1e-7)


def test_axlearn_segment_wise_gives_each_segment_steps_from_one():
    fn = jax.jit(schedule.segment_wise(segment_steps=[100, 100], segments=[0.1, 0.01, 0.001]))
    got = np.asarray(fn(jnp.arange(301)))
    expected = np.select([np.arange(301) < 1, np.arange(301) <= 100, np.arange(301) <= 200],
                         [0.0, 0.1, 0.01], 0.001)
    np.testing.assert_allclose(got, expected, rtol=1e-7)
    with pytest.raises(ValueError):
        schedule.segment_wise(segment_steps=[100, 100], segments=[0.1, 0.01])


def test_axlearn_decay_bias_correction_from_step_1_averages_the_samples():
    decay = 0.999
    fn = schedule.decay_bias_correction(decay)
    samples = [3, 4, 1, 2, 4, 6, 8, 9]
    moment = 0.0
    for i, sample in enumerate(samples):
        d = float(fn(i + 1))  # Steps start from 1.
        moment = (1 - d) * sample + d * moment
        assert moment == pytest.approx(sum(samples[: i + 1]) / (i + 1), abs=0.005)
    assert float(fn(10**6)) == pytest.approx(decay)


def test_axlearn_adafactor_decay_rate_counts_steps_after_the_offset_from_one():
    fn = schedule.adafactor_decay_rate(step_offset=100)
    for step in (1, 100, 101):
        assert float(fn(step)) == pytest.approx(0.0, abs=1e-7)
    assert float(fn(200)) == pytest.approx(1 - 100 ** (-0.8))


def test_axlearn_ema_schedule_warms_up_after_its_offset():
    fn = jax.jit(schedule.ema_schedule(warmup_steps=5, step_offset=3))
    warmup = [0.0, 1 / 2, 2 / 3, 3 / 4, 4 / 5]
    for step in range(10):
        expected = 0.0 if step < 3 else warmup[step - 3] if step < 8 else 0.9999
        assert float(fn(step)) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("warmup_steps,decay_begin_step", [(100, 200), (100, 100), (0, 200)])
def test_axlearn_warmup_stable_decay_with_alpha(warmup_steps, decay_begin_step):
    peak, max_step, alpha = 0.1, 300, 0.1
    fn = jax.jit(
        schedule.warmup_stable_decay(
            peak_lr=peak, max_step=max_step, warmup_steps=warmup_steps, begin_value=0.0,
            decay_begin_step=decay_begin_step, alpha=alpha,
        )
    )
    for step in range(1, max_step + 1, 25):
        if warmup_steps > 0 and step <= warmup_steps:
            expected = peak * step / warmup_steps
        elif step <= decay_begin_step:
            expected = peak
        else:
            fraction = (step - decay_begin_step) / (max_step - decay_begin_step)
            expected = peak + (peak * alpha - peak) * fraction
        assert float(fn(jnp.asarray(step, jnp.int32))) == pytest.approx(expected, abs=1e-6)


def test_axlearn_warmup_stable_decay_refuses_phases_out_of_order():
    with pytest.raises(ValueError):
        schedule.warmup_stable_decay(
            peak_lr=0.1, warmup_steps=200, decay_begin_step=100, max_step=300
        )
    with pytest.raises(ValueError):
        schedule.warmup_stable_decay(
            peak_lr=0.1, warmup_steps=100, decay_begin_step=300, max_step=200
        )


# ----- how optimizers step them -----


def test_an_update_after_c_updates_is_step_c_plus_one():
    fn = schedule.for_update_count(lambda step: step * 10.0)
    assert [float(fn(c)) for c in (0, 1, 5)] == [10.0, 20.0, 60.0]


def test_a_legacy_base_steps_learning_rates_at_the_count_and_decay_rates_as_before():
    lr = schedule.for_update_count(lambda step: step * 10.0)
    b2 = schedule.for_update_count(schedule.adafactor_decay_rate(), learning_rate=False)
    with schedule.update_step_base(schedule.LEGACY_UPDATE_STEP_BASE):
        assert [float(lr(c)) for c in (0, 1, 5)] == [0.0, 10.0, 50.0]
        # The old rule's Adafactor decay at count c: 1 - (c + 1) ** -0.8.
        np.testing.assert_allclose([float(b2(c)) for c in (0, 1, 5)],
                                   [1 - (c + 1) ** -0.8 for c in (0, 1, 5)], rtol=1e-6)
    assert float(lr(1)) == 20.0  # Outside, AXLearn's rule again.
