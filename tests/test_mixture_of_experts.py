"""mixture_of_experts: routing against NumPy, capacity dropping by hand, auxiliary losses
by their formulas, expert parallelism against one device, FLOPs on active parameters, and
moe_test training and resuming."""

import importlib.machinery
import importlib.util
import re
import subprocess
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common.causal_lm import active_matmul_parameter_count, matmul_parameter_count
from axlearn.common.config import ConfigError
from axlearn.common.golden_text import parse_flat_text
from axlearn.common.hf_llama import llama_model_config
from axlearn.common.hf_mixtral import mixtral_model_config
from axlearn.common.layers import RMSNorm
from axlearn.common.mixture_of_experts import (
    GMMBackend,
    Top2Gating,
    TopKDropFreeGating,
    TransformerFeedForwardDropFreeMoE,
    TransformerFeedForwardMoE,
)
from axlearn.common.module import functional as F
from axlearn.common.param_init import default_initializer_config
from tests.fresh_python import REPO, assert_prints_ok, fresh_env

DIM, HIDDEN, EXPERTS, TOP_K = 8, 12, 4, 2


def _drop_free_config(**kwargs) -> TransformerFeedForwardDropFreeMoE.Config:
    return TransformerFeedForwardDropFreeMoE.default_config().set(
        name="moe",
        input_dim=DIM,
        hidden_dim=HIDDEN,
        num_experts=EXPERTS,
        activation=("nn.silu", "linear"),
        norm=RMSNorm.default_config(),
        structure="nonorm",
        gating=TopKDropFreeGating.default_config().set(num_experts_per_token=TOP_K),
        load_balance_loss_weight=0.5,
        router_z_loss_weight=0.25,
        param_init=default_initializer_config(),
        **kwargs,
    )


def _np_softmax(logits):
    logits = logits - logits.max(-1, keepdims=True)
    return np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)


@pytest.fixture(name="drop_free", scope="module")
def fixture_drop_free():
    """One forward of the drop-free layer on random tokens: (params, x, y, collection)."""
    layer = _drop_free_config().instantiate(parent=None)
    params = layer.initialize_parameters_recursively(jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 5, DIM))
    forward = jax.jit(lambda p, x: F(layer, state=p, inputs=(x,), prng_key=None, is_training=True))
    y, collection = forward(params, x)
    params = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    return params, np.asarray(x, np.float64), np.asarray(y), collection


def test_drop_free_layer_equals_a_per_token_loop_over_experts_in_numpy(drop_free):
    params, x, y, _ = drop_free
    expected = np.zeros_like(x)
    for index in np.ndindex(x.shape[:-1]):
        token = x[index]
        probs = _np_softmax(token @ params["gate_weight"])
        chosen = np.argsort(-probs)[:TOP_K]
        weights = probs[chosen] / probs[chosen].sum()
        for expert, weight in zip(chosen, weights):
            gate = token @ params["wi_0_weight"][expert]
            up = token @ params["wi_1_weight"][expert]
            hidden = gate / (1 + np.exp(-gate)) * up
            expected[index] += weight * (hidden @ params["wo_weight"][expert])
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


def test_drop_free_aux_loss_is_the_weighted_load_balance_and_z_losses(drop_free):
    params, x, _, collection = drop_free
    logits = x.reshape(-1, DIM) @ params["gate_weight"]
    probs = _np_softmax(logits)
    chosen = np.argsort(-probs, axis=-1)[:, :TOP_K]
    assignment_fraction = np.bincount(chosen.ravel(), minlength=EXPERTS) / chosen.size
    load_balance = EXPERTS * np.sum(assignment_fraction * probs.mean(0))
    z_loss = np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
    summaries = collection.summaries["gating"]
    np.testing.assert_allclose(summaries["load_balance_loss"], load_balance, rtol=1e-5)
    np.testing.assert_allclose(summaries["router_z_loss"], z_loss, rtol=1e-5)
    np.testing.assert_allclose(
        collection.module_outputs["aux_loss"], 0.5 * load_balance + 0.25 * z_loss, rtol=1e-5
    )


