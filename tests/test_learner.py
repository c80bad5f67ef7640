"""Learner: config surface, gradient accumulation, updates, summaries, frozen parameters,
regularizer dumps and sharded state."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import optimizers as opt
from axlearn.common import schedule
from axlearn.common.base_layer import ParameterSpec
from axlearn.common.config import ConfigError, config_for_function
from axlearn.common.golden_text import parse_flat_text
from axlearn.common.learner import (
    Learner,
    split_microbatches,
    weight_decay_scales,
)
from axlearn.common.summary import WeightedScalar
from tests import reference_spec
from tests.fresh_python import assert_prints_ok

RNG_SEED = 0


def sgd_learner(**kwargs):
    optimizer = config_for_function(opt.skip_and_clip_by_global_norm).set(
        inner=config_for_function(opt.sgd_optimizer).set(learning_rate=0.1),
        drop_norm=100.0,
        max_norm=1.0,
        eps=0.0,
    )
    cfg = Learner.default_config().set(name="learner", optimizer=optimizer, **kwargs)
    return cfg.instantiate(parent=None)


def model_params(rng):
    return {
        "decoder": {
            "emb": {"token_emb": {"weight": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)}},
            "norm": {"scale": jnp.ones(3, jnp.float32)},
            "linear": {"weight": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)},
        }
    }


def specs_of(params):
    return jax.tree.map(lambda p: ParameterSpec(shape=list(p.shape), dtype=p.dtype), params)


# ----- config -----


def test_config_has_the_spec_fields_and_extras_default_to_none():
    cfg = Learner.default_config()
    assert set(cfg.keys()) == {
        "klass", "name", "optimizer", "ema", "enable_per_variable_summaries",
        "update_rules", "ignore_undefined_loss",
    }
    assert cfg.enable_per_variable_summaries is False
    assert cfg.update_rules is None
    assert cfg.ignore_undefined_loss is None
    assert cfg.ema.fn is opt.param_ema


def spec_learner_config():
    mup = [(".*attention/o_proj/weight", 0.25), (".*attention/i_proj/i_proj/qkv_proj/weight", 0.25)]
    mup += [
        (f".*feed_forward/{name}", 0.25)
        for name in ("linear1_0/weight", "linear1_1/weight", "linear2/weight", "wi_0_weight",
                     "wi_1_weight", "wo_weight")
    ]
    inner = config_for_function(opt.adastar_optimizer).set(
        learning_rate=0.01, gradient_ema_decay=None, gradient_ema_debias=None,
        gradient_square_ema_decay=0.95, gradient_square_ema_debias=True, eps=0, eps_square=1e-30,
        raw_update_clipping_threshold=1.0, update_ema_decay=0.95, update_ema_debias=False,
        weight_decay=0.000316,
        update_schedule=config_for_function(schedule.cosine_with_linear_warmup).set(
            peak_lr=1.0, max_step=750000, warmup_steps=5000, begin_value=0.0, alpha=0.005
        ),
        adam_update_transformation=config_for_function(opt.scale_update_per_param).set(
            per_param_scale=config_for_function(opt.per_param_scale_by_path).set(
                description="scale_by_mup_simple", scale_by_path=mup, default_scale=1.0
            )
        ),
    )
    return Learner.default_config().set(
        optimizer=config_for_function(opt.skip_and_clip_by_global_norm).set(
            inner=inner, drop_norm=100, max_norm=1
        )
    )


@pytest.mark.slow
def test_the_spec_learner_subtree_dumps_byte_for_byte_and_parses_back():
    expected = reference_spec.lines_with_prefix("learner.")
    cfg = spec_learner_config()
    assert cfg.debug_string().splitlines() == expected
    parsed = parse_flat_text("\n".join(expected))
    assert parsed.debug_string() == cfg.debug_string()
    learner = parsed.set(name="learner").instantiate(parent=None)
    params = model_params(np.random.default_rng(RNG_SEED))
    state = learner.init(params)
    _, _, summaries = learner.update(params, jax.tree.map(jnp.ones_like, params), state)
    # The first update reads the schedule at step 1, as AXLearn's learner does: the spec's
    # learning_rate 0.01 x peak_lr 1.0 x 1/5000 of its linear warmup.
    np.testing.assert_allclose(float(summaries["learning_rate"]), 0.01 * 1.0 / 5000, rtol=1e-6)


def test_bad_update_rules_name_the_config_path():
    with pytest.raises(ConfigError, match=r"learner.update_rules\[0\].*'freeze'"):
        sgd_learner(update_rules=[(".*", "freeze")])


# ----- gradients -----


def regression_loss(params, inputs, prng_key):
    del prng_key
    pred = jnp.tanh(inputs["x"] @ params["w"]) @ params["v"]
    per_example = jnp.square(pred[:, 0] - inputs["y"])
    aux = dict(
        mse=WeightedScalar(mean=jnp.mean(per_example), weight=jnp.float32(per_example.shape[0])),
        examples=jnp.int32(per_example.shape[0]),
    )
    return jnp.mean(per_example), aux


@pytest.mark.slow
def test_gradient_accumulation_equals_one_full_batch_step():
    rng = np.random.default_rng(RNG_SEED)
    params = {"w": jnp.asarray(rng.normal(size=(4, 6)), jnp.float32),
              "v": jnp.asarray(rng.normal(size=(6, 1)), jnp.float32)}
    inputs = {"x": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
              "y": jnp.asarray(rng.normal(size=(8,)), jnp.float32)}
    learner = sgd_learner()
    key = jax.random.PRNGKey(0)
    loss, aux, grads = learner.compute_gradients(regression_loss, params, inputs, key)
    acc_loss, acc_aux, acc_grads = jax.jit(
        lambda p, i: learner.compute_gradients(regression_loss, p, i, key, num_microbatches=4)
    )(params, inputs)
    np.testing.assert_allclose(acc_loss, loss, rtol=1e-6)
    for name in params:
        np.testing.assert_allclose(acc_grads[name], grads[name], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(acc_aux["mse"].mean, aux["mse"].mean, rtol=1e-6)
    assert float(acc_aux["mse"].weight) == 8.0 and int(acc_aux["examples"]) == 8
    # The same optimizer step follows from either.
    state = learner.init(params)
    new_full, _, _ = learner.update(params, grads, state)
    new_acc, _, _ = learner.update(params, acc_grads, state)
    for name in params:
        np.testing.assert_allclose(new_acc[name], new_full[name], rtol=1e-6, atol=1e-6)


def test_microbatch_i_holds_every_kth_row():
    x = np.arange(24).reshape(12, 2)
    split = np.asarray(split_microbatches(jnp.asarray(x), k=3))
    assert split.shape == (3, 4, 2)
    for i in range(3):
        np.testing.assert_array_equal(split[i], x[i::3])


SPLIT_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec
    from axlearn.common.learner import split_microbatches
    from axlearn.common.sharding import create_mesh

    mesh = create_mesh((8,), ("fsdp",))  # Auto axes, as the trainer's.
    x = jax.device_put(
        jnp.arange(32 * 3, dtype=jnp.float32).reshape(32, 3),
        NamedSharding(mesh, PartitionSpec("fsdp", None)),
    )

    def row_sums(x, split):
        # One microbatch at a time, as gradient accumulation runs them.
        return jax.lax.scan(lambda c, m: (c, jnp.sum(m, axis=1)), 0.0, split(x))[1]

    strided = jax.jit(lambda x: row_sums(x, lambda a: split_microbatches(a, k=2)))
    contiguous = jax.jit(lambda x: row_sums(x, lambda a: a.reshape((2, 16, 3))))
    collectives = ("all-to-all", "all-gather", "collective-permute", "all-reduce")
    moved = lambda f: [c for c in collectives if c in f.lower(x).compile().as_text()]
    assert moved(strided) == [], moved(strided)
    # The contiguous split puts each microbatch on half of the devices: data must move.
    assert moved(contiguous), "the contiguous split was expected to move data"
    np.testing.assert_array_equal(strided(x), np.asarray(x).reshape(16, 2, 3).sum(2).T)
    print("OK")
    """
)


