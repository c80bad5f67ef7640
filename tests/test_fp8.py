"""Tests of axlearn.common.fp8, fp8_learner and trainer_config_modifier.FP8ConfigModifier.

The FP8 products are checked against float64 NumPy within the rounding FP8 allows: a
value cast to e4m3 (3 mantissa bits) is off by at most 2**-4 of itself, or half the
smallest subnormal times the scale; e5m2 (2 mantissa bits) by 2**-3.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from axlearn.common import fp8, utils
from axlearn.common.base_layer import WeightWithCopy
from axlearn.common.config import ConfigError, config_for_function
from axlearn.common.fp8_learner import Fp8Learner
from axlearn.common.input_builtin import BuiltinTextInput
from axlearn.common.layers import Linear
from axlearn.common.learner import Learner, weight_decay_scales
from axlearn.common.module import functional
from axlearn.common.optimizers import optax_optimizer
from axlearn.common.mesh_selection import select_mesh_rule
from axlearn.common.trainer_config_modifier import FP8ConfigModifier, apply_mesh_rule
from axlearn.common.utils import flatten_with_paths
from experiments import gpt
from tests.fresh_python import assert_prints_ok
from tests.trainer_script import (
    adamw_learner_config,
    losses_by_step,
    tiny_model_config,
    tiny_trainer_config,
)

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# (largest value, relative rounding, smallest subnormal) of each format.
FORMATS = {E4M3: (448.0, 2.0**-4, 2.0**-9), E5M2: (57344.0, 2.0**-3, 2.0**-16)}


def _reference_scale(x: np.ndarray, dtype) -> float:
    """The smallest power of two that brings max|x| within `dtype`'s range."""
    largest = FORMATS[dtype][0]
    return 2.0 ** math.ceil(math.log2(np.abs(x).max() / largest))


def _rounding_bound(x: np.ndarray, dtype) -> np.ndarray:
    """How far each element of x may move when cast to `dtype` at its reference scale."""
    _, relative, subnormal = FORMATS[dtype]
    return relative * np.abs(x) + 0.5 * subnormal * _reference_scale(x, dtype)


