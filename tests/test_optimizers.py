"""Optimizers against optax, torch and NumPy re-derivations of their published update rules."""

import functools
import math
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from axlearn.common import optimizers as opt
from axlearn.common import schedule
from axlearn.common.base_layer import ParameterSpec
from axlearn.common.config import ConfigError, config_for_function
from axlearn.common.golden_text import parse_flat_text
from axlearn.common.learner import Learner
from axlearn.common.param_init import FanAxes

RNG_SEED = 0


def random_tree(rng, shapes, scale=1.0):
    return {k: jnp.asarray(rng.normal(size=s) * scale, jnp.float32) for k, s in shapes.items()}


def to_numpy(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def run_steps(transformation, params, grads_seq, *, specs=None, jit=True):
    """Applies `transformation` for every gradient tree; returns (params, state)."""
    wrapped = (lambda p: opt.with_param_specs(p, specs)) if specs is not None else (lambda p: p)
    state = transformation.init(wrapped(params))

    def step(params, state, grads):
        updates, state = transformation.update(grads, state, wrapped(params))
        return jax.tree.map(lambda p, u: p + u, params, updates), state

    step = jax.jit(step) if jit else step
    for grads in grads_seq:
        params, state = step(params, state, grads)
    return params, state


SHAPES = {"w": (6, 5), "b": (5,), "v": (3, 4, 2)}


def test_adamw_matches_optax_adamw_over_100_random_steps():
    rng = np.random.default_rng(RNG_SEED)
    params = random_tree(rng, SHAPES)
    grads_seq = [random_tree(rng, SHAPES) for _ in range(100)]
    lr = lambda count: 0.01 / jnp.sqrt(1.0 + count)  # noqa: E731
    ours = opt.adamw_optimizer(lr, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1)
    # Ours steps schedules as AXLearn's, at the update count + 1; optax at the count.
    reference = optax.adamw(lambda c: lr(c + 1), b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1)
    ref_params, ref_state = params, reference.init(params)
    got_params, got_state = params, ours.init(params)
    # Each step jitted once: eager, the 100 steps' ops would each dispatch on their own.
    ref_update, our_update = jax.jit(reference.update), jax.jit(ours.update)
    for grads in grads_seq:
        updates, ref_state = ref_update(grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
        updates, got_state = our_update(grads, got_state, got_params)
        got_params = jax.tree.map(lambda p, u: p + u, got_params, updates)
        for name in SHAPES:
            np.testing.assert_allclose(got_params[name], ref_params[name], atol=1e-6, rtol=0)


def test_adamw_reports_its_learning_rate_for_the_next_step():
    ours = opt.adamw_optimizer(lambda step: 0.5 * step)  # The first update is step 1.
    state = ours.init({"w": jnp.zeros(3)})
    assert float(ours.learning_rate_at(state)) == 0.5
    _, state = ours.update({"w": jnp.ones(3)}, state, {"w": jnp.zeros(3)})
    assert float(ours.learning_rate_at(state)) == 1.0


def test_adamw_decoupled_decays_weights_independently_of_the_learning_rate():
    rng = np.random.default_rng(RNG_SEED)
    params = random_tree(rng, {"w": (4, 3)})
    grads_seq = [random_tree(rng, {"w": (4, 3)}) for _ in range(5)]
    sched = lambda t: 1.0 / (1.0 + t)  # noqa: E731
    got, _ = run_steps(
        opt.adamw_decoupled_optimizer(
            1e-3, b1=0.9, b2=0.99, eps=1e-8, update_schedule=sched, weight_decay=0.05
        ),
        params,
        grads_seq,
    )
    p, m, v = to_numpy(params)["w"], 0.0, 0.0
    for t, g in enumerate(to_numpy(grads_seq)):
        g = g["w"]
        m, v = 0.9 * m + 0.1 * g, 0.99 * v + 0.01 * g * g
        adam = (m / (1 - 0.9 ** (t + 1))) / (np.sqrt(v / (1 - 0.99 ** (t + 1))) + 1e-8)
        p = p - sched(t + 1) * (1e-3 * adam + 0.05 * p)  # Update t is step t + 1.
    np.testing.assert_allclose(got["w"], p, atol=1e-6)


# ----- optax transformations -----


def warmup_cosine():
    return config_for_function(schedule.cosine_with_linear_warmup).set(
        peak_lr=0.01, max_step=20, warmup_steps=4, begin_value=0.001, alpha=0.1
    )


def clip_then_adam():
    return [
        config_for_function(optax.clip_by_global_norm).set(max_norm=1.0),
        config_for_function(optax.adam).set(learning_rate=warmup_cosine()),
    ]


# Each case: optax_optimizer's transformation (configs), and the same transformation built
# by optax directly from a learning-rate schedule, the reference.
OPTAX_CASES = {
    "adamw": (
        lambda: config_for_function(optax.adamw).set(
            learning_rate=warmup_cosine(), b1=0.8, b2=0.95, weight_decay=0.1
        ),
        lambda lr: optax.adamw(lr, b1=0.8, b2=0.95, weight_decay=0.1),
    ),
    "lion": (
        lambda: config_for_function(optax.lion).set(
            learning_rate=warmup_cosine(), weight_decay=0.1
        ),
        lambda lr: optax.lion(lr, weight_decay=0.1),
    ),
    "clip_then_adam": (
        clip_then_adam,
        lambda lr: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr)),
    ),
}


@pytest.mark.parametrize("case", sorted(OPTAX_CASES))
def test_optax_optimizer_matches_optax_applied_directly_step_by_step(case):
    transformation, reference_of = OPTAX_CASES[case]
    rng = np.random.default_rng(RNG_SEED)
    params = random_tree(rng, SHAPES)
    grads_seq = [random_tree(rng, SHAPES) for _ in range(20)]
    ours = config_for_function(opt.optax_optimizer).set(transformation=transformation())
    ours = ours.instantiate()
    reference = reference_of(schedule.as_schedule_fn(warmup_cosine()))
    got, got_state, ours_update = params, ours.init(params), jax.jit(ours.update)
    want, want_state, reference_update = params, reference.init(params), jax.jit(reference.update)
    for grads in grads_seq:
        updates, got_state = ours_update(grads, got_state, got)
        got = jax.tree.map(jnp.add, got, updates)
        updates, want_state = reference_update(grads, want_state, want)
        want = optax.apply_updates(want, updates)
        for name in SHAPES:
            np.testing.assert_allclose(got[name], want[name], atol=1e-7, rtol=0)


def test_optax_optimizer_reports_the_learning_rate_its_transformation_config_sets():
    ours = opt.optax_optimizer(clip_then_adam())
    sched = schedule.as_schedule_fn(warmup_cosine())
    params = {"w": jnp.ones(3)}
    state = ours.init(params)
    for step in range(3):
        assert float(ours.learning_rate_at(state)) == pytest.approx(float(sched(step)))
        _, state = ours.update({"w": jnp.ones(3)}, state, params)
    # A transformation built in Python has no config to read it from.
    assert opt.optax_optimizer(optax.adam(0.1)).learning_rate_at is None


def test_optax_optimizer_names_the_item_that_is_not_a_transformation():
    with pytest.raises(ConfigError, match=r"transformation\[1\] gave function, expected an optax"):
        opt.optax_optimizer([optax.adam(0.1), config_for_function(schedule.constant_schedule)
                             .set(value=1.0)])