@pytest.mark.slow
def test_strided_microbatches_of_a_sharded_batch_stay_on_their_devices():
    assert_prints_ok(SPLIT_SCRIPT, devices=8)


def test_gradient_accumulation_rejects_a_batch_it_cannot_split():
    learner = sgd_learner()
    params = {"w": jnp.zeros((4, 6)), "v": jnp.zeros((6, 1))}
    inputs = {"x": jnp.zeros((8, 4)), "y": jnp.zeros((8,))}
    with pytest.raises(ValueError, match="input 'x' of shape \\(8, 4\\).* into 3 gradient"):
        learner.compute_gradients(regression_loss, params, inputs, None, num_microbatches=3)


@pytest.mark.parametrize("count", [0, -1, 2.0])
def test_gradient_accumulation_rejects_a_count_that_is_not_a_positive_int(count):
    params = {"w": jnp.zeros((4, 6)), "v": jnp.zeros((6, 1))}
    inputs = {"x": jnp.zeros((8, 4)), "y": jnp.zeros((8,))}
    with pytest.raises(ValueError, match="learner: num_microbatches must be an int >= 1"):
        sgd_learner().compute_gradients(regression_loss, params, inputs, None, num_microbatches=count)


# ----- updates and summaries -----


def test_update_applies_the_optimizer_and_reports_norms():
    rng = np.random.default_rng(RNG_SEED)
    params = model_params(rng)
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
    learner = sgd_learner()
    state = learner.init(params)
    new_params, _, summaries = jax.jit(learner.update)(params, grads, state)
    g = np.concatenate([np.ravel(x) for x in jax.tree.leaves(grads)]).astype(np.float64)
    scale = min(1.0, 1.0 / np.linalg.norm(g))  # max_norm=1.
    expected = jax.tree.map(lambda p, g_: p - 0.1 * scale * g_, params, grads)
    for got, want in zip(jax.tree.leaves(new_params), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(summaries["gradient_norm"], np.linalg.norm(g), rtol=1e-6)
    # Opt-in (enable_per_variable_summaries); the trainer reports the parameter norm.
    assert "update_norm" not in summaries and "parameter_norm" not in summaries
    np.testing.assert_allclose(summaries["learning_rate"], 0.1, rtol=1e-7)
    assert int(summaries["skipped_steps"]) == 0


def test_skipped_steps_are_counted_and_leave_params_unchanged():
    params = model_params(np.random.default_rng(RNG_SEED))
    learner = sgd_learner()
    state = learner.init(params)
    bad = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), params)
    new_params, state, summaries = learner.update(params, bad, state)
    new_params, state, summaries = learner.update(new_params, bad, state)
    assert int(summaries["skipped_steps"]) == 2
    for got, want in zip(jax.tree.leaves(new_params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(got, want)


def test_skipped_steps_is_zero_without_skip_and_clip():
    cfg = Learner.default_config().set(
        name="learner", optimizer=config_for_function(opt.adamw_optimizer).set(learning_rate=0.1)
    )
    learner = cfg.instantiate(parent=None)
    params = {"w": jnp.ones(3)}
    _, _, summaries = learner.update(params, {"w": jnp.ones(3)}, learner.init(params))
    assert int(summaries["skipped_steps"]) == 0


def test_no_update_params_are_unchanged_and_have_no_optimizer_state():
    params = model_params(np.random.default_rng(RNG_SEED))
    cfg = Learner.default_config().set(
        name="learner",
        optimizer=config_for_function(opt.adamw_optimizer).set(learning_rate=0.1),
        update_rules=[(".*/norm/.*", "no_update"), (".*", "all")],
    )
    learner = cfg.instantiate(parent=None)
    state = learner.init(params)
    adam = state["optimizer"][0]
    assert adam.mu["decoder"]["norm"]["scale"] is None
    assert adam.mu["decoder"]["linear"]["weight"].shape == (3, 2)
    specs = learner.create_state_partition_specs(specs_of(params))
    assert jax.tree.structure(specs) == jax.tree.structure(state)
    grads = jax.tree.map(jnp.ones_like, params)
    new_params, new_state, _ = learner.update(params, grads, state)
    np.testing.assert_array_equal(new_params["decoder"]["norm"]["scale"], np.ones(3))
    linear = params["decoder"]["linear"]["weight"]
    assert not np.allclose(new_params["decoder"]["linear"]["weight"], linear)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)


def test_per_variable_summaries_name_each_parameter():
    params = model_params(np.random.default_rng(RNG_SEED))
    learner = sgd_learner(enable_per_variable_summaries=True)
    grads = jax.tree.map(jnp.ones_like, params)
    _, _, summaries = learner.update(params, grads, learner.init(params))
    norm = summaries["gradient_norm/decoder/norm/scale"]
    np.testing.assert_allclose(norm, np.sqrt(3.0), rtol=1e-6)
    g = np.sqrt(sum(x.size for x in jax.tree.leaves(grads)))
    scale = min(1.0, 1.0 / g)  # max_norm=1.
    np.testing.assert_allclose(summaries["update_norm"], 0.1 * scale * g, rtol=1e-5)
    p_new = jax.tree.map(lambda p: np.asarray(p) - 0.1 * scale, params)
    want = np.linalg.norm(np.concatenate([np.ravel(x) for x in jax.tree.leaves(p_new)]))
    np.testing.assert_allclose(summaries["parameter_norm"], want, rtol=1e-5)
    assert "parameter_norm/decoder/linear/weight" in summaries
    assert "update_norm/decoder/emb/token_emb/weight" in summaries


def test_ema_tracks_the_updated_parameters():
    params = {"w": jnp.zeros(2)}
    cfg = Learner.default_config().set(
        name="learner",
        optimizer=config_for_function(opt.sgd_optimizer).set(learning_rate=1.0),
        ema=config_for_function(opt.param_ema).set(decay=0.5),
    )
    learner = cfg.instantiate(parent=None)
    state = learner.init(params)
    params, state, _ = learner.update(params, {"w": -jnp.ones(2)}, state)  # w = 1.
    params, state, _ = learner.update(params, {"w": -jnp.ones(2)}, state)  # w = 2.
    # Debiased: (0.5 * 0.5 * 1 + 0.5 * 2) / (1 - 0.25) = 5/3.
    np.testing.assert_allclose(state["ema"].ema["w"], [5 / 3, 5 / 3], rtol=1e-6)


def test_param_specs_give_the_optimizer_weight_decay_scales():
    params = model_params(np.random.default_rng(RNG_SEED))
    specs = specs_of(params)
    specs["decoder"]["norm"]["scale"].weight_decay_scale = 0.0
    cfg = Learner.default_config().set(
        name="learner",
        optimizer=config_for_function(opt.sgd_optimizer).set(learning_rate=1.0, weight_decay=0.1),
    )
    learner = cfg.instantiate(parent=None)
    zeros = jax.tree.map(jnp.zeros_like, params)
    new_params, _, _ = learner.update(
        params, zeros, learner.init(params, param_specs=specs), param_specs=specs
    )
    np.testing.assert_array_equal(new_params["decoder"]["norm"]["scale"], np.ones(3))
    np.testing.assert_allclose(
        new_params["decoder"]["linear"]["weight"],
        0.9 * params["decoder"]["linear"]["weight"],
        rtol=1e-6,
    )


# ----- effective weight-decay scales -----


def test_weight_decay_scales_multiply_spec_and_path_scales_and_zero_frozen_parameters():
    params = model_params(np.random.default_rng(RNG_SEED))
    specs = specs_of(params)
    specs["decoder"]["norm"]["scale"].weight_decay_scale = 0.0
    cfg = Learner.default_config().set(
        optimizer=config_for_function(opt.adamw_optimizer).set(
            learning_rate=0.1,
            weight_decay=0.1,
            weight_decay_per_param_scale=config_for_function(opt.per_param_scale_by_path).set(
                description="wd", scale_by_path=[(".*linear.*", 0.25)]
            ),
        ),
        update_rules=[(".*emb.*", "no_update")],
    )
    assert weight_decay_scales(cfg, specs) == {
        "decoder/emb/token_emb/weight": 0.0,
        "decoder/linear/weight": 0.25,
        "decoder/norm/scale": 0.0,
    }


def test_weight_decay_scales_of_the_spec_learner_are_all_one_without_spec_scales():
    params = model_params(np.random.default_rng(RNG_SEED))
    scales = weight_decay_scales(spec_learner_config(), specs_of(params))
    assert scales == {
        "decoder/emb/token_emb/weight": 1.0, "decoder/linear/weight": 1.0, "decoder/norm/scale": 1.0
    }


# ----- sharding -----

SHARDED_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    import numpy as np
    from axlearn.common import optimizers as opt
    from axlearn.common.base_layer import ParameterSpec
    from axlearn.common.config import config_for_function
    from axlearn.common.learner import Learner

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "model"))
    specs = {
        "w": ParameterSpec(shape=[16, 8], dtype=jnp.float32, mesh_axes=("fsdp", "model")),
        "norm": ParameterSpec(shape=[8], dtype=jnp.float32, mesh_axes=(None,)),
    }
    adastar = config_for_function(opt.adastar_optimizer).set(
        learning_rate=0.1, gradient_ema_decay=None, gradient_ema_debias=None,
        gradient_square_ema_decay=0.95, gradient_square_ema_debias=True, eps=0.0,
        eps_square=1e-30, raw_update_clipping_threshold=1.0, update_ema_decay=0.9,
        update_ema_debias=False, update_schedule=1.0)
    optimizer = config_for_function(opt.skip_and_clip_by_global_norm).set(
        inner=adastar, drop_norm=100.0, max_norm=1.0)
    learner = Learner.default_config().set(
        name="learner", optimizer=optimizer, update_rules=[("norm", "no_update")],
        ema=config_for_function(opt.param_ema).set(decay=0.9)).instantiate(parent=None)
    to_sharding = lambda s: NamedSharding(mesh, s.partition_spec)
    is_spec = lambda x: isinstance(x, ParameterSpec)
    state_shardings = jax.tree.map(
        to_sharding, learner.create_state_partition_specs(specs), is_leaf=is_spec)
    param_shardings = jax.tree.map(to_sharding, specs, is_leaf=is_spec)
    params = jax.jit(lambda: jax.tree.map(lambda s: jnp.ones(s.shape), specs, is_leaf=is_spec),
                     out_shardings=param_shardings)()
    state = jax.jit(lambda p: learner.init(p, param_specs=specs),
                    out_shardings=state_shardings)(params)
    step = jax.jit(lambda p, g, s: learner.update(p, g, s, param_specs=specs)[:2],
                   out_shardings=(param_shardings, state_shardings))
    params, state = step(params, jax.tree.map(jnp.ones_like, params), state)
    adastar_state = state["optimizer"].inner_state[0]
    v = adastar_state.gradient_square_ema["w"]
    assert v.sharding.spec == jax.sharding.PartitionSpec("fsdp", "model"), v.sharding
    assert v.addressable_shards[0].data.shape == (4, 4)
    assert adastar_state.update_ema["w"].addressable_shards[0].data.shape == (4, 4)
    assert adastar_state.gradient_ema["w"] is None and adastar_state.update_ema["norm"] is None
    assert float(params["norm"][0]) == 1.0 and float(params["w"][0, 0]) != 1.0
    assert state["ema"].ema["w"].addressable_shards[0].data.shape == (4, 4)
    assert state["optimizer"].nonvalid_count.sharding.is_fully_replicated
    print("OK")
    """
)


@pytest.mark.slow
def test_learner_state_is_sharded_like_the_parameters_on_a_mesh():
    assert_prints_ok(SHARDED_SCRIPT, devices=8)


# ----- undefined losses -----
# Learner.ignore_undefined_loss: a step with a NaN or infinite loss is undone, a finite one
# is the plain SGD step (checked against NumPy).


LR = 0.1


def _learner(ignore: bool):
    sgd = config_for_function(opt.sgd_optimizer).set(learning_rate=LR)
    cfg = Learner.default_config().set(name="learner", optimizer=sgd, ignore_undefined_loss=ignore)
    return cfg.instantiate(parent=None)


PARAMS = {"w": jnp.asarray([1.0, -2.0, 3.0])}


GRADS = {"w": jnp.asarray([0.5, 0.25, -1.0])}


def test_finite_loss_steps_like_sgd_and_counts_nothing():
    learner = _learner(True)
    params, state, summaries = learner.update(
        PARAMS, GRADS, learner.init(PARAMS), loss=jnp.float32(2.0)
    )
    want = np.asarray(PARAMS["w"]) - LR * np.asarray(GRADS["w"])
    np.testing.assert_allclose(params["w"], want, rtol=1e-6)
    assert int(state["undefined_loss_steps"]) == 0 and int(summaries["skipped_steps"]) == 0


def test_undefined_loss_leaves_params_and_state_unchanged_and_counts_a_skipped_step():
    learner = _learner(True)
    state0 = learner.init(PARAMS)
    params, state, _ = learner.update(PARAMS, GRADS, state0, loss=jnp.float32(2.0))
    for bad in (jnp.nan, jnp.inf):
        undone, undone_state, summaries = learner.update(
            params, GRADS, state, loss=jnp.float32(bad)
        )
        np.testing.assert_array_equal(undone["w"], params["w"])
        for key in ("optimizer", "ema"):
            for got, want in zip(jax.tree.leaves(undone_state[key]), jax.tree.leaves(state[key])):
                np.testing.assert_array_equal(got, want)
        state = undone_state
    assert int(state["undefined_loss_steps"]) == 2 and int(summaries["skipped_steps"]) == 2


def test_without_the_flag_an_undefined_loss_still_updates():
    learner = _learner(False)
    state0 = learner.init(PARAMS)
    params, state, _ = learner.update(PARAMS, GRADS, state0, loss=jnp.float32(jnp.nan))
    assert "undefined_loss_steps" not in state
    np.testing.assert_allclose(params["w"], np.asarray(PARAMS["w"]) - LR * np.asarray(GRADS["w"]))


# ----- schedules stepped as AXLearn's, and checkpoints from before -----


def _restore_refusing(missing: str):
    """A checkpointer's restore into a template, of a checkpoint lacking learner/`missing`
    (ValueError for a template that asks for it, as the checkpointer raises)."""

    def restore(template):
        if missing in template["learner"]:
            raise ValueError(f"learner/{missing} is not in the checkpoint")
        return 7, jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), template), {}

    return restore


def test_a_state_saved_before_the_step_rule_restores_with_the_legacy_base():
    from axlearn.common.learner import restore_with_legacy_schedule_step

    template = {"learner": {"optimizer": jax.ShapeDtypeStruct([], jnp.int32),
                            "schedule_step_base": jax.ShapeDtypeStruct([], jnp.int32)}}
    step, state, _ = restore_with_legacy_schedule_step(
        _restore_refusing("schedule_step_base"), template
    )
    assert step == 7 and int(state["learner"]["schedule_step_base"]) == 0
    with pytest.raises(ValueError, match="learner/optimizer"):  # Other mismatches raise.
        restore_with_legacy_schedule_step(_restore_refusing("optimizer"), template)


def test_a_new_learner_state_steps_as_axlearn_and_reports_step_one_first():
    cfg = Learner.default_config().set(
        name="learner",
        optimizer=config_for_function(opt.sgd_optimizer).set(
            learning_rate=config_for_function(schedule.polynomial).set(
                begin_value=0.0, end_step=100, end_value=1.0
            )
        ),
    )
    learner = cfg.instantiate(parent=None)
    params = {"w": jnp.ones(2)}
    state = learner.init(params)
    assert int(state["schedule_step_base"]) == schedule.UPDATE_STEP_BASE
    new_params, state, summaries = learner.update(params, {"w": jnp.ones(2)}, state)
    assert float(summaries["learning_rate"]) == pytest.approx(0.01)  # Step 1.
    np.testing.assert_allclose(new_params["w"], 1 - 0.01, rtol=1e-6)
    legacy = dict(state, schedule_step_base=jnp.asarray(0, jnp.int32))
    _, _, summaries = learner.update(params, {"w": jnp.ones(2)}, legacy)
    assert float(summaries["learning_rate"]) == pytest.approx(0.01)  # After 1 update: count 1.


def _schedule_trainer(trainer_dir, max_step: int):
    from tests.trainer_script import tiny_trainer_config  # pylint: disable=import-outside-toplevel

    lr = config_for_function(schedule.polynomial).set(begin_value=0.0, end_step=100, end_value=0.1)
    learner = Learner.default_config().set(
        optimizer=config_for_function(opt.adamw_optimizer).set(learning_rate=lr)
    )
    return tiny_trainer_config(
        trainer_dir=str(trainer_dir), max_step=max_step, learner=learner, save_every_n_steps=2
    ).instantiate(parent=None)


def _learning_rates(trainer_dir) -> dict[int, float]:
    from tests.trainer_script import read_metrics  # pylint: disable=import-outside-toplevel

    return {r["step"]: r["learner/learning_rate"] for r in read_metrics(str(trainer_dir))}


@pytest.mark.slow  # Trains, saves and restores three tiny runs.
def test_a_checkpoint_written_by_the_old_rule_resumes_on_its_old_curve(tmp_path):
    from axlearn.common.checkpointer import Checkpointer  # pylint: disable=import-outside-toplevel

    new_dir, old_dir = tmp_path / "new", tmp_path / "old"
    trainer = _schedule_trainer(new_dir, max_step=2)
    trainer.run()
    # What the code before the rule saved at step 2: the same state, no schedule_step_base.
    state = {"prng_key": trainer._state.prng_key, "model": trainer._state.model,
             "learner": {k: v for k, v in trainer._state.learner.items()
                         if k != "schedule_step_base"}}
    old = Checkpointer.default_config().set(name="ckpt", dir=str(old_dir / "checkpoints"))
    old = old.instantiate(parent=None)
    old.save(2, state)
    old.wait_until_finished()
    # lr(step) = step / 1000: the update after c updates is step c + 1 ...
    np.testing.assert_allclose([_learning_rates(new_dir)[s] for s in (1, 2)], [1e-3, 2e-3])
    _schedule_trainer(new_dir, max_step=4).run()
    np.testing.assert_allclose([_learning_rates(new_dir)[s] for s in (3, 4)], [3e-3, 4e-3])
    # ... and a run from an old checkpoint goes on at the count, as the old rule did, also
    # after its own checkpoint (saved with base 0) restores.
    _schedule_trainer(old_dir, max_step=4).run()
    _schedule_trainer(old_dir, max_step=6).run()
    np.testing.assert_allclose(
        [_learning_rates(old_dir)[s] for s in (3, 4, 5, 6)], [2e-3, 3e-3, 4e-3, 5e-3]
    )