# Router logits of 4 tokens over 3 experts (the router is the identity on these inputs):
# first choices e0, e0, e0, e1; second choices e1, e2, e1, e0.
_HAND_LOGITS = np.array(
    [[2.0, 1.0, 0.0], [2.0, -1.0, 0.5], [1.5, 1.0, -1.0], [0.5, 2.0, -2.0]], np.float32
)


def test_capacity_dispatch_drops_what_a_hand_computed_case_drops():
    """Capacity 2 (expert_capacity; int(1.5 x 4 / 3) = 2 does not raise it). First choices claim slots in token order: e0 takes
    t0 (slot 0) and t1 (slot 1) and drops t2; e1 takes t3 (slot 0). Then second choices,
    after them: t0 -> e1 slot 1; t1 -> e2 slot 0; t2 -> e1 is past capacity, as is t3 -> e0
    (e0 is full). So t2 reaches no expert and passes nothing through the layer."""
    cfg = TransformerFeedForwardMoE.default_config().set(
        name="moe",
        input_dim=3,
        hidden_dim=4,
        num_experts=3,
        num_groups=1,
        structure="nonorm",
        gating=Top2Gating.default_config().set(train_capacity_factor=1.5, expert_capacity=2),
        param_init=default_initializer_config(),
    )
    layer = cfg.instantiate(parent=None)
    params = layer.initialize_parameters_recursively(jax.random.PRNGKey(0))
    params["gate_weight"] = jnp.eye(3)
    x = jnp.asarray(_HAND_LOGITS)[None]

    @jax.jit
    def run(params, x):
        y, collection = F(layer, state=params, inputs=(x,), prng_key=None, is_training=True)
        gating, _ = F(layer.gating, state={}, inputs=(x[None],), prng_key=None, is_training=True)
        return y, collection, gating

    y, collection, gating = run(params, x)
    dispatch, combine = np.asarray(gating.dispatch_tensor), np.asarray(gating.combine_tensor)
    expected = np.zeros((4, 3, 2), bool)
    for token, expert, slot in [(0, 0, 0), (1, 0, 1), (3, 1, 0), (0, 1, 1), (1, 2, 0)]:
        expected[token, expert, slot] = True
    np.testing.assert_array_equal(dispatch[0, 0], expected)
    # A kept assignment weighs its expert's probability over that of the token's two choices.
    probs = _np_softmax(_HAND_LOGITS.astype(np.float64))
    choices = [(0, 1), (0, 2), (0, 1), (1, 0)]
    expected_combine = np.zeros((4, 3, 2))
    for token, expert, slot in zip(*np.nonzero(expected)):
        chosen = probs[token, list(choices[token])]
        expected_combine[token, expert, slot] = probs[token, expert] / chosen.sum()
    np.testing.assert_allclose(combine[0, 0], expected_combine, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(y)[0, 2], 0.0)
    assert np.all(np.abs(np.asarray(y)[0, [0, 1, 3]]) > 0)
    summaries = collection.summaries["gating"]
    np.testing.assert_allclose(summaries["over_capacity_1"], 1 / 4, rtol=1e-6)
    np.testing.assert_allclose(summaries["over_capacity_2"], 2 / 4, rtol=1e-6)
    # GShard's loss: E^2 x mean_e(fraction of first choices x mean probability).
    first_choice_fraction = np.array([3, 1, 0]) / 4
    np.testing.assert_allclose(
        summaries["load_balance_loss"], 9 * np.mean(first_choice_fraction * probs.mean(0)),
        rtol=1e-5,
    )