def _einsum(spec: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """np.einsum(spec, a, b), where '...' may also be summed over (NumPy needs letters)."""
    parts = spec.split("->")[0].split(",")
    extra = [x.ndim - len(p.replace("...", "")) for p, x in zip(parts, (a, b)) if "..." in p]
    letters = "ABCDEFG"[: max(extra, default=0)]
    return np.einsum(spec.replace("...", letters), a, b)


def _product_bound(spec: str, a: np.ndarray, a_dtype, b: np.ndarray, b_dtype) -> np.ndarray:
    """A bound on |einsum(q(a), q(b)) - einsum(a, b)| for the casts q, elementwise."""
    da, db = _rounding_bound(a, a_dtype), _rounding_bound(b, b_dtype)
    return (
        _einsum(spec, da, np.abs(b)) + _einsum(spec, np.abs(a), db) + _einsum(spec, da, db)
    ) * (1 + 1e-5) + 1e-12


# The Linear and the attention output projection's products.
SPECS = (
    ("...i,io->...o", (2, 3, 16), (16, 8)),
    ("...nh,dnh->...d", (2, 3, 4, 8), (16, 4, 8)),
)


def _operands(x_shape, w_shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=x_shape) * 3.0
    x.flat[0] = 1e-4  # Below e4m3's normal range at x's scale: rounds as a subnormal.
    w = rng.normal(size=w_shape) * 0.05
    return x.astype(np.float32), w.astype(np.float32)


# ----- scaling -----


@pytest.mark.parametrize(
    "amax, dtype, scale",
    [
        (448.0, E4M3, 1.0),
        (449.0, E4M3, 2.0),
        (1.0, E4M3, 2.0**-8),  # 1 / 448 lies between 2**-9 and 2**-8.
        (3.0e-6, E5M2, 2.0**-34),
        (0.0, E4M3, 1.0),  # Nothing to scale.
        (np.inf, E4M3, 1.0),  # A broken tensor does not spoil the scale.
    ],
)
def test_scale_is_the_smallest_power_of_two_that_fits_the_amax(amax, dtype, scale):
    assert float(fp8.scale_for_amax(jnp.float32(amax), dtype)) == scale


def test_values_beyond_the_range_saturate_instead_of_becoming_nan():
    q = fp8.quantize(jnp.array([1000.0, -1000.0, 3.0]), jnp.float32(1.0), E4M3)
    np.testing.assert_array_equal(q.astype(np.float32), [448.0, -448.0, 3.0])


# ----- the product and its gradients -----


@pytest.mark.parametrize("spec, x_shape, w_shape", SPECS)
def test_forward_is_within_e4m3_rounding_of_the_exact_product(spec, x_shape, w_shape):
    x, w = _operands(x_shape, w_shape)
    y = np.asarray(jax.jit(lambda x, w: fp8.fp8_einsum(spec, x, w))(x, w), np.float64)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    exact = _einsum(spec, x64, w64)
    assert np.all(np.abs(y - exact) <= _product_bound(spec, x64, E4M3, w64, E4M3))
    assert not np.allclose(y, exact, rtol=1e-4)  # The operands were rounded at all.


@pytest.mark.parametrize("spec, x_shape, w_shape", SPECS)
def test_gradients_are_within_e5m2_and_e4m3_rounding_of_the_exact_gradients(
    spec, x_shape, w_shape
):
    x, w = _operands(x_shape, w_shape, seed=1)
    inputs, out = spec.split("->")
    x_axes, w_axes = inputs.split(",")
    y_shape = jax.eval_shape(lambda: jnp.einsum(spec, x, w)).shape
    dy = (np.random.default_rng(2).normal(size=y_shape) * 1e-3).astype(np.float32)

    def loss(x, w):
        return jnp.sum(fp8.fp8_einsum(spec, x, w) * dy)

    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    dx_spec, dw_spec = f"{out},{w_axes}->{x_axes}", f"{x_axes},{out}->{w_axes}"
    dx_exact, dw_exact = _einsum(dx_spec, dy64, w64), _einsum(dw_spec, x64, dy64)
    assert np.all(np.abs(dx - dx_exact) <= _product_bound(dx_spec, dy64, E5M2, w64, E4M3))
    assert np.all(np.abs(dw - dw_exact) <= _product_bound(dw_spec, x64, E4M3, dy64, E5M2))


def test_a_weight_beside_its_copy_gets_its_gradient_in_its_own_dtype():
    x, w = _operands((4, 16), (16, 8))
    dy = np.ones((4, 8), np.float32)

    def loss(x, weight, copy):
        y = fp8.fp8_einsum("...i,io->...o", x, WeightWithCopy(weight, copy))
        return jnp.sum(y.astype(jnp.float32) * dy)

    x16, copy = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    dweight, dcopy = jax.jit(jax.grad(loss, argnums=(1, 2)))(x16, jnp.asarray(w), copy)
    assert dweight.dtype == jnp.float32
    np.testing.assert_array_equal(dcopy, np.zeros_like(w))  # The copy only stands in.
    exact = np.einsum("bi,bo->io", np.asarray(x16, np.float64), dy.astype(np.float64))
    bound = _product_bound("bi,bo->io", np.asarray(x16, np.float64), E4M3, dy, E5M2)
    assert np.all(np.abs(dweight - exact) <= bound)


def test_delayed_scaling_casts_by_the_histories_and_pushes_each_amax_onto_its_own():
    # Scales by hand: input max 2 -> 2**-7 (2 / 448 lies in (2**-8, 2**-7]); weight max 1
    # -> 2**-8; an empty gradient history scales by 1.
    histories = fp8.AmaxHistories(
        input=jnp.array([0.0, 2.0, 0.5]),
        weight=jnp.array([1.0, 0.0, 0.0]),
        output_grad=jnp.zeros(3),
    )
    x, w = jnp.array([[4.0, 0.5]]), jnp.array([[1.0], [1.0]])
    dy = 3e-6

    def loss(x, w, histories):
        return jnp.sum(fp8.fp8_einsum("...i,io->...o", x, w, histories=histories) * dy)

    # 4 / 2**-7 = 512 is beyond e4m3's 448: it saturates to 448 * 2**-7 = 3.5.
    y = fp8.fp8_einsum("...i,io->...o", x, w, histories=histories)
    assert float(y[0, 0]) == 3.5 + 0.5
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    dx, dw, new = grad(x, w, histories)
    np.testing.assert_array_equal(new.input, [4.0, 0.0, 2.0])  # Newest first, oldest dropped.
    np.testing.assert_array_equal(new.weight, [1.0, 1.0, 0.0])
    np.testing.assert_allclose(new.output_grad, [dy, 0.0, 0.0], rtol=1e-7)
    # At scale 1, 3e-6 is below half e5m2's smallest subnormal (2**-16): the first step's
    # gradient is lost, as the module says.
    np.testing.assert_array_equal(dx, [[0.0, 0.0]])
    # With the new history the scale is 2**-34: 3e-6 / 2**-34 = 51539.6 rounds to 49152.
    dx, dw, _ = grad(x, w, new)
    q_dy = 49152 * 2.0**-34
    np.testing.assert_allclose(dx, [[q_dy, q_dy]], rtol=1e-6)
    np.testing.assert_allclose(dw, [[4.0 * q_dy], [0.5 * q_dy]], rtol=1e-6)  # x in range now.


# The ops XLA may find between a dequantization and its dot (it moves them before the GEMM).
_LAYOUT_OPS = {"transpose", "reshape", "broadcast_in_dim", "squeeze", "expand_dims", "copy"}


def _dot_operand_sources(jaxpr, producers=None) -> list[list]:
    """For every dot_general in `jaxpr` (and its sub-jaxprs): the equations producing its
    operands, looking through layout ops and call boundaries."""
    producers = dict(producers or {})
    found = []

    def source(var):
        eqn = producers.get(var) if not hasattr(var, "val") else None  # Literals: no producer.
        while eqn is not None and eqn.primitive.name in _LAYOUT_OPS:
            eqn = producers.get(eqn.invars[0])
        return eqn

    for eqn in jaxpr.eqns:
        for param in eqn.params.values():
            sub = getattr(param, "jaxpr", None)
            if sub is not None and hasattr(sub, "eqns"):
                inner = {i: source(o) for i, o in zip(sub.invars, eqn.invars) if source(o)}
                found += _dot_operand_sources(sub, inner)
        if eqn.primitive.name == "dot_general":
            found.append([source(v) for v in eqn.invars])
        for var in eqn.outvars:
            producers[var] = eqn
    return found


def _dequantized_from(eqn, producers_of) -> str:
    """The FP8 dtype that `eqn` (a multiply by a scale) dequantizes, or '' if it is not one."""
    if eqn is None or eqn.primitive.name != "mul":
        return ""
    for var in eqn.invars:
        convert = producers_of(var)
        if convert is not None and convert.primitive.name == "convert_element_type":
            dtype = convert.invars[0].aval.dtype
            if dtype in (jnp.dtype(E4M3), jnp.dtype(E5M2)):
                return str(dtype)
    return ""


def test_every_dot_reads_fp8_operands_dequantized_right_before_it():
    x, w = (jnp.asarray(a, jnp.bfloat16) for a in _operands((2, 3, 16), (16, 8)))

    def loss(x, w):
        return jnp.sum(fp8.fp8_einsum("...i,io->...o", x, w).astype(jnp.float32) ** 2)

    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(x, w).jaxpr
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    sources = _dot_operand_sources(jaxpr)
    kinds = sorted(
        tuple(sorted(_dequantized_from(e, producers.get) for e in pair)) for pair in sources
    )
    # Forward x @ w, then dx = dy @ w^T and dw = x^T @ dy.
    assert kinds == [
        ("float8_e4m3fn", "float8_e4m3fn"),
        ("float8_e4m3fn", "float8_e5m2"),
        ("float8_e4m3fn", "float8_e5m2"),
    ]


# ----- the layer -----


def _layer(amax_history_length: int) -> fp8.Fp8Matmul:
    cfg = fp8.Fp8Matmul.default_config().set(name="fp8", amax_history_length=amax_history_length)
    return cfg.instantiate(parent=None)


def test_delayed_scaling_keeps_three_zeroed_histories_and_current_scaling_none():
    layer = _layer(5)
    state = layer.initialize_parameters_recursively(jax.random.PRNGKey(0))
    assert sorted(state) == sorted(fp8.AMAX_HISTORY_NAMES)
    assert all(v.shape == (5,) and not np.any(v) for v in state.values())
    specs = layer.create_parameter_specs_recursively().values()
    assert all(spec.weight_decay_scale == 0 for spec in specs)  # No weight decay either.
    assert _layer(0).create_parameter_specs_recursively() == {}


def test_the_layer_scales_by_its_state():
    layer = _layer(2)
    state = dict(
        input_amax_history=jnp.array([2.0, 0.0]),
        weight_amax_history=jnp.array([1.0, 0.0]),
        output_grad_amax_history=jnp.zeros(2),
    )
    x, w = jnp.array([[4.0, 0.5]]), jnp.array([[1.0], [1.0]])
    y, _ = functional(
        layer, state=state, inputs=("...i,io->...o", x, w), prng_key=None, is_training=True,
        method="einsum",
    )
    assert float(y[0, 0]) == 3.5 + 0.5  # x's 4 saturates at scale 2**-7, as computed by hand.


@pytest.mark.parametrize("length", [-1, 1.5, True])
def test_a_bad_history_length_is_rejected_naming_the_field(length):
    with pytest.raises(ConfigError, match=r"fp8\.amax_history_length must be an int >= 0"):
        _layer(length)


# ----- FP8ConfigModifier -----

# The matmul layers of a transformer layer (fused QKV, output projection, gated MLP).
TRANSFORMER_MATMULS = (
    "model.decoder.transformer.layer.feed_forward.linear1",
    "model.decoder.transformer.layer.feed_forward.linear2",
    "model.decoder.transformer.layer.self_attention.attention.input_linear.input_linear.layer",
    "model.decoder.transformer.layer.self_attention.attention.output_linear",
)


def _fp8_config(history: int, **model_kwargs):
    cfg = tiny_trainer_config(trainer_dir=None, max_step=3)
    cfg.model = tiny_model_config(lm_head=Linear.default_config().set(bias=False), **model_kwargs)
    before = cfg.debug_string().splitlines()
    modifier = FP8ConfigModifier.default_config().set(fp8_amax_history_length=history)
    after = modifier.instantiate()(cfg)
    return before, after


def test_fp8_config_modifier_switches_exactly_the_transformer_matmuls():
    before, cfg = _fp8_config(0)
    changed = sorted(set(cfg.debug_string().splitlines()) ^ set(before))
    expected = sorted(
        line
        for path in TRANSFORMER_MATMULS
        for line in (
            f"{path}.fp8.amax_history_length: 0",
            f"{path}.fp8.klass: 'axlearn.common.fp8.Fp8Matmul'",
        )
    )
    # Not the embedding, not the untied lm_head, and current scaling keeps the learner.
    assert changed == expected


def test_fp8_config_modifier_with_delayed_scaling_puts_an_fp8_learner_in_place():
    _, cfg = _fp8_config(16)
    assert cfg.learner.klass is Fp8Learner
    assert cfg.learner.optimizer.fn is not None  # The learner's own fields are kept.
    model = cfg.model.clone(name="model").instantiate(parent=None)
    paths = [p for p, _ in flatten_with_paths(model.create_parameter_specs_recursively())]
    state = [p for p in paths if p.endswith("amax_history")]
    assert len(state) == 3 * 5  # qkv_proj, output_linear, linear1_0, linear1_1, linear2.
    assert all(p.startswith("decoder/transformer/repeat/layer/") for p in state)
    assert "decoder/lm_head/weight" in paths and not any("lm_head/fp8" in p for p in paths)


def test_fp8_config_modifier_refuses_a_model_without_transformer_layers():
    cfg = tiny_trainer_config(trainer_dir=None)
    cfg.model.decoder.transformer = None
    modifier = FP8ConfigModifier.default_config().set(fp8_amax_history_length=4)
    with pytest.raises(ConfigError, match="no TransformerLayer"):
        modifier.instantiate()(cfg)


def test_fp8_config_modifier_with_delayed_scaling_needs_a_plain_learner_to_replace():
    cfg = tiny_trainer_config(trainer_dir=None)
    cfg.learner.klass = type("OtherLearner", (Learner,), {})
    modifier = FP8ConfigModifier.default_config().set(fp8_amax_history_length=4)
    with pytest.raises(ConfigError, match="learner.klass is OtherLearner"):
        modifier.instantiate()(cfg)


@pytest.mark.parametrize(
    "selector, fp8_on",
    [("gpu-h100-1", True), ("gpu-h200-8", True), ("gpu-p5.48xlarge-64", True),
     ("gpu-p4de.24xlarge-64", False), ("cpu", False)],
)
def test_gpt_1b_fp8_trains_in_fp8_on_h100_and_h200_hosts_only(selector, fp8_on):
    cfg = gpt.named_trainer_configs()["gpt_1b_fp8"]()
    cfg = apply_mesh_rule(cfg, select_mesh_rule(cfg.mesh_rules, selector)[1])
    layer = cfg.model.decoder.transformer.layer
    assert (layer.feed_forward.linear2.fp8 is not None) == fp8_on
    assert (cfg.learner.klass is Fp8Learner) == fp8_on


# ----- Fp8Learner -----


def _learners():
    optimizer = config_for_function(optax_optimizer).set(
        transformation=config_for_function(optax.adamw).set(learning_rate=0.1, weight_decay=0.5)
    )
    fp8_learner = Fp8Learner.default_config().set(name="learner", optimizer=optimizer)
    plain = Learner.default_config().set(name="learner", optimizer=optimizer)
    return fp8_learner.instantiate(parent=None), plain.instantiate(parent=None)


def test_fp8_learner_sets_the_state_to_its_gradient_and_optimizes_the_rest_alone():
    learner, plain = _learners()
    params = dict(w=jnp.array([1.0, -2.0]), fp8=dict(input_amax_history=jnp.array([5.0, 0.0])))
    grads = dict(w=jnp.array([0.3, 0.4]), fp8=dict(input_amax_history=jnp.array([7.0, 5.0])))
    state = learner.init(params)
    assert len(jax.tree.leaves(state["optimizer"])) == len(
        jax.tree.leaves(plain.init(dict(w=params["w"]))["optimizer"])
    )  # No optimizer state for the history.
    new, _, summaries = learner.update(params, grads, state)
    expected, _, plain_summaries = plain.update(
        dict(w=params["w"]), dict(w=grads["w"]), plain.init(dict(w=params["w"]))
    )
    np.testing.assert_array_equal(new["fp8"]["input_amax_history"], [7.0, 5.0])
    np.testing.assert_array_equal(new["w"], expected["w"])
    assert float(summaries["gradient_norm"]) == pytest.approx(0.5)  # w's alone.
    assert float(plain_summaries["gradient_norm"]) == pytest.approx(0.5)


def test_fp8_learner_keeps_the_state_where_its_gradient_is_not_finite():
    learner, _ = _learners()
    params = dict(fp8=dict(input_amax_history=jnp.array([5.0, 0.0])), w=jnp.ones(2))
    grads = dict(fp8=dict(input_amax_history=jnp.array([np.inf, 5.0])), w=jnp.ones(2))
    new, _, _ = learner.update(params, grads, learner.init(params))
    np.testing.assert_array_equal(new["fp8"]["input_amax_history"], [5.0, 0.0])


def test_fp8_state_has_no_weight_decay_in_the_regularizer_file():
    _, cfg = _fp8_config(4)
    model = cfg.model.clone(name="model").instantiate(parent=None)
    scales = weight_decay_scales(cfg.learner, model.create_parameter_specs_recursively())
    state = [scale for path, scale in scales.items() if "amax_history" in path]
    assert state and all(scale == 0 for scale in state)


# ----- training -----


def _builtin_input(split: str, is_training: bool) -> BuiltinTextInput.Config:
    return BuiltinTextInput.default_config().set(
        split=split,
        is_training=is_training,
        global_batch_size=8,
        max_sequence_length=64,
        model_vocab_size=384,
    )


def _fp8_trainer_config(trainer_dir: str, **kwargs):
    """The tiny trainer on Python source bytes with FP8 matmuls (delayed scaling over 4
    steps), 10 steps."""
    cfg = tiny_trainer_config(
        trainer_dir=trainer_dir,
        max_step=10,
        model=tiny_model_config(vocab_size=384),
        learner=adamw_learner_config(learning_rate=1e-2),
        input_cfg=_builtin_input("train", True),
        **kwargs,
    )
    return FP8ConfigModifier.default_config().set(fp8_amax_history_length=4).instantiate()(cfg)


@pytest.fixture(name="fp8_run", scope="module")
def fixture_fp8_run(tmp_path_factory):
    """`_fp8_trainer_config` trained to its end (checkpointed there): (dir, trainer)."""
    trainer_dir = str(tmp_path_factory.mktemp("fp8"))
    trainer = _fp8_trainer_config(trainer_dir).instantiate(parent=None)
    trainer.run()
    return trainer_dir, trainer


@pytest.mark.slow
def test_a_small_model_trains_in_fp8_with_falling_loss(fp8_run):
    trainer_dir, _ = fp8_run
    losses = losses_by_step(trainer_dir)
    assert sorted(losses) == list(range(1, 11))
    # From about a uniform guess over 384 ids to a few bits per byte, as in bf16 or float32.
    assert losses[1] > math.log(384) - 0.5 and losses[10] < losses[1] - 2.5, losses


@pytest.mark.slow
def test_the_scaling_state_is_written_each_step_and_checkpointed(fp8_run):
    trainer_dir, trainer = fp8_run
    state = {
        p: v for p, v in flatten_with_paths(trainer.model_params()) if p.endswith("amax_history")
    }
    # [layers, history]: every step pushed a positive amax, all 4 slots filled by step 10.
    assert len(state) == 15 and all(
        v.shape == (2, 4) and np.all(np.asarray(v) > 0) for v in state.values()
    )
    restored = _fp8_trainer_config(trainer_dir).instantiate(parent=None)
    restored.run()  # Restores step 10 and has nothing left to train.
    assert restored.step == 10
    again = dict(flatten_with_paths(restored.model_params()))
    for path, value in state.items():
        np.testing.assert_array_equal(again[path], value)


@pytest.mark.slow
def test_fp8_trains_in_bf16_microbatches_with_carried_weight_copies(tmp_path):
    # The one-GPU path of gpt_1b: each weight reaches the FP8 product beside its bf16 copy.
    cfg = _fp8_trainer_config(str(tmp_path))
    cfg.set(
        max_step=3,
        train_dtype=jnp.bfloat16,
        carry_train_dtype_weights=True,
        per_device_microbatch_size=4,  # 8 rows on one device: 2 microbatches.
    )
    trainer = cfg.instantiate(parent=None, devices=jax.devices()[:1])
    assert trainer.num_microbatches(8) == 2
    trainer.run()
    losses = losses_by_step(str(tmp_path))
    assert losses[3] < losses[1] - 0.5, losses


# Trains the FP8 tiny trainer on one device and on data=2 x fsdp=4 of 8 devices with the
# layers rematerialized (gpt_7b_fp8's setting on a host), then prints both runs' losses and
# scaling state.
_SHARDED_SCRIPT = """
import json, sys
import jax
import numpy as np
from axlearn.common.attention import build_remat_spec
from axlearn.common.trainer_config_modifier import FP8ConfigModifier
from axlearn.common.utils import flatten_with_paths
from tests.trainer_script import losses_by_step, tiny_model_config, tiny_trainer_config

results = {}
for name, mesh, devices, remat in (
    ("single", {}, jax.devices()[:1], None),
    ("sharded", dict(data=2, fsdp=4), None, build_remat_spec()),
):
    trainer_dir = f"{sys.argv[1]}/{name}"
    cfg = tiny_trainer_config(
        trainer_dir=trainer_dir, max_step=4, mesh=mesh, model=tiny_model_config(remat_spec=remat)
    )
    cfg = FP8ConfigModifier.default_config().set(fp8_amax_history_length=4).instantiate()(cfg)
    trainer = cfg.instantiate(parent=None, devices=devices)
    trainer.run()
    losses = losses_by_step(trainer_dir)
    state = {
        path: np.asarray(value).tolist()
        for path, value in flatten_with_paths(trainer.model_params())
        if path.endswith("amax_history")
    }
    results[name] = dict(losses=[losses[s] for s in sorted(losses)], state=state)
print(json.dumps(results))
print("OK")
"""


@pytest.mark.slow
def test_fp8_on_a_sharded_mesh_with_remat_trains_as_on_one_device(tmp_path):
    output = assert_prints_ok(_SHARDED_SCRIPT, str(tmp_path), devices=8)
    results = json.loads(output.splitlines()[-2])
    single, sharded = results["single"], results["sharded"]
    np.testing.assert_allclose(sharded["losses"], single["losses"], rtol=1e-5)
    # Each tensor's amax is taken over the whole tensor, not over a device's shard.
    assert sharded["state"].keys() == single["state"].keys()
    for path, history in single["state"].items():
        np.testing.assert_allclose(sharded["state"][path], history, rtol=1e-5, err_msg=path)


# ----- resuming from a checkpoint saved without FP8 -----


def _fake_restore(saved: dict):
    """A checkpointer's restore over `saved` ({path: value}): the template's paths must be
    exactly the saved ones (ValueError otherwise), as `Checkpointer.restore` checks them."""

    def restore(template):
        wanted = {path for path, _ in flatten_with_paths(template)}
        if wanted != set(saved):
            raise ValueError(f"template {sorted(wanted)} vs checkpoint {sorted(saved)}")
        return 7, jax.tree.map(lambda path, _: saved[path], utils.tree_paths(template), template), {}

    return restore


_HISTORY = "model/layer/fp8/input_amax_history"


def test_a_checkpoint_without_scaling_state_restores_its_weights_beside_fresh_state():
    template = {"model": {"layer": {"weight": 0, "fp8": {"input_amax_history": 0}}}, "prng_key": 0}
    saved = {"model/layer/weight": np.ones(3), "prng_key": np.arange(2)}
    asked = []

    def fresh(paths):
        asked.append(list(paths))
        return {path: np.zeros(4) for path in paths}

    step, state, extra = fp8.restore_with_fresh_scaling_state(_fake_restore(saved), template, fresh)
    assert (step, extra, asked) == (7, {}, [[_HISTORY]])
    np.testing.assert_array_equal(state["model"]["layer"]["weight"], np.ones(3))
    np.testing.assert_array_equal(state["prng_key"], np.arange(2))
    np.testing.assert_array_equal(state["model"]["layer"]["fp8"]["input_amax_history"], np.zeros(4))


def test_a_checkpoint_with_scaling_state_restores_it_without_asking_for_fresh_state():
    template = {"model": {"layer": {"weight": 0, "fp8": {"input_amax_history": 0}}}}
    saved = {"model/layer/weight": np.ones(3), _HISTORY: np.full(4, 2.0)}
    _, state, _ = fp8.restore_with_fresh_scaling_state(
        _fake_restore(saved), template, lambda paths: pytest.fail("asked for fresh state")
    )
    np.testing.assert_array_equal(state["model"]["layer"]["fp8"]["input_amax_history"], np.full(4, 2.0))


def test_a_checkpoint_missing_more_than_scaling_state_raises_the_full_mismatch():
    template = {"model": {"layer": {"weight": 0, "bias": 0, "fp8": {"input_amax_history": 0}}}}
    saved = {"model/layer/weight": np.ones(3)}
    with pytest.raises(ValueError, match="bias.*input_amax_history"):
        fp8.restore_with_fresh_scaling_state(
            _fake_restore(saved), template, lambda paths: pytest.fail("asked for fresh state")
        )


@pytest.mark.slow
def test_an_fp8_run_resumes_from_a_checkpoint_saved_without_fp8(tmp_path):
    trainer_dir = str(tmp_path)
    plain = tiny_trainer_config(
        trainer_dir=trainer_dir,
        max_step=2,
        model=tiny_model_config(vocab_size=384),
        learner=adamw_learner_config(learning_rate=1e-2),
        input_cfg=_builtin_input("train", True),
    ).instantiate(parent=None)
    plain.run()
    saved = dict(flatten_with_paths(plain.model_params()))

    cfg = _fp8_trainer_config(trainer_dir)
    cfg.max_step = 3
    resumed = cfg.instantiate(parent=None)
    resumed._restore_or_init()  # pylint: disable=protected-access
    assert resumed.step == 2
    params = dict(flatten_with_paths(resumed.model_params()))
    histories = {p: v for p, v in params.items() if fp8.is_scaling_state(p)}
    assert len(histories) == 15 and set(params) - set(histories) == set(saved)
    for path, value in histories.items():
        np.testing.assert_array_equal(value, np.zeros((2, 4)), err_msg=path)
    for path, value in saved.items():
        np.testing.assert_array_equal(params[path], value, err_msg=path)

    resumed.run()  # Trains step 3 in FP8 from the restored weights.
    losses = losses_by_step(trainer_dir)
    assert sorted(losses) == [1, 2, 3] and math.isfinite(losses[3])
    after = {p: np.asarray(v) for p, v in flatten_with_paths(resumed.model_params())}
    assert all(np.all(after[p][:, 0] > 0) and np.all(after[p][:, 1:] == 0) for p in histories)