def test_optax_state_is_sharded_like_the_parameters_and_counters_replicated():
    specs = sharded_specs()
    transformation = config_for_function(optax.adamw).set(learning_rate=warmup_cosine())
    state_specs = opt.optax_optimizer(transformation).partition(specs)
    adam, _, lr_state = state_specs.inner  # optax.adamw: scale_by_adam, decay, learning rate.
    for name, spec in specs.items():
        assert adam.mu[name].partition_spec == spec.partition_spec
        assert adam.nu[name].partition_spec == spec.partition_spec
    for counter in (state_specs.count, adam.count, lr_state.count):
        assert counter.shape == [] and counter.partition_spec == jax.sharding.PartitionSpec()


def test_optax_statistics_of_another_shape_than_their_parameter_are_replicated():
    specs = sharded_specs()
    state_specs = opt.optax_optimizer(optax.adafactor(0.1)).partition(specs)
    factored = state_specs.inner[0]  # optax.adafactor's FactoredState comes first.
    for name, spec in specs.items():
        for stats in (factored.v_row, factored.v_col, factored.v):
            if tuple(stats[name].shape) == tuple(spec.shape):
                assert stats[name].partition_spec == spec.partition_spec
            else:
                assert set(stats[name].mesh_axes) <= {None}


OPTAX_SHARDED_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from axlearn.common import optimizers as opt
    from axlearn.common.base_layer import ParameterSpec
    from axlearn.common.config import config_for_function

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "model"))
    specs = {
        "w": ParameterSpec(shape=[16, 8], dtype=jnp.float32, mesh_axes=("fsdp", "model")),
        "norm": ParameterSpec(shape=[8], dtype=jnp.float32, mesh_axes=(None,)),
    }
    ours = opt.optax_optimizer([
        config_for_function(optax.clip_by_global_norm).set(max_norm=1.0),
        config_for_function(optax.adamw).set(learning_rate=0.01, weight_decay=0.1),
    ])
    is_spec = lambda x: isinstance(x, ParameterSpec)
    to_sharding = lambda s: NamedSharding(mesh, s.partition_spec)
    param_shardings = jax.tree.map(to_sharding, specs, is_leaf=is_spec)
    state_shardings = jax.tree.map(to_sharding, ours.partition(specs), is_leaf=is_spec)
    rng = np.random.default_rng(0)
    draw = lambda: {k: jnp.asarray(rng.normal(size=s.shape), jnp.float32) for k, s in specs.items()}
    params, grads_seq = draw(), [draw() for _ in range(3)]

    def step(params, state, grads):
        updates, state = ours.update(grads, state, params)
        return jax.tree.map(jnp.add, params, updates), state

    def run(sharded):
        if sharded:
            p = jax.device_put(params, param_shardings)
            s = jax.jit(ours.init, out_shardings=state_shardings)(p)
            f = jax.jit(step, out_shardings=(param_shardings, state_shardings))
        else:
            p = jax.device_put(params, jax.devices()[0])
            s, f = jax.jit(ours.init)(p), jax.jit(step)
        for g in grads_seq:
            p, s = f(p, s, g)
        return p, s

    one, one_state = run(sharded=False)
    many, many_state = run(sharded=True)
    mu = many_state.inner[1][0].mu["w"]  # optax.adamw's first moment of "w".
    assert mu.sharding.spec == PartitionSpec("fsdp", "model"), mu.sharding
    assert mu.addressable_shards[0].data.shape == (4, 4)
    assert len(one["w"].devices()) == 1
    for k in specs:
        np.testing.assert_allclose(np.asarray(many[k]), np.asarray(one[k]), rtol=1e-6, atol=1e-7)
    print("OK")
    """
)


@pytest.mark.slow
def test_optax_optimizer_sharded_on_8_devices_gives_the_one_device_result():
    from tests.fresh_python import assert_prints_ok  # pylint: disable=import-outside-toplevel

    assert_prints_ok(OPTAX_SHARDED_SCRIPT, devices=8)


def optax_adamw_learner() -> Learner.Config:
    transformation = config_for_function(optax.adamw).set(
        learning_rate=warmup_cosine(), weight_decay=0.1
    )
    return Learner.default_config().set(
        name="learner",
        optimizer=config_for_function(opt.optax_optimizer).set(transformation=transformation),
    )


def test_a_learner_config_with_optax_adamw_dumps_parses_back_and_updates():
    text = optax_adamw_learner().debug_string()
    assert "optimizer.transformation.fn: 'optax.adamw'" in text.splitlines()
    parsed = parse_flat_text(text)
    assert parsed.debug_string() == text
    learner = parsed.instantiate(parent=None)
    rng = np.random.default_rng(RNG_SEED)
    params, grads = random_tree(rng, SHAPES), random_tree(rng, SHAPES)
    new_params, _, summaries = learner.update(params, grads, learner.init(params))
    sched = schedule.as_schedule_fn(warmup_cosine())
    reference = optax.adamw(sched, weight_decay=0.1)
    updates, _ = reference.update(grads, reference.init(params), params)
    want = optax.apply_updates(params, updates)
    for name in SHAPES:
        np.testing.assert_allclose(new_params[name], want[name], atol=1e-7, rtol=0)
    assert float(summaries["learning_rate"]) == pytest.approx(float(sched(0)))


@pytest.mark.slow
def test_a_trainer_with_an_optax_learner_trains_and_reports_its_learning_rate(tmp_path):
    # The trainer's modules load only for this test.
    from tests.trainer_script import (  # pylint: disable=import-outside-toplevel
        read_metrics,
        tiny_trainer_config,
    )

    cfg = tiny_trainer_config(trainer_dir=str(tmp_path), max_step=3, learner=optax_adamw_learner())
    cfg.instantiate(parent=None).run()
    records = {r["step"]: r for r in read_metrics(str(tmp_path))}
    sched = schedule.as_schedule_fn(warmup_cosine())
    assert sorted(records) == [1, 2, 3]
    for step, record in records.items():
        assert math.isfinite(record["loss"])
        assert record["learner/learning_rate"] == pytest.approx(float(sched(step - 1)))
    assert records[3]["learner/parameter_norm"] != records[1]["learner/parameter_norm"]


# ----- Adastar -----


def adastar_reference(params, grads_seq, *, lr, b1, b1_debias, b2, b2_debias, eps, eps_square,
                      threshold, b3, b3_debias, weight_decay, sched, update_scale,
                      carried=lambda x: x, carried_keys=("m", "v", "u")):
    """`carried` rounds what each step carries to the next (the EMAs named in
    `carried_keys`: m, v, u), after its update; or is a dict of a rounding for each EMA it
    names."""
    params = to_numpy(params)
    state = {k: dict(m=0.0, v=0.0, u=0.0) for k in params}
    rounding = carried if isinstance(carried, dict) else dict.fromkeys(carried_keys, carried)
    for t, grads in enumerate(to_numpy(grads_seq)):
        for name, g in grads.items():
            s = state[name]
            if b1 is None:
                m_hat = g
            else:
                s["m"] = b1 * s["m"] + (1 - b1) * g
                m_hat = s["m"] / (1 - b1 ** (t + 1)) if b1_debias else s["m"]
            s["v"] = b2 * s["v"] + (1 - b2) * (g * g + eps_square)
            v_hat = s["v"] / (1 - b2 ** (t + 1)) if b2_debias else s["v"]
            raw = m_hat / (np.sqrt(v_hat) + eps)
            if threshold is not None:
                raw = raw / max(1.0, np.sqrt(np.mean(raw**2)) / threshold)
            if b3 is None:
                u_hat = raw
            else:
                s["u"] = b3 * s["u"] + (1 - b3) * raw
                u_hat = s["u"] / (1 - b3 ** (t + 1)) if b3_debias else s["u"]
            u_hat = u_hat * update_scale(name)
            params[name] = params[name] - sched(t) * (lr * u_hat + weight_decay * params[name])
            state[name] = {k: rounding[k](x) if k in rounding else x for k, x in s.items()}
    return params


def adastar_case(b1, b3, threshold, transformation, *, state_dtype=None, state_paths=None):
    rng = np.random.default_rng(RNG_SEED)
    params = random_tree(rng, SHAPES)
    grads_seq = [random_tree(rng, SHAPES, scale=0.1) for _ in range(20)]
    sched_cfg = config_for_function(schedule.cosine_with_linear_warmup).set(
        peak_lr=1.0, max_step=20, warmup_steps=4, begin_value=0.0, alpha=0.1
    )
    kwargs = dict(
        gradient_ema_decay=b1,
        gradient_ema_debias=None if b1 is None else True,
        gradient_square_ema_decay=0.95,
        gradient_square_ema_debias=True,
        eps=1e-6,
        eps_square=1e-30,
        raw_update_clipping_threshold=threshold,
        update_ema_decay=b3,
        update_ema_debias=False,
        weight_decay=0.01,
        update_schedule=sched_cfg,
    )
    ours = opt.adastar_optimizer(0.05, adam_update_transformation=transformation, **kwargs)
    if state_dtype is not None:
        ours = opt.cast_optimizer_state(ours, dtype=state_dtype, state_paths=state_paths)
    got, state = run_steps(ours, params, grads_seq)
    sched = schedule.as_schedule_fn(sched_cfg)
    reference = functools.partial(
        adastar_reference, params, grads_seq, lr=0.05, b1=b1, b1_debias=True, b2=0.95,
        b2_debias=True, eps=1e-6, eps_square=1e-30, threshold=threshold, b3=b3,
        b3_debias=False, weight_decay=0.01, sched=lambda t: float(sched(t + 1)),  # Step t + 1.
        update_scale=lambda name: 0.25 if name == "w" else 1.0,
    )
    # The EMAs `state_paths` picks, by their AdastarState field names.
    keys = {"m": "gradient_ema", "v": "gradient_square_ema", "u": "update_ema"}
    carried_keys = [k for k, field in keys.items() if re.search(state_paths or "", field)]
    if state_dtype is None:
        expected = reference()
    else:
        expected = reference(
            carried=lambda x: np.asarray(x, state_dtype).astype(np.float64),
            carried_keys=carried_keys,
        )
    for name in SHAPES:
        np.testing.assert_allclose(got[name], expected[name], atol=2e-6, rtol=1e-5)
    return got, state, reference


def mup_transformation():
    return config_for_function(opt.scale_update_per_param).set(
        per_param_scale=config_for_function(opt.per_param_scale_by_path).set(
            description="test_mup", scale_by_path=[("w", 0.25)], default_scale=1.0
        )
    )


def test_adastar_with_the_specs_settings_matches_numpy():
    # No gradient EMA, clipped raw updates, an update EMA and muP scales, as in the spec.
    adastar_case(b1=None, b3=0.95, threshold=1.0, transformation=mup_transformation())


def test_adastar_with_a_debiased_gradient_ema_matches_numpy():
    adastar_case(b1=0.9, b3=None, threshold=None, transformation=mup_transformation())


def test_adastar_with_a_gradient_ema_and_clipped_raw_updates_matches_numpy():
    # A threshold small enough to clip every step: the clipping pass reads the gradient EMA too.
    adastar_case(b1=0.9, b3=0.95, threshold=0.05, transformation=mup_transformation())


def test_adastar_verbosity_2_prints_which_raw_updates_were_clipped(capfd):
    # At step 1 the raw update is g / |g| (eps = 0): RMS 1 for "a", clipped at 0.8, and
    # sqrt(1/2) for "b", whose gradient is half zeros, not clipped: 1 of 2 weights, 3 of
    # the 11 parameters. At step 2 "a" gets the same gradient again (RMS 1, clipped) and
    # "b" a gradient 10x larger, whose raw updates exceed the threshold: both clipped.
    ours = opt.adastar_optimizer(
        0.1, gradient_ema_decay=None, gradient_ema_debias=None, gradient_square_ema_decay=0.95,
        gradient_square_ema_debias=True, eps=0.0, eps_square=1e-30,
        raw_update_clipping_threshold=0.8, update_ema_decay=None, update_ema_debias=False,
        update_schedule=1.0, verbosity=2,
    )
    params = {"a": jnp.ones((3,)), "b": jnp.ones((4, 2))}
    b_grad = jnp.array([[1.0, 0.0]] * 4)
    grads = [{"a": jnp.ones((3,)), "b": b_grad}, {"a": jnp.ones((3,)), "b": 10 * b_grad}]
    run_steps(ours, params, grads, jit=False)
    printed = [line for line in capfd.readouterr().out.splitlines() if "clipped" in line]
    assert len(printed) == 2
    assert printed[0].startswith("adastar step 1 clipped raw updates: 1 of 2 weights, 0.2727")
    assert printed[1].startswith("adastar step 2 clipped raw updates: 2 of 2 weights, 1.0 of")


@pytest.mark.parametrize("b1", [None, 0.9])
def test_adastar_with_bf16_state_matches_numpy_rounding_its_emas_each_step(b1):
    got, state, reference = adastar_case(
        b1=b1, b3=0.95, threshold=1.0, transformation=mup_transformation(),
        state_dtype=jnp.bfloat16,
    )
    for leaf in jax.tree.leaves(state):
        expected = jnp.bfloat16 if leaf.ndim else jnp.int32  # The EMAs; the step count.
        assert leaf.dtype == expected
    # The rounding shows: float32 EMAs give parameters outside the tolerance above.
    unrounded = reference()
    assert max(np.max(np.abs(got[k] - unrounded[k])) for k in SHAPES) > 1e-4


def test_adastar_with_each_ema_in_its_own_dtype_matches_numpy_rounding_each():
    # gpt_1b_narrow_state's state: the second moment in bfloat16, the update EMA in float16;
    # two casts, one around the other, each picking its EMA by path.
    rng = np.random.default_rng(RNG_SEED)
    params = random_tree(rng, SHAPES)
    grads_seq = [random_tree(rng, SHAPES, scale=0.1) for _ in range(20)]
    kwargs = dict(
        gradient_ema_decay=None, gradient_ema_debias=None, gradient_square_ema_decay=0.95,
        gradient_square_ema_debias=True, eps=1e-6, eps_square=1e-30,
        raw_update_clipping_threshold=1.0, update_ema_decay=0.95, update_ema_debias=False,
        weight_decay=0.01, update_schedule=0.5,
    )
    adastar = opt.adastar_optimizer(0.05, **kwargs)
    ours = opt.cast_optimizer_state(
        opt.cast_optimizer_state(adastar, dtype=jnp.float16, state_paths="update_ema"),
        dtype=jnp.bfloat16,
        state_paths="gradient_square_ema",
    )
    got, state = run_steps(ours, params, grads_seq)
    kept = state[0]
    assert {x.dtype for x in jax.tree.leaves(kept.gradient_square_ema)} == {
        jnp.dtype(jnp.bfloat16)
    }
    assert {x.dtype for x in jax.tree.leaves(kept.update_ema)} == {jnp.dtype(jnp.float16)}
    reference = functools.partial(
        adastar_reference, params, grads_seq, lr=0.05, b1=None, b1_debias=None, b2=0.95,
        b2_debias=True, eps=1e-6, eps_square=1e-30, threshold=1.0, b3=0.95, b3_debias=False,
        weight_decay=0.01, sched=lambda t: 0.5, update_scale=lambda name: 1.0,
    )
    bfloat16 = lambda x: np.asarray(x, jnp.bfloat16).astype(np.float64)  # noqa: E731
    float16 = lambda x: np.asarray(x, np.float16).astype(np.float64)  # noqa: E731
    expected = reference(carried={"v": bfloat16, "u": float16})
    unrounded = reference()
    off = np.concatenate([np.abs(got[k] - expected[k]).ravel() for k in SHAPES])
    off_unrounded = np.concatenate([np.abs(got[k] - unrounded[k]).ravel() for k in SHAPES])
    # Nearly every parameter to float32's precision. Where float32 and float64 land an EMA
    # on two sides of a rounding boundary, it moves by one unit there: for the update EMA
    # under 3e-5 here (lr 0.05 x 0.5 x 4.5 x 2**-11); that happens to one or two.
    assert np.mean(off < 2e-6) > 0.9 and off.max() < 3e-5
    # The rounding shows: float32 EMAs put the typical parameter 100 times further.
    assert np.median(off_unrounded) > 100 * np.median(off)


@pytest.mark.parametrize("state_paths", ["update_ema", "gradient_square_ema"])
def test_adastar_with_one_ema_in_bf16_matches_numpy_rounding_that_ema_alone(state_paths):
    got, state, reference = adastar_case(
        b1=None, b3=0.95, threshold=1.0, transformation=mup_transformation(),
        state_dtype=jnp.bfloat16, state_paths=state_paths,
    )
    adastar = state[0]  # The state: (AdastarState, muP's EmptyState).
    for field in ("gradient_square_ema", "update_ema"):
        want = jnp.dtype(jnp.bfloat16 if field == state_paths else jnp.float32)
        assert {leaf.dtype for leaf in jax.tree.leaves(getattr(adastar, field))} == {want}
    assert adastar.count.dtype == jnp.int32
    # Both EMAs rounded is a different result: the one left in float32 was not rounded.
    both = reference(carried=lambda x: np.asarray(x, jnp.bfloat16).astype(np.float64))
    assert max(np.max(np.abs(got[k] - both[k])) for k in SHAPES) > 1e-6


def test_cast_optimizer_state_paths_pick_tensors_in_state_and_specs_alike():
    transformation = opt.cast_optimizer_state(
        skip_clip_adamw(), dtype=jnp.bfloat16, state_paths="/mu/"
    )
    params = {"w": jnp.linspace(-1.0, 1.0, 64), "b": jnp.ones(3)}
    state = transformation.init(params)
    grads = {"w": jnp.full(64, 0.01), "b": jnp.ones(3)}
    _, state = jax.jit(transformation.update)(grads, state, params)
    adam = state.inner_state[0]
    assert {adam.mu["w"].dtype, adam.mu["b"].dtype} == {jnp.dtype(jnp.bfloat16)}
    assert {adam.nu["w"].dtype, adam.nu["b"].dtype} == {jnp.dtype(jnp.float32)}
    specs = transformation.partition(
        {k: ParameterSpec(shape=v.shape, dtype=v.dtype) for k, v in params.items()}
    )
    # Each tensor's spec has its dtype: checkpoints and shardings see what the state holds.
    spec_leaves, state_leaves = jax.tree.leaves(specs), jax.tree.leaves(state)
    assert len(spec_leaves) == len(state_leaves)
    for spec, leaf in zip(spec_leaves, state_leaves):
        if isinstance(spec, ParameterSpec):
            assert spec.dtype == leaf.dtype and tuple(spec.shape) == leaf.shape
    with pytest.raises(ConfigError, match=r"state_paths='velocity' matches none of .*mu/w"):
        opt.cast_optimizer_state(
            skip_clip_adamw(), dtype=jnp.bfloat16, state_paths="velocity"
        ).init(params)
    with pytest.raises(ConfigError, match=r"state_paths='\(': "):
        opt.cast_optimizer_state(skip_clip_adamw(), dtype=jnp.bfloat16, state_paths="(")


def test_cast_optimizer_state_keeps_scalars_and_rejects_an_integer_dtype():
    transformation = opt.cast_optimizer_state(skip_clip_adamw(), dtype=jnp.bfloat16)
    params = {"w": jnp.arange(4.0)}
    state = transformation.init(params)
    _, state = jax.jit(transformation.update)({"w": jnp.full(4, 0.1)}, state, params)
    assert state.nonvalid_count.dtype == jnp.int32
    assert state.inner_state[0].count.dtype == jnp.int32
    assert state.inner_state[0].mu["w"].dtype == jnp.bfloat16
    assert state.inner_state[0].nu["w"].dtype == jnp.bfloat16
    assert float(transformation.learning_rate_at(state)) == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="cast_optimizer_state: dtype must be a floating"):
        opt.cast_optimizer_state(skip_clip_adamw(), dtype=jnp.int32)
    with pytest.raises(ConfigError, match="floating-point dtype, got 'float42'"):
        opt.cast_optimizer_state(skip_clip_adamw(), dtype="float42")


def test_adastar_rejects_a_missing_debias_switch():
    with pytest.raises(ConfigError, match="gradient_ema_debias"):
        opt.adastar_optimizer(
            0.1, gradient_ema_decay=0.9, gradient_ema_debias=None, gradient_square_ema_decay=0.9,
            gradient_square_ema_debias=True, eps=0, eps_square=1e-30,
            raw_update_clipping_threshold=None, update_ema_decay=None, update_ema_debias=False,
            update_schedule=1.0,
        )


# ----- Lion, SGD, Adafactor -----


def test_lion_matches_numpy():
    rng = np.random.default_rng(RNG_SEED)
    params = random_tree(rng, SHAPES)
    grads_seq = [random_tree(rng, SHAPES) for _ in range(10)]
    lion = opt.lion_optimizer(1e-3, b1=0.9, b2=0.99, weight_decay=0.1)
    got, _ = run_steps(lion, params, grads_seq)
    ref, m = to_numpy(params), {k: 0.0 for k in SHAPES}
    for grads in to_numpy(grads_seq):
        for name, g in grads.items():
            c = 0.9 * m[name] + 0.1 * g
            ref[name] = ref[name] - 1e-3 * (np.sign(c) + 0.1 * ref[name])
            m[name] = 0.99 * m[name] + 0.01 * g
    for name in SHAPES:
        np.testing.assert_allclose(got[name], ref[name], atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_matches_torch(nesterov):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(RNG_SEED)
    params = random_tree(rng, SHAPES)
    grads_seq = [random_tree(rng, SHAPES) for _ in range(10)]
    sgd = opt.sgd_optimizer(0.1, momentum=0.9, nesterov=nesterov, weight_decay=0.01)
    got, _ = run_steps(sgd, params, grads_seq)
    tensors = {k: torch.tensor(np.asarray(v), requires_grad=True) for k, v in params.items()}
    reference = torch.optim.SGD(
        list(tensors.values()), lr=0.1, momentum=0.9, nesterov=nesterov, weight_decay=0.01
    )
    for grads in grads_seq:
        for name, t in tensors.items():
            t.grad = torch.tensor(np.asarray(grads[name]))
        reference.step()
    for name in SHAPES:
        np.testing.assert_allclose(got[name], tensors[name].detach().numpy(), atol=1e-6)


def adafactor_reference(params, grads_seq, *, lr, b1, clip, eps, eps_scale, weight_decay,
                        factored_names, trust_ratio=False, wd_exponent=1.0,
                        momentum_dtype=np.float64):
    """Shazeer & Stern (2018), Algorithms 4-5, with row/column *sums* as in the paper;
    `trust_ratio`: each step rescaled to ||p|| / (||step|| + eps) (LAMB); `lr` a number or
    a function of the step t = 0, 1, ...; weight decay scaled by lr ** `wd_exponent`; the
    momentum stored in `momentum_dtype` (the step uses it before the rounding)."""
    params = to_numpy(params)
    state = {k: {} for k in params}
    lr_of = lr if callable(lr) else (lambda t, lr=lr: lr)
    for t, grads in enumerate(to_numpy(grads_seq)):
        lr = lr_of(t)
        beta = 1.0 - (t + 1.0) ** -0.8
        for name, g in grads.items():
            s, g2 = state[name], g * g + eps
            if name in factored_names:  # Each trailing matrix separately.
                row = beta * s.get("r", 0.0) + (1 - beta) * g2.sum(axis=-1)
                col = beta * s.get("c", 0.0) + (1 - beta) * g2.sum(axis=-2)
                s["r"], s["c"] = row, col
                v = row[..., :, None] * col[..., None, :] / row.sum(axis=-1)[..., None, None]
            else:
                v = s["v"] = beta * s.get("v", 0.0) + (1 - beta) * g2
            u = g / np.sqrt(v)
            u = u / max(1.0, np.sqrt(np.mean(u**2)) / clip)
            u = lr * max(eps_scale, np.sqrt(np.mean(params[name] ** 2))) * u
            if b1 is not None:  # Momentum of the scaled steps (AXLearn's and optax's order).
                u = b1 * np.asarray(s.get("m", 0.0), np.float64) + (1 - b1) * u
                s["m"] = u.astype(momentum_dtype)
            step = u + lr**wd_exponent * weight_decay * params[name]
            if trust_ratio:
                step = step * np.linalg.norm(params[name]) / (np.linalg.norm(step) + eps)
            params[name] = params[name] - step
    return params


def test_adafactor_matches_numpy():
    rng = np.random.default_rng(RNG_SEED)
    shapes = {"w": (6, 5), "b": (5,), "stack": (2, 4, 3), "thin": (6, 1)}
    params = random_tree(rng, shapes)
    grads_seq = [random_tree(rng, shapes) for _ in range(10)]
    ours = opt.adafactor_optimizer(
        0.01, b1=0.9, clipping_threshold=1.0, min_dim_size_to_factor=3, weight_decay=0.1,
        weight_decay_scale_by_learning_rate_exponent=1.0,
    )
    got, state = run_steps(ours, params, grads_seq)
    expected = adafactor_reference(
        params, grads_seq, lr=0.01, b1=0.9, clip=1.0, eps=1e-30, eps_scale=1e-3,
        weight_decay=0.1, factored_names={"w", "stack"},
    )
    assert state.v_row["w"].shape == (6,) and state.v_col["stack"].shape == (2, 3)
    assert state.v_row["thin"] is None and state.v["thin"].shape == (6, 1)
    for name in shapes:
        np.testing.assert_allclose(got[name], expected[name], atol=1e-6, rtol=1e-5)


def test_adafactor_scale_by_trust_ratio_matches_numpy():
    rng = np.random.default_rng(RNG_SEED)
    shapes = {"w": (6, 5), "b": (5,), "stack": (2, 4, 3)}
    params = random_tree(rng, shapes)
    grads_seq = [random_tree(rng, shapes) for _ in range(5)]
    ours = opt.adafactor_optimizer(
        0.01, b1=0.9, clipping_threshold=1.0, min_dim_size_to_factor=3, weight_decay=0.1,
        weight_decay_scale_by_learning_rate_exponent=1.0, apply_scale_by_trust_ratio=True,
    )
    got, _ = run_steps(ours, params, grads_seq)
    expected = adafactor_reference(
        params, grads_seq, lr=0.01, b1=0.9, clip=1.0, eps=1e-30, eps_scale=1e-3,
        weight_decay=0.1, factored_names={"w", "stack"}, trust_ratio=True,
    )
    for name in shapes:
        np.testing.assert_allclose(got[name], expected[name], atol=1e-5, rtol=1e-5)


def test_adafactor_scales_weight_decay_by_a_power_of_the_learning_rate_as_numpy():
    rng = np.random.default_rng(RNG_SEED)
    shapes = {"w": (6, 5), "b": (5,)}
    params = random_tree(rng, shapes)
    grads_seq = [random_tree(rng, shapes) for _ in range(6)]
    lr = lambda t: 0.02 * (t + 1.0)  # noqa: E731  A schedule: the power of it matters.
    ours = opt.adafactor_optimizer(
        lr, b1=0.9, clipping_threshold=1.0, min_dim_size_to_factor=3, weight_decay=0.3,
        weight_decay_scale_by_learning_rate_exponent=0.5,
    )
    got, _ = run_steps(ours, params, grads_seq)
    # Ours reads the schedule at the update count + 1, as AXLearn's learner does.
    expected = adafactor_reference(
        params, grads_seq, lr=lambda t: lr(t + 1), b1=0.9, clip=1.0, eps=1e-30,
        eps_scale=1e-3, weight_decay=0.3, factored_names={"w"}, wd_exponent=0.5,
    )
    for name in shapes:
        np.testing.assert_allclose(got[name], expected[name], atol=1e-6, rtol=1e-5)


def test_adafactor_with_momentum_and_a_schedule_matches_optax_adafactor():
    # optax orders it as AXLearn does (momentum of the scaled steps) and decays weights
    # without the learning rate: exponent 0. Its factored axes are ours for a matrix.
    rng = np.random.default_rng(RNG_SEED)
    shapes = {"w": (6, 5), "b": (5,)}
    params = random_tree(rng, shapes)
    grads_seq = [random_tree(rng, shapes) for _ in range(6)]
    lr = lambda t: 0.02 * (t + 1.0)  # noqa: E731
    ours = opt.adafactor_optimizer(
        lr, b1=0.9, clipping_threshold=1.0, min_dim_size_to_factor=3, weight_decay=0.1,
        weight_decay_scale_by_learning_rate_exponent=0.0,
    )
    reference = optax.adafactor(  # optax reads its schedule at the count, ours at count + 1.
        lambda t: lr(t + 1), min_dim_size_to_factor=3, clipping_threshold=1.0, momentum=0.9,
        weight_decay_rate=0.1, eps=1e-30,
    )
    got, _ = run_steps(ours, params, grads_seq)
    expected, _ = run_steps(reference, params, grads_seq)
    for name in shapes:
        np.testing.assert_allclose(got[name], expected[name], atol=1e-6, rtol=1e-5)


def test_adafactor_keeps_its_momentum_in_dtype_momentum():
    import ml_dtypes  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(RNG_SEED)
    shapes = {"w": (6, 5), "b": (5,)}
    params = random_tree(rng, shapes)
    grads_seq = [random_tree(rng, shapes) for _ in range(6)]
    ours = opt.adafactor_optimizer(
        0.01, b1=0.9, clipping_threshold=1.0, min_dim_size_to_factor=3,
        dtype_momentum=jnp.bfloat16,
    )
    got, state = run_steps(ours, params, grads_seq)
    assert {state.momentum[name].dtype for name in shapes} == {jnp.dtype(jnp.bfloat16)}
    assert ours.partition(params).momentum["w"].dtype == jnp.bfloat16
    expected = adafactor_reference(
        params, grads_seq, lr=0.01, b1=0.9, clip=1.0, eps=1e-30, eps_scale=1e-3,
        weight_decay=0.0, factored_names={"w"}, momentum_dtype=ml_dtypes.bfloat16,
    )
    for name in shapes:
        np.testing.assert_allclose(got[name], expected[name], atol=1e-6, rtol=1e-5)


def test_adafactor_weight_decay_without_its_learning_rate_exponent_is_refused_by_name():
    with pytest.raises(ConfigError, match="weight_decay_scale_by_learning_rate_exponent"):
        opt.adafactor_optimizer(0.01, weight_decay=0.1)
    with pytest.raises(ConfigError, match="dtype_momentum=int8"):
        opt.adafactor_optimizer(0.01, b1=0.9, dtype_momentum=jnp.int8)


def test_adafactor_eps_scale_and_min_dim_none_take_axlearns_fixed_values():
    # AXLearn's dumps leave both fields out (it fixes them at 1e-3 and 128); read from
    # such a dump they are None.
    rng = np.random.default_rng(RNG_SEED)
    shapes = {"square": (128, 128), "narrow": (127, 128), "b": (5,)}
    params = random_tree(rng, shapes, scale=1e-5)  # rms(p) < 1e-3: eps_scale decides.
    grads_seq = [random_tree(rng, shapes) for _ in range(3)]
    ours = opt.adafactor_optimizer(0.01, eps_scale=None, min_dim_size_to_factor=None)
    got, state = run_steps(ours, params, grads_seq)
    assert state.v_row["square"].shape == (128,) and state.v_row["narrow"] is None
    expected = adafactor_reference(
        params, grads_seq, lr=0.01, b1=None, clip=1.0, eps=1e-30, eps_scale=1e-3,
        weight_decay=0.0, factored_names={"square"},
    )
    for name in shapes:
        np.testing.assert_allclose(got[name], expected[name], atol=1e-9, rtol=1e-5)


def test_axlearn_gspmd_adafactor_golden_lines_parse_and_instantiate():
    text = textwrap.dedent(
        """\
        optimizer.b1: 0.9
        optimizer.clipping_threshold: 5
        optimizer.dtype_momentum: 'jax.numpy.bfloat16'
        optimizer.fn: 'axlearn.common.optimizers.adafactor_optimizer'
        optimizer.learning_rate: 0.01
        optimizer.multiply_by_parameter_scale: False
        optimizer.weight_decay: 0.001
        optimizer.weight_decay_scale_by_learning_rate_exponent: 1
        """
    )
    optimizer = parse_flat_text(text)["optimizer"]
    assert optimizer.weight_decay_scale_by_learning_rate_exponent == 1
    state = optimizer.instantiate().init({"w": jnp.zeros((4, 3))})
    assert state.momentum["w"].dtype == jnp.bfloat16


def test_axlearn_adafactor_golden_line_with_trust_ratio_parses_and_instantiates():
    text = textwrap.dedent(
        """\
        optimizer.apply_scale_by_trust_ratio: True
        optimizer.b1: 0.9
        optimizer.clipping_threshold: 1.0
        optimizer.fn: 'axlearn.common.optimizers.adafactor_optimizer'
        optimizer.learning_rate: 0.01
        """
    )
    optimizer = parse_flat_text(text)["optimizer"]
    assert optimizer.apply_scale_by_trust_ratio is True
    rng = np.random.default_rng(RNG_SEED)
    params = random_tree(rng, {"w": (4, 3)})
    tx = optimizer.instantiate()
    updates, _ = tx.update(random_tree(rng, {"w": (4, 3)}), tx.init(params), params)
    np.testing.assert_allclose(np.linalg.norm(updates["w"]), np.linalg.norm(params["w"]), 1e-5)


def test_trust_ratio_scaling_matches_optax_scale_by_trust_ratio():
    rng = np.random.default_rng(RNG_SEED)
    updates = {"w": rng.normal(size=(4, 3)), "zero_param": rng.normal(size=(3,)),
               "zero_update": np.zeros((2, 2))}
    params = {"w": rng.normal(size=(4, 3)), "zero_param": np.zeros(3),
              "zero_update": rng.normal(size=(2, 2))}
    updates, params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), (updates, params))
    reference = optax.scale_by_trust_ratio(eps=1e-30)
    expected, _ = reference.update(updates, reference.init(params), params)
    for name in updates:
        got = opt._trust_ratio_scaled(  # pylint: disable=protected-access
            updates[name], params[name], 1e-30
        )
        np.testing.assert_allclose(got, expected[name], rtol=1e-6)


def test_adafactor_factors_the_axes_the_spec_names():
    spec = ParameterSpec(shape=[4, 3, 5], dtype=jnp.float32, mesh_axes=("fsdp", None, "model"),
                         factorization=("col", None, "row"))
    state_specs = opt.adafactor_optimizer(0.1, min_dim_size_to_factor=1).partition({"w": spec})
    # v_row averages over the 'col' axis (0); v_col over the 'row' axis (2).
    assert state_specs.v_row["w"].shape == [3, 5]
    assert tuple(state_specs.v_row["w"].mesh_axes) == (None, "model")
    assert state_specs.v_col["w"].shape == [4, 3]
    assert tuple(state_specs.v_col["w"].mesh_axes) == ("fsdp", None)


# ----- Muon -----

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def numpy_newton_schulz(matrix, steps=5):
    a, b, c = NS_COEFFICIENTS
    x = matrix / (np.linalg.norm(matrix) + 1e-7)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def test_muon_matches_numpy_for_matrices_stacks_and_adamw_params():
    rng = np.random.default_rng(RNG_SEED)
    layers, d, n, h = 2, 8, 2, 3
    shapes = {
        "emb": {"weight": (10, d)},  # Embedding: AdamW.
        "ffn": {"weight": (d, 12)},  # Matrix: Muon.
        "qkv": {"weight": (layers, d, n, h)},  # Stacked [D, N, H] weights: Muon per layer.
        "o": {"weight": (layers, d, n, h)},  # Stacked output projections: in=(N, H), out=D.
        "norm": {"scale": (d,)},  # AdamW.
    }
    flat = {f"{k}/{n_}": s for k, v in shapes.items() for n_, s in v.items()}
    params = {k: random_tree(rng, v) for k, v in shapes.items()}
    grads_seq = [{k: random_tree(rng, v) for k, v in shapes.items()} for _ in range(4)]
    fan_axes = {
        "qkv/weight": FanAxes(in_axis=-3, out_axis=(-2, -1)).prepend_axis(),
        "o/weight": FanAxes(in_axis=(-2, -1), out_axis=-3).prepend_axis(),
    }
    specs = {
        k: {n_: ParameterSpec(shape=list(s), dtype=jnp.float32, fan_axes=fan_axes.get(f"{k}/{n_}"))
            for n_, s in v.items()}
        for k, v in shapes.items()
    }
    lr, adam_lr, mom, wd = 0.02, 0.003, 0.95, 0.1
    ours = opt.muon_optimizer(
        lr, momentum=mom, ns_dtype=jnp.float32, weight_decay=wd, adamw_learning_rate=adam_lr
    )
    got, state = run_steps(ours, params, grads_seq, specs=specs)
    assert state.momentum["emb"]["weight"] is None and state.mu["qkv"]["weight"] is None

    def orthogonal_update(name, d_):
        if name == "ffn/weight":
            return numpy_newton_schulz(d_) * math.sqrt(max(1.0, 12 / d))
        out = np.empty_like(d_)
        for layer in range(layers):
            if name == "qkv/weight":  # [D, N*H]
                o = numpy_newton_schulz(d_[layer].reshape(d, n * h))
                out[layer] = (o * math.sqrt(max(1.0, n * h / d))).reshape(d, n, h)
            else:  # [N*H, D]
                m = np.transpose(d_[layer], (1, 2, 0)).reshape(n * h, d)
                o = numpy_newton_schulz(m) * math.sqrt(max(1.0, d / (n * h)))
                out[layer] = np.transpose(o.reshape(n, h, d), (2, 0, 1))
        return out

    ref = {k: to_numpy(params)[k.split("/")[0]][k.split("/")[1]] for k in flat}
    buf = {k: 0.0 for k in flat}
    mu, nu = dict(buf), dict(buf)
    for t, grads in enumerate(grads_seq):
        for name in flat:
            g = np.asarray(grads[name.split("/")[0]][name.split("/")[1]], np.float64)
            if name in ("emb/weight", "norm/scale"):
                mu[name] = 0.9 * mu[name] + 0.1 * g
                nu[name] = 0.95 * nu[name] + 0.05 * g * g
                step = (mu[name] / (1 - 0.9 ** (t + 1))) / (
                    np.sqrt(nu[name] / (1 - 0.95 ** (t + 1))) + 1e-8
                )
                ref[name] = ref[name] - adam_lr * (step + wd * ref[name])
            else:
                buf[name] = mom * buf[name] + (1 - mom) * g
                d_ = (1 - mom) * g + mom * buf[name]  # Nesterov.
                ref[name] = ref[name] - lr * (orthogonal_update(name, d_) + wd * ref[name])
    for name in flat:
        k, n_ = name.split("/")
        np.testing.assert_allclose(got[k][n_], ref[name], atol=2e-5, err_msg=name)


def test_newton_schulz_in_bf16_brings_singular_values_near_one():
    rng = np.random.default_rng(RNG_SEED)
    x = jnp.asarray(rng.normal(size=(3, 64, 32)), jnp.float32)
    o = opt.newton_schulz_orthogonalize(x)  # bf16 by default.
    singular_values = np.linalg.svd(np.asarray(o), compute_uv=False)
    # The quintic iteration trades exactness for speed: values land around [0.7, 1.2].
    assert np.all(np.isfinite(singular_values))
    assert singular_values.min() > 0.5 and singular_values.max() < 1.3


# ----- clipping, skipping, scaling, EMA, chain -----


def test_clip_by_global_norm_scales_to_max_norm():
    grads = {"a": jnp.array([3.0, 0.0]), "b": jnp.array([[4.0]])}  # Norm 5.
    clipped, _ = opt.clip_by_global_norm(1.0, eps=0.0).update(grads, opt.EmptyState())
    np.testing.assert_allclose(clipped["a"], [0.6, 0.0], rtol=1e-6)
    np.testing.assert_allclose(clipped["b"], [[0.8]], rtol=1e-6)


def skip_clip_adamw():
    return opt.skip_and_clip_by_global_norm(
        config_for_function(opt.adamw_optimizer).set(learning_rate=0.1),
        drop_norm=10.0,
        max_norm=1.0,
    )


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), 20.0])
def test_skip_and_clip_leaves_params_and_state_untouched_on_a_bad_gradient(bad_value):
    transformation = skip_clip_adamw()
    params = {"w": jnp.arange(4.0)}
    state = transformation.init(params)
    # One good step first, so the moments are non-zero.
    updates, state = transformation.update({"w": jnp.full(4, 0.1)}, state, params)
    params = jax.tree.map(jnp.add, params, updates)
    updates, new_state = jax.jit(transformation.update)(
        {"w": jnp.array([bad_value, 0.0, 0.0, 0.0])}, state, params
    )
    np.testing.assert_array_equal(updates["w"], np.zeros(4))
    for old, new in zip(jax.tree.leaves(state.inner_state), jax.tree.leaves(new_state.inner_state)):
        np.testing.assert_array_equal(old, new)
    assert int(new_state.nonvalid_count) == 1
    assert int(new_state.inner_state[0].count) == 1


def test_skip_and_clip_clips_valid_gradients_before_the_inner_optimizer():
    transformation = opt.skip_and_clip_by_global_norm(
        opt.sgd_optimizer(1.0), drop_norm=100.0, max_norm=2.0, eps=0.0
    )
    grads = {"w": jnp.array([6.0, 8.0])}  # Norm 10: scaled by 0.2.
    updates, state = transformation.update(grads, transformation.init(grads), grads)
    np.testing.assert_allclose(updates["w"], [-1.2, -1.6], rtol=1e-6)
    assert int(state.nonvalid_count) == 0


def test_per_param_scale_by_path_uses_the_first_full_match():
    fn = opt.per_param_scale_by_path(
        description="t",
        scale_by_path=[(".*attn/weight", 0.5), (".*weight", 0.25), ("attn", 9.0)],
        default_scale=2.0,
    )
    tree = {"attn": {"weight": jnp.zeros(2), "bias": jnp.zeros(2)}, "ffn": {"weight": jnp.zeros(3)}}
    assert fn(tree) == {"attn": {"weight": 0.5, "bias": 2.0}, "ffn": {"weight": 0.25}}


def test_scale_update_per_param_multiplies_each_update():
    t = opt.scale_update_per_param(
        config_for_function(opt.per_param_scale_by_path).set(
            description="t", scale_by_path=[("a", 0.5)], default_scale=3.0
        )
    )
    updates, _ = t.update({"a": jnp.ones(2), "b": jnp.ones(1)}, t.init({}))
    np.testing.assert_allclose(updates["a"], [0.5, 0.5])
    np.testing.assert_allclose(updates["b"], [3.0])


def test_weight_decay_scales_come_from_specs_and_per_param_functions():
    params = {"norm": {"scale": jnp.ones(3)}, "w": jnp.ones(3), "v": jnp.ones(3)}
    specs = jax.tree.map(lambda p: ParameterSpec(shape=list(p.shape), dtype=p.dtype), params)
    specs["norm"]["scale"].weight_decay_scale = 0.0
    per_param = config_for_function(opt.per_param_scale_by_path).set(
        description="wd", scale_by_path=[("v", 0.5)]
    )
    t = opt.sgd_optimizer(1.0, weight_decay=0.1, weight_decay_per_param_scale=per_param)
    zeros = jax.tree.map(jnp.zeros_like, params)
    wrapped = opt.with_param_specs(params, specs)
    updates, _ = t.update(zeros, t.init(wrapped), wrapped)
    np.testing.assert_allclose(updates["norm"]["scale"], np.zeros(3))
    np.testing.assert_allclose(updates["w"], np.full(3, -0.1), rtol=1e-6)
    np.testing.assert_allclose(updates["v"], np.full(3, -0.05), rtol=1e-6)


def test_param_ema_is_the_debiased_average_of_updated_params():
    decay = 0.9
    t = opt.param_ema(decay)
    params = {"w": jnp.zeros(2)}
    state = t.init(params)
    rng = np.random.default_rng(RNG_SEED)
    biased, p = np.zeros(2), np.zeros(2)
    for step in range(1, 6):
        updates = {"w": jnp.asarray(rng.normal(size=2), jnp.float32)}
        _, state = t.update(updates, state, params)
        params = jax.tree.map(jnp.add, params, updates)
        p = np.asarray(params["w"], np.float64)
        biased = decay * biased + (1 - decay) * p
        np.testing.assert_allclose(state.ema["w"], biased / (1 - decay**step), rtol=1e-5)


def test_param_ema_without_decay_keeps_no_state():
    t = opt.param_ema()
    assert jax.tree.leaves(t.init({"w": jnp.ones(3)})) == []
    assert jax.tree.leaves(t.partition({"w": ParameterSpec(shape=[3])})) == []


def test_chain_applies_in_order_and_takes_configs():
    t = opt.chain(
        transformations=[
            config_for_function(opt.clip_by_global_norm).set(max_norm=1.0, eps=0.0),
            opt.sgd_optimizer(0.5),
        ]
    )
    updates, state = t.update({"w": jnp.array([3.0, 4.0])}, t.init({"w": jnp.zeros(2)}))
    np.testing.assert_allclose(updates["w"], [-0.3, -0.4], rtol=1e-6)
    assert float(t.learning_rate_at(state)) == 0.5


# ----- partitioning -----


def sharded_specs():
    return {
        "w": ParameterSpec(shape=[256, 128], dtype=jnp.float32, mesh_axes=("fsdp", "model")),
        "stack": ParameterSpec(
            shape=[2, 256, 128],
            dtype=jnp.float32,
            mesh_axes=(None, "fsdp", "model"),
            fan_axes=FanAxes().prepend_axis(),
        ),
        "emb": ParameterSpec(shape=[64, 128], dtype=jnp.float32, mesh_axes=("model", None)),
        "norm": ParameterSpec(shape=[128], dtype=jnp.float32, mesh_axes=(None,)),
    }


ALL_OPTIMIZERS = {
    "adamw": lambda: opt.adamw_optimizer(0.1, weight_decay=0.1),
    "adamw_decoupled": lambda: opt.adamw_decoupled_optimizer(0.1, weight_decay=0.1),
    "adastar": lambda: opt.adastar_optimizer(
        0.1, gradient_ema_decay=0.9, gradient_ema_debias=True, gradient_square_ema_decay=0.95,
        gradient_square_ema_debias=True, eps=0.0, eps_square=1e-30,
        raw_update_clipping_threshold=1.0, update_ema_decay=0.9, update_ema_debias=False,
        update_schedule=1.0, adam_update_transformation=mup_transformation(),
    ),
    "adafactor": lambda: opt.adafactor_optimizer(0.1, b1=0.9),
    "optax_adamw": lambda: opt.optax_optimizer(
        config_for_function(optax.adamw).set(learning_rate=warmup_cosine(), weight_decay=0.1)
    ),
    "optax_clip_then_adam": lambda: opt.optax_optimizer(clip_then_adam()),
    "optax_adafactor": lambda: opt.optax_optimizer(optax.adafactor(0.1)),
    "lion": lambda: opt.lion_optimizer(0.1),
    "sgd": lambda: opt.sgd_optimizer(0.1, momentum=0.9),
    "muon": lambda: opt.muon_optimizer(0.1),
    "cast_bf16_skip_clip_adastar": lambda: opt.cast_optimizer_state(
        opt.skip_and_clip_by_global_norm(ALL_OPTIMIZERS["adastar"](), max_norm=1.0),
        dtype=jnp.bfloat16,
    ),
    "skip_clip_ema_chain": lambda: opt.chain(
        opt.skip_and_clip_by_global_norm(opt.adamw_optimizer(0.1), drop_norm=1.0, max_norm=1.0),
        opt.param_ema(0.99),
    ),
}


@pytest.mark.parametrize("name", sorted(ALL_OPTIMIZERS))
def test_state_specs_have_the_structure_shapes_and_dtypes_of_the_state(name):
    transformation = ALL_OPTIMIZERS[name]()
    specs = sharded_specs()
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), specs)
    state_shapes = jax.eval_shape(transformation.init, opt.with_param_specs(params, specs))
    state_specs = transformation.partition(specs)
    assert jax.tree.structure(state_shapes) == jax.tree.structure(state_specs)
    for shape, spec in zip(jax.tree.leaves(state_shapes), jax.tree.leaves(state_specs)):
        assert tuple(shape.shape) == tuple(spec.shape)
        assert shape.dtype == jnp.dtype(spec.dtype)
        assert spec.mesh_axes is None or len(spec.mesh_axes) == len(spec.shape)


def test_adam_moments_are_sharded_like_their_parameters_and_counts_replicated():
    specs = sharded_specs()
    adam_state, _ = opt.adamw_optimizer(0.1).partition(specs)
    for name, spec in specs.items():
        assert adam_state.mu[name].partition_spec == spec.partition_spec
        assert adam_state.nu[name].partition_spec == spec.partition_spec
    assert adam_state.count.shape == []
    assert adam_state.count.partition_spec == jax.sharding.PartitionSpec()


# ----- chain's args -----
# `chain` configured as AXLearn writes it: transformations in the `args` field (its *args),
# dumped as `args[i]` lines and applied in order (checked against NumPy).


def _chain_config():
    return config_for_function(opt.chain).set(
        args=[
            config_for_function(opt.clip_by_global_norm).set(max_norm=1.0, eps=0.0),
            config_for_function(opt.sgd_optimizer).set(learning_rate=0.5),
        ]
    )


def test_chain_args_dump_as_indexed_lines_and_parse_back():
    text = _chain_config().debug_string()
    assert "args[0].fn: 'axlearn.common.optimizers.clip_by_global_norm'" in text.splitlines()
    assert "args[1].learning_rate: 0.5" in text.splitlines()
    assert parse_flat_text(text).debug_string() == text


def test_chain_args_clip_then_step_in_order():
    chain = _chain_config().instantiate()
    grads = np.asarray([3.0, 4.0])
    updates, _ = chain.update({"w": jnp.asarray(grads)}, chain.init({"w": jnp.zeros(2)}))
    want = -0.5 * grads / np.linalg.norm(grads)  # Clipped to norm 1, then -lr * g.
    np.testing.assert_allclose(updates["w"], want, rtol=1e-6)