def test_model_flops_count_the_routed_experts_at_k_of_n():
    cfg = mixtral_model_config(
        vocab_size=32, dim=DIM, num_layers=2, num_heads=2, num_kv_heads=1, hidden_dim=HIDDEN,
        num_experts=EXPERTS, num_experts_per_token=TOP_K,
    )
    model = cfg.set(name="model").instantiate(parent=None)
    attention = DIM * (2 + 2 * 1) * (DIM // 2) + DIM * DIM  # Fused QKV (2 q, 1 kv head) + o.
    experts = EXPERTS * 3 * DIM * HIDDEN
    per_layer = attention + DIM * EXPERTS + experts * TOP_K / EXPERTS
    active = 2 * per_layer + DIM * 32  # The untied LM head.
    assert active_matmul_parameter_count(model) == pytest.approx(active)
    assert model.model_flops_per_token(16) == pytest.approx(6 * active + 6 * 2 * 16 * DIM)


def test_dense_models_count_every_matmul_weight_as_before():
    model = llama_model_config(
        vocab_size=32, dim=DIM, num_layers=2, num_heads=2, num_kv_heads=1, hidden_dim=HIDDEN
    ).instantiate(parent=None)
    assert active_matmul_parameter_count(model) == matmul_parameter_count(model)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("structure", "sandwich", "structure"),
        ("expert_parallel_capacity", 0.0, "expert_parallel_capacity"),
        ("dim_to_mesh_axis_map", {"me": (None, None)}, "lacks"),
    ],
)
def test_bad_layer_configs_fail_naming_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message):
        _drop_free_config().set(**{field: value}).instantiate(parent=None)


def test_top_k_above_the_expert_count_fails_naming_the_field():
    cfg = _drop_free_config()
    cfg.gating.num_experts_per_token = EXPERTS + 1
    with pytest.raises(ConfigError, match="num_experts_per_token"):
        cfg.instantiate(parent=None)


_EXPERT_PARALLEL_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    from axlearn.common.base_layer import is_parameter_spec
    from axlearn.common.module import functional as F
    from axlearn.common.sharding import create_mesh, named_sharding
    from tests.test_mixture_of_experts import _drop_free_config
    from axlearn.common.mixture_of_experts import TransformerFeedForwardMoE

    def check(cfg, mesh_shape, axes=("data", "expert", "fsdp", "model")):
        layer = cfg.instantiate(parent=None)
        params = layer.initialize_parameters_recursively(jax.random.PRNGKey(0))
        x = jax.random.normal(jax.random.PRNGKey(1), (8, 4, 8))

        def loss(p, x):
            y, collection = F(layer, state=p, inputs=(x,), prng_key=None, is_training=True)
            return jnp.sum(y * y) + collection.module_outputs["aux_loss"], y

        step = jax.jit(jax.value_and_grad(loss, has_aux=True))
        (expected, y0), grads0 = step(params, x)
        mesh = create_mesh(mesh_shape, axes)
        shardings = jax.tree.map(
            lambda s: named_sharding(mesh, s.partition_spec),
            layer.create_parameter_specs_recursively(), is_leaf=is_parameter_spec)
        with jax.set_mesh(mesh):
            sharded = jax.device_put(params, shardings)
            (actual, y1), grads1 = step(sharded, x)
            hlo = step.lower(sharded, x).compile().as_text()
        assert "all-to-all" in hlo, f"{mesh_shape}: no all-to-all, so no expert parallelism"
        np.testing.assert_allclose(actual, expected, rtol=1e-5)
        np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-6)
        for a, b in zip(jax.tree.leaves(grads1), jax.tree.leaves(grads0)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())

    # Experts over 'expert' (expert parallelism), their model dim over 'fsdp'.
    drop_free = _drop_free_config().set(
        num_experts=8,
        dim_to_mesh_axis_map={
            "me": (None, None), "emh": ("expert", "fsdp", "model"),
            "ehm": ("expert", "model", "fsdp")},
        input_dim_to_partition_spec={"bsm": (("data", "expert", "fsdp"), None, None)},
        output_dim_to_partition_spec={
            "bsm": (("data", "expert", "fsdp"), None, None),
            "emh": ("expert", None, "model"), "ehm": ("expert", "model", None)},
    )
    check(drop_free, (1, 8, 1, 1))  # One expert a device.
    check(drop_free, (2, 2, 2, 1))  # Data parallel x experts over 2 x FSDP over 2.
    # Experts over 2, FSDP over 2, hidden over 2 (model); as the GPU kernels run it
    # (shard_map without its replication check), the CPU multiplying with ragged_dot.
    check(drop_free.clone(grouped_matmul="mosaic_gpu"), (1, 2, 2, 2))
    capacity = TransformerFeedForwardMoE.default_config().set(
        name="moe", input_dim=8, hidden_dim=12, num_experts=8, num_groups=8,
        activation=("nn.silu", "linear"), param_init=drop_free.param_init)
    check(capacity, (2, 4, 1, 1))
    print("OK")
    """
)


@pytest.mark.slow
def test_expert_parallelism_on_8_devices_equals_one_device():
    assert_prints_ok(_EXPERT_PARALLEL_SCRIPT, str(REPO), devices=8)


def _launch(trainer_dir, max_step: int):
    """moe_test through the launcher, cut to `max_step` steps, saving every 4."""
    return subprocess.run(
        [
            sys.executable, "-m", "axlearn.common.launch_trainer_main", "--config=moe_test",
            f"--trainer_dir={trainer_dir}", f"--config_override=max_step={max_step}",
            "--config_override=checkpointer.save_policy.n=4", "--config_override=evalers={}",
            "--config_override=log_every_n_steps=1",
        ],
        cwd=REPO, env=fresh_env(), capture_output=True, text=True, timeout=600, check=False,
    )


def _logged_losses(log: str) -> dict[int, float]:
    return {
        int(m.group(1)): float(m.group(2))
        for m in re.finditer(r"step +(\d+)/\d+ \| loss ([0-9.]+)", log)
    }


@pytest.mark.slow
def test_moe_test_trains_and_resumes(tmp_path):
    """moe_test trains (its loss falls from ln(vocab)), and a second start in the same
    directory restores the last checkpoint and goes on from there."""
    first = _launch(tmp_path, 8)
    assert first.returncode == 0, first.stderr[-3000:]
    losses = _logged_losses(first.stderr)
    assert sorted(losses) == list(range(1, 9)), first.stderr[-3000:]
    assert losses[8] < losses[1] < np.log(384) + 0.5
    second = _launch(tmp_path, 12)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Restored step 8" in second.stderr
    resumed = _logged_losses(second.stderr)
    assert sorted(resumed) == list(range(9, 13))
    assert resumed[12] < losses[1]


def test_row_gathers_take_their_gradient_by_gathering_back():
    """_take_rows's custom backward (a gather by the inverse index) equals autodiff's
    scatter-add, for an index that takes some rows once, drops others, and pads."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.mixture_of_experts import _take_rows

    x = jnp.arange(12.0).reshape(4, 3)
    index = jnp.array([2, 4, 0, 4, 3])  # Row 1 is dropped; 4 (= len(x)) pads with zeros.
    inverse = jnp.array([2, 5, 0, 4])  # Where each row went; 5 (= len(index)): nowhere.
    dy = jnp.arange(15.0).reshape(5, 3) + 1
    expected_y, expected_vjp = jax.vjp(
        lambda x: jnp.take(x, index, axis=0, mode="fill", fill_value=0), x
    )
    y, vjp = jax.vjp(lambda x: _take_rows(x, index, inverse), x)
    np.testing.assert_array_equal(y, expected_y)
    np.testing.assert_array_equal(vjp(dy)[0], expected_vjp(dy)[0])


# ----- AXLearn's fields: corr_loss_weight, mask_dtype, outer_batch -1, hidden_dim rules -----


def _capacity_config(**kwargs) -> TransformerFeedForwardMoE.Config:
    fields = dict(
        name="moe",
        input_dim=3,
        hidden_dim=4,
        num_experts=4,
        num_groups=1,
        structure="nonorm",
        param_init=default_initializer_config(),
    )
    return TransformerFeedForwardMoE.default_config().set(**{**fields, **kwargs})


def _forward(layer, params, x):
    """(outputs, output collection) of one jitted training forward."""
    return jax.jit(lambda p, x: F(layer, state=p, inputs=(x,), prng_key=None, is_training=True))(
        params, x
    )


def test_expert_correlation_loss_is_the_mean_off_identity_cosine_of_router_columns():
    layer = _capacity_config(
        corr_loss_weight=0.5, load_balance_loss_weight=0.0, router_z_loss_weight=0.0
    ).instantiate(parent=None)
    params = layer.initialize_parameters_recursively(jax.random.PRNGKey(0))
    params["gate_weight"] = jnp.asarray(
        [[1.0, 0.0, 1.0, -2.0], [0.0, 1.0, 1.0, 0.5], [0.0, 0.0, 0.0, 1.0]]
    )
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 4, 3))
    _, collection = _forward(layer, params, x)
    w = np.asarray(params["gate_weight"], np.float64)
    norms = np.linalg.norm(w, axis=0)
    cosines = np.array([[w[:, e] @ w[:, f] for f in range(4)] for e in range(4)])
    cosines /= norms[:, None] * norms[None, :]
    off_identity = np.abs(cosines - np.eye(4))
    loss = 0.5 * off_identity.sum() / 16
    summaries = collection.summaries
    np.testing.assert_allclose(summaries["expert_cov_loss"], loss, rtol=1e-6)
    np.testing.assert_allclose(summaries["expert_cov_max"], off_identity.max(), rtol=1e-6)
    np.testing.assert_allclose(collection.module_outputs["aux_loss"], 0.5 * loss, rtol=1e-6)


def test_top2_mask_dtype_changes_no_routing_decision():
    logits = jax.random.normal(jax.random.PRNGKey(2), (1, 2, 6, 4)) * 3
    outputs = []
    for mask_dtype in (jnp.int32, jnp.float32):
        gating = Top2Gating.default_config().set(
            name="gating", num_experts=4, mask_dtype=mask_dtype, train_capacity_factor=1.0
        ).instantiate(parent=None)
        out, _ = _forward(gating, {}, logits)
        outputs.append(out)
    ints, floats = outputs
    assert ints.dispatch_tensor.dtype == jnp.bool_
    np.testing.assert_array_equal(ints.dispatch_tensor, floats.dispatch_tensor)
    np.testing.assert_array_equal(ints.combine_tensor, floats.combine_tensor)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(outer_batch=0), "outer_batch"),
        (dict(outer_batch=-2), "outer_batch"),
        (dict(corr_loss_weight=-1.0), "corr_loss_weight"),
        (dict(gating=Top2Gating.default_config().set(mask_dtype=jnp.bool_)), "mask_dtype"),
    ],
)
def test_bad_capacity_layer_fields_fail_naming_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        _capacity_config(**kwargs).instantiate(parent=None)


def test_outer_batch_minus_one_is_the_mesh_size_of_the_outer_dim_axes():
    axes = dict(TransformerFeedForwardMoE.default_config().dim_to_mesh_axis_map)
    axes["ogsm"] = (("data", "fsdp"), "expert", None, "model")
    layer = _capacity_config(outer_batch=-1, dim_to_mesh_axis_map=axes).instantiate(parent=None)
    assert layer.outer_batch() == 1  # No mesh.
    mesh = jax.sharding.AbstractMesh((2, 4, 3), ("data", "fsdp", "expert"))
    with jax.sharding.use_abstract_mesh(mesh):
        assert layer.outer_batch() == 2 * 4


def test_hidden_dim_rule_gives_the_moe_layer_the_dense_layer_hidden_dim():
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.attention import TransformerFeedForwardLayer
    from axlearn.common.config import config_for_function  # pylint: disable=C0415
    from axlearn.experiments.text.gpt.common import scale_fn  # pylint: disable=C0415

    rule = config_for_function(scale_fn).set(scale=8 / 3, round_up_to_multiples_of=16)
    moe = _capacity_config(input_dim=8, hidden_dim=rule).instantiate(parent=None)
    dense = TransformerFeedForwardLayer.default_config().set(
        name="ff", input_dim=8, hidden_dim=rule
    ).instantiate(parent=None)
    assert moe.hidden_dim == dense.hidden_dim == 32  # 8 x 8/3 = 21.3, up to a multiple of 16.


@pytest.mark.parametrize(
    "group_size, factor, least, expected",
    [(4, 1.5, None, 1), (16, 2.0, None, 8), (24, 2.0, None, 12), (40, 1.0, None, 8),
     (40, 1.0, 12, 12), (40, 2.0, 3, 16)],
)
def test_expert_capacity_is_axlearn_s_rounded_to_a_multiple_of_four(
    group_size, factor, least, expected
):
    """int(group x factor / experts) over 5 experts, rounded up to a multiple of 4, unless
    expert_capacity is at least that."""
    gating = Top2Gating.default_config().set(
        name="gating", num_experts=5, train_capacity_factor=factor, expert_capacity=least
    ).instantiate(parent=None)
    capacity, _ = F(
        gating, state={}, inputs=(group_size,), prng_key=None, is_training=True,
        method="expert_capacity",
    )
    assert capacity == expected


# ----- gmm_backend: AXLearn's choice of grouped matmul -----


def _np_drop_free(params, x):
    """The drop-free layer as a per-token loop over its top-k experts, in NumPy."""
    expected = np.zeros_like(x)
    for index in np.ndindex(x.shape[:-1]):
        token = x[index]
        probs = _np_softmax(token @ params["gate_weight"])
        chosen = np.argsort(-probs)[:TOP_K]
        for expert, weight in zip(chosen, probs[chosen] / probs[chosen].sum()):
            gate = token @ params["wi_0_weight"][expert]
            hidden = gate / (1 + np.exp(-gate)) * (token @ params["wi_1_weight"][expert])
            expected[index] += weight * (hidden @ params["wo_weight"][expert])
    return expected


def _fake_tokamax(monkeypatch, calls):
    """A stand-in `tokamax` package whose ragged_dot records its implementation argument
    and multiplies group by group in NumPy."""

    def ragged_dot(lhs, rhs, group_sizes, *, implementation=None):
        calls.append(implementation)

        def groupwise(lhs, rhs, group_sizes):
            ends = np.cumsum(group_sizes)
            out = np.zeros((lhs.shape[0], rhs.shape[-1]), lhs.dtype)
            for g, (start, end) in enumerate(zip(ends - group_sizes, ends)):
                out[start:end] = lhs[start:end] @ rhs[g]
            return out

        shape = jax.ShapeDtypeStruct((lhs.shape[0], rhs.shape[-1]), lhs.dtype)
        return jax.pure_callback(groupwise, shape, lhs, rhs, group_sizes)

    module = types.ModuleType("tokamax")
    module.__spec__ = importlib.machinery.ModuleSpec("tokamax", None)
    module.ragged_dot = ragged_dot
    monkeypatch.setitem(sys.modules, "tokamax", module)


@pytest.mark.parametrize(
    "backend",  # Pallas runs interpreted on the CPU: seconds, so in the whole suite only.
    [pytest.param(b, marks=pytest.mark.slow) if b is GMMBackend.PALLAS else b for b in GMMBackend],
)
def test_every_gmm_backend_equals_the_numpy_loop_over_experts(monkeypatch, backend):
    calls = []
    _fake_tokamax(monkeypatch, calls)
    implementation = ["triton", "xla"] if backend is GMMBackend.TOKAMAX else None
    layer = _drop_free_config(
        gmm_backend=backend, tokamax_implementation=implementation
    ).instantiate(parent=None)
    params = layer.initialize_parameters_recursively(jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 5, DIM))
    y, _ = F(layer, state=params, inputs=(x,), prng_key=None, is_training=False)
    params = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    np.testing.assert_allclose(y, _np_drop_free(params, np.asarray(x, np.float64)), atol=1e-5)
    # Forward: the two input projections and the output one.
    assert calls == ([("triton", "xla")] * 3 if backend is GMMBackend.TOKAMAX else [])


def test_tokamax_backend_without_tokamax_fails_naming_the_field(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokamax", None)  # Not importable.
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "tokamax" else real_find_spec(name, *args),
    )
    with pytest.raises(ConfigError, match=r"moe\.gmm_backend: GMMBackend.TOKAMAX needs tokamax"):
        _drop_free_config(gmm_backend=GMMBackend.TOKAMAX).instantiate(parent=None)


def test_tokamax_implementation_without_the_tokamax_backend_is_refused():
    cfg = _drop_free_config(gmm_backend=GMMBackend.PALLAS, tokamax_implementation=["xla"])
    with pytest.raises(ConfigError, match=r"moe\.tokamax_implementation is set"):
        cfg.instantiate(parent=None)


def test_axlearn_gmm_backend_golden_lines_parse_dump_back_and_instantiate(monkeypatch):
    _fake_tokamax(monkeypatch, [])
    text = textwrap.dedent(
        """\
        ffn.gmm_backend: <GMMBackend.TOKAMAX: 'TOKAMAX'>
        ffn.klass: 'axlearn.common.mixture_of_experts.TransformerFeedForwardDropFreeMoE'
        ffn.tokamax_implementation: ['triton', 'xla']
        """
    )
    ffn = parse_flat_text(text)["ffn"]
    assert ffn.gmm_backend is GMMBackend.TOKAMAX
    assert ffn.tokamax_implementation == ["triton", "xla"]
    assert "gmm_backend: <GMMBackend.TOKAMAX: 'TOKAMAX'>" in ffn.debug_string().splitlines()
    fields = {k: getattr(ffn, k) for k in ("gmm_backend", "tokamax_implementation")}
    _drop_free_config(**fields).instantiate(parent=None)


# ----- AXLearn's drop-free fields -----


def _jit_forward(cfg, x):
    layer = cfg.instantiate(parent=None)
    params = layer.initialize_parameters_recursively(jax.random.PRNGKey(0))
    forward = jax.jit(lambda p, x: F(layer, state=p, inputs=(x,), prng_key=None, is_training=True))
    y, collection = forward(params, x)
    return params, y, collection


def test_drop_free_groups_interpret_and_tiling_leave_the_numpy_output_unchanged():
    # Routing without capacity is the same whatever the grouping; interpret runs
    # ragged_dot; tiling is the TPU kernel's.
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 4, DIM))
    cfg = _drop_free_config(num_groups=4, outer_batch=2, interpret=True, tiling=(128, 512, 512))
    params, y, _ = _jit_forward(cfg, x)
    params = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    np.testing.assert_allclose(y, _np_drop_free(params, np.asarray(x, np.float64)), atol=1e-5)


def test_drop_free_corr_loss_weight_adds_the_router_correlation_loss():
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 4, DIM))
    params, _, collection = _jit_forward(_drop_free_config(corr_loss_weight=0.5), x)
    gate = np.asarray(params["gate_weight"], np.float64)
    columns = gate / np.linalg.norm(gate, axis=0, keepdims=True)
    corr = 0.5 * np.mean(np.abs(columns.T @ columns - np.eye(EXPERTS)))
    router = collection.summaries["gating"]  # Weighted 0.5 and 0.25 by _drop_free_config.
    router_losses = 0.5 * router["load_balance_loss"] + 0.25 * router["router_z_loss"]
    np.testing.assert_allclose(
        collection.module_outputs["aux_loss"] - router_losses, 0.5 * corr, rtol=1e-4
    )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(gating=Top2Gating.default_config()), r"moe\.gating: expected a TopKDropFreeGating"),
        (dict(tiling=(100, 512, 512)), r"moe\.tiling: expected three positive multiples of 128"),
        (dict(num_groups=0), r"moe\.num_groups"),
        (dict(input_dim_to_partition_spec={"bsm": ("data", None, "model")}), "model dim"),
        (
            dict(output_dim_to_partition_spec={
                "bsm": (None, None, None), "emh": ("expert", None, "model"),
                "ehm": (None, "model", None)}),
            r"output_dim_to_partition_spec\['emh'\].*must split the experts",
        ),
    ],
)
def test_bad_axlearn_drop_free_fields_fail_naming_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        _drop_free_config().set(**kwargs).instantiate(parent=None)


def test_a_drop_free_capacity_factor_is_refused_unless_none_or_zero():
    cfg = _drop_free_config()
    cfg.gating.train_capacity_factor = 0
    cfg.instantiate(parent=None)
    cfg.gating.train_capacity_factor = 1.25
    with pytest.raises(ConfigError, match=r"moe\.gating\.train_capacity_factor=1\.25"):
        cfg.instantiate(parent=None)


def test_drop_free_defaults_are_axlearns():
    cfg = TransformerFeedForwardDropFreeMoE.default_config()
    assert cfg.gating.klass is Top2Gating and cfg.corr_loss_weight == 0 and not cfg.interpret
    assert tuple(cfg.dim_to_mesh_axis_map["emh"]) == (None, ("fsdp", "seq"), "model")
    assert tuple(cfg.input_dim_to_partition_spec["bsm"]) == (("data", "fsdp"), "seq", None)
    assert tuple(cfg.output_dim_to_partition_spec["ehm"]) == (None, "model", None)
