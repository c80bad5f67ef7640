"""Tests of axlearn.common.pipeline and attention.PipelinedTransformerLayer: a pipelined
stack computes what its stages computed one after another, in loss and gradients, on one
device and over a 'pipeline' mesh axis of fake CPU devices."""

import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common.attention import (
    PipelinedTransformerLayer,
    RepeatedTransformerLayer,
    TransformerLayer,
)
from axlearn.common.base_layer import BaseLayer, ParameterSpec
from axlearn.common.config import ConfigError
from axlearn.common.module import F
from axlearn.common.param_init import FanAxes, constant_initializer, default_initializer_config
from axlearn.common.pipeline import GPipeSchedule, Pipeline, StreamSchedule
from tests.fresh_python import REPO, assert_prints_ok, fresh_env

RNG = np.random.default_rng(0)
DIM = 6


class _Affine(BaseLayer):
    """x -> tanh(x @ weight + bias); reports the mean of its input as a summary."""

    def _create_layer_parameter_specs(self):
        return dict(
            weight=ParameterSpec(
                shape=[DIM, DIM], mesh_axes=(None, "model"), fan_axes=FanAxes(in_axis=0, out_axis=1)
            ),
            bias=ParameterSpec(
                shape=[DIM], mesh_axes=("model",), initializer=constant_initializer(0.0)
            ),
        )

    def forward(self, x):
        self.add_summary("input_mean", jnp.mean(x))
        return jnp.tanh(x @ self.parameters["weight"] + self.parameters["bias"])


class _Norm(BaseLayer):
    """x -> x + |x * scale|: its gradient is not finite at x = 0 (a bubble's input)."""

    def _create_layer_parameter_specs(self):
        return dict(scale=ParameterSpec(shape=[DIM], mesh_axes=(None,), fan_axes=FanAxes()))

    def forward(self, x):
        return x + jnp.sqrt(jnp.sum((x * self.parameters["scale"]) ** 2, axis=-1, keepdims=True))


class _Counter(BaseLayer):
    """Adds a state update, which a pipeline refuses."""

    def forward(self, x):
        self.add_state_update("count", jnp.ones(()))
        return x


def _pipeline(layer, num_stages, num_microbatches, schedule=GPipeSchedule):
    cfg = Pipeline.default_config().set(
        name="pipeline",
        layer=layer,
        num_layers=num_stages,
        num_microbatches=num_microbatches,
        schedule=schedule.default_config(),
        param_init=default_initializer_config(),
    )
    return cfg.instantiate(parent=None)


def _random_affine_params(num_stages):
    return {
        "layer": {
            "weight": jnp.asarray(RNG.normal(size=(num_stages, DIM, DIM)) * 0.5, jnp.float32),
            "bias": jnp.asarray(RNG.normal(size=(num_stages, DIM)), jnp.float32),
        }
    }


def _sequential_affine(params, x):
    """The reference: the stages applied one after another, in plain jnp."""
    for w, b in zip(params["layer"]["weight"], params["layer"]["bias"]):
        x = jnp.tanh(x @ w + b)
    return x


def _loss(layer):
    def loss(params, x):
        out, collection = F(layer, state=params, inputs=(x,), prng_key=None, is_training=True)
        return jnp.sum(out**3), (out, collection)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def test_stage_parameters_are_stacked_on_an_axis_over_pipeline():
    layer = _pipeline(_Affine.default_config(), num_stages=3, num_microbatches=3)
    spec = layer.create_parameter_specs_recursively()["layer"]["weight"]
    assert tuple(spec.shape) == (3, DIM, DIM)
    assert tuple(spec.mesh_axes) == ("pipeline", None, "model")
    assert spec.fan_axes == FanAxes(in_axis=0, out_axis=1).prepend_axis()
    params = layer.initialize_parameters_recursively(jax.random.PRNGKey(0))
    assert params["layer"]["weight"].shape == (3, DIM, DIM)
    # Each stage draws its own weights.
    assert not np.allclose(params["layer"]["weight"][0], params["layer"]["weight"][1])


@pytest.mark.parametrize(
    "schedule,num_stages,num_microbatches",
    [
        (GPipeSchedule, 3, 5),  # More microbatches than stages, not a multiple.
        (StreamSchedule, 3, 9),  # Outputs rotated by (N - 1) % (M / N) = 2.
        # The same check at other sizes, in the whole suite (slow).
        pytest.param(GPipeSchedule, 3, 3, marks=pytest.mark.slow),
        pytest.param(GPipeSchedule, 4, 2, marks=pytest.mark.slow),  # Fewer microbatches.
        pytest.param(StreamSchedule, 3, 3, marks=pytest.mark.slow),
        pytest.param(StreamSchedule, 2, 8, marks=pytest.mark.slow),
    ],
)
def test_pipeline_computes_the_stages_in_sequence(schedule, num_stages, num_microbatches):
    layer = _pipeline(_Affine.default_config(), num_stages, num_microbatches, schedule)
    params = _random_affine_params(num_stages)
    x = jnp.asarray(RNG.normal(size=(2 * num_microbatches, 3, DIM)), jnp.float32)
    (loss, (out, _)), (grads, x_grad) = _loss(layer)(params, x)

    ref_fn = lambda p, x: jnp.sum(_sequential_affine(p, x) ** 3)  # noqa: E731
    ref_loss, (ref_grads, ref_x_grad) = jax.value_and_grad(ref_fn, argnums=(0, 1))(params, x)
    np.testing.assert_allclose(out, _sequential_affine(params, x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for name in ("weight", "bias"):
        np.testing.assert_allclose(
            grads["layer"][name], ref_grads["layer"][name], rtol=1e-4, atol=1e-5
        )
    np.testing.assert_allclose(x_grad, ref_x_grad, rtol=1e-4, atol=1e-5)


def test_stage_summaries_are_averaged_over_the_microbatches():
    num_stages, num_microbatches = 3, 4
    layer = _pipeline(_Affine.default_config(), num_stages, num_microbatches)
    params = _random_affine_params(num_stages)
    x = jnp.asarray(RNG.normal(size=(8, 3, DIM)), jnp.float32)
    (_, (_, collection)), _ = _loss(layer)(params, x)
    # Stage n's input for microbatch m: the rows m, m + M, ... through stages 0..n-1.
    expected, h = [], np.asarray(x)
    for n in range(num_stages):
        microbatches = [h[m::num_microbatches] for m in range(num_microbatches)]
        expected.append(np.mean([np.mean(mb) for mb in microbatches]))
        h = np.tanh(h @ params["layer"]["weight"][n] + params["layer"]["bias"][n])
    np.testing.assert_allclose(collection.summaries["layer"]["input_mean"], expected, rtol=1e-5)


@pytest.mark.slow
def test_no_gradient_flows_through_the_bubbles():
    num_stages, num_microbatches = 3, 2
    layer = _pipeline(_Norm.default_config(), num_stages, num_microbatches)
    params = {"layer": {"scale": jnp.asarray(RNG.normal(size=(num_stages, DIM)), jnp.float32)}}
    x = jnp.asarray(RNG.normal(size=(4, DIM)), jnp.float32)
    (_, _), (grads, x_grad) = _loss(layer)(params, x)

    def ref_fn(p, x):
        for scale in p["layer"]["scale"]:
            x = x + jnp.sqrt(jnp.sum((x * scale) ** 2, axis=-1, keepdims=True))
        return jnp.sum(x**3)

    ref_grads, ref_x_grad = jax.grad(ref_fn, argnums=(0, 1))(params, x)
    # The first stages of the first iterations see zeros, whose sqrt has no finite gradient.
    np.testing.assert_allclose(grads["layer"]["scale"], ref_grads["layer"]["scale"], rtol=1e-4)
    np.testing.assert_allclose(x_grad, ref_x_grad, rtol=1e-4)


def test_stream_schedule_needs_the_stages_to_divide_the_microbatches():
    expected = r"pipeline.schedule: .*num_microbatches \(5\).*num_stages \(2\)"
    with pytest.raises(ConfigError, match=expected):
        _pipeline(_Affine.default_config(), 2, 5, StreamSchedule)


def test_microbatches_must_divide_the_batch():
    layer = _pipeline(_Affine.default_config(), 2, 3)
    params = _random_affine_params(2)
    expected = r"pipeline.num_microbatches=3 does not divide the batch of 4"
    with pytest.raises(ValueError, match=expected):
        _loss(layer)(params, jnp.zeros((4, DIM)))


@pytest.mark.parametrize("field,value", [("num_layers", 0), ("num_microbatches", 1.5)])
def test_pipeline_sizes_must_be_positive_ints(field, value):
    cfg = Pipeline.default_config().set(
        name="pipeline", layer=_Affine.default_config(), num_layers=2, num_microbatches=2
    )
    cfg.set(**{field: value})
    with pytest.raises(ConfigError, match=rf"pipeline.{field}: expected a positive int"):
        cfg.instantiate(parent=None)


def test_state_updates_of_a_stage_are_refused():
    layer = _pipeline(_Counter.default_config(), 2, 2)
    with pytest.raises(NotImplementedError, match="pipeline: the stage layer adds state updates"):
        F(layer, state={}, inputs=(jnp.zeros((4, DIM)),), prng_key=None, is_training=True)


def _transformer_layer():
    layer = TransformerLayer.default_config()
    layer.self_attention.attention.set(num_heads=2)
    layer.feed_forward.hidden_dim = 8
    return layer


def test_pipelined_transformer_needs_the_stages_to_divide_the_layers():
    cfg = PipelinedTransformerLayer.default_config().set(
        name="stack", input_dim=4, num_layers=6, num_stages=4, num_microbatches=4,
        layer=_transformer_layer(),
    )
    with pytest.raises(ConfigError, match="stack.num_stages=4 does not divide num_layers=6"):
        cfg.instantiate(parent=None)


@pytest.mark.slow
def test_pipelined_transformer_decodes_as_the_repeated_stack():
    layer = _transformer_layer()
    layer.self_attention.attention.causal = True
    repeated_cfg = RepeatedTransformerLayer.default_config().set(
        name="stack", input_dim=4, num_layers=4, layer=layer,
        param_init=default_initializer_config(),
    )
    repeated = repeated_cfg.instantiate(parent=None)
    params = repeated.initialize_parameters_recursively(jax.random.PRNGKey(0))
    pipelined = PipelinedTransformerLayer.default_config().set(
        name="stack", input_dim=4, num_layers=4, num_stages=2, num_microbatches=2, layer=layer,
    ).instantiate(parent=None)
    # Stage n holds layers 2n and 2n + 1 (as its children layer0 and layer1).
    staged = jax.tree_util.tree_map(
        lambda x: x.reshape(2, 2, *x.shape[1:]), params["repeat"]["layer"]
    )
    pipelined_params = {"pipeline": {"layer": {
        f"layer{i}": jax.tree_util.tree_map(lambda x, i=i: x[:, i], staged) for i in range(2)
    }}}

    def decode(stack, stack_params, tokens):
        cache, _ = F(stack, state=stack_params, inputs=dict(batch_size=2, max_len=3),
                     prng_key=None, is_training=False, method="init_states")
        outputs = []
        for t in range(tokens.shape[1]):
            (cache, out), _ = F(
                stack, state=stack_params, prng_key=None, is_training=False,
                method="extend_step",
                inputs=dict(cached_states=cache, data=tokens[:, t : t + 1],
                            time_step=jnp.full((2,), t, jnp.int32)),
            )
            outputs.append(out)
        return jnp.concatenate(outputs, axis=1)

    tokens = jnp.asarray(RNG.normal(size=(2, 3, 4)), jnp.float32)
    np.testing.assert_allclose(
        decode(pipelined, pipelined_params, tokens), decode(repeated, params, tokens),
        rtol=1e-5, atol=1e-6,
    )


# ----- a causal LM over a 'pipeline' mesh axis of 4 fake devices -----

_MODEL_SCRIPT = textwrap.dedent(
    """
    import re
    import jax, jax.numpy as jnp, numpy as np
    from axlearn.common.attention import PipelinedTransformerLayer, RepeatedTransformerLayer
    from axlearn.common.base_layer import is_parameter_spec
    from axlearn.common.module import F
    from axlearn.common.pipeline import GPipeSchedule, StreamSchedule
    from axlearn.common.sharding import create_mesh, named_sharding
    from axlearn.experiments.text.gpt import common

    L = 4

    def model(stack=None):
        cfg = common.model_config(
            dim=32, num_layers=L, num_heads=4, num_kv_heads=2, hidden_dim=48, vocab_size=64
        )
        if stack is not None:
            cfg.decoder.transformer = stack.set(layer=cfg.decoder.transformer.layer, num_layers=L)
        return cfg.set(name="model").instantiate(parent=None)

    def step(model):
        def loss(params, batch):
            (value, _), _ = F(model, state=params, inputs=dict(input_batch=batch),
                              prng_key=jax.random.PRNGKey(1), is_training=True)
            return value
        return jax.jit(jax.value_and_grad(loss))

    rng = np.random.default_rng(0)
    batch = {k: jnp.asarray(rng.integers(1, 64, (8, 16)), jnp.int32)
             for k in ("input_ids", "target_labels")}
    reference = model()
    params = reference.initialize_parameters_recursively(jax.random.PRNGKey(0))
    params = jax.tree_util.tree_map(
        lambda p: p + jnp.asarray(rng.normal(size=p.shape) * 0.1, p.dtype), params)
    ref_loss, ref_grads = step(reference)(params, batch)
    ref_layers = ref_grads["decoder"]["transformer"]["repeat"]["layer"]
    layers = params["decoder"]["transformer"]["repeat"]["layer"]

    def to_stages(tree, n):  # [L, ...] -> [N, L/N, ...]
        return jax.tree_util.tree_map(lambda x: x.reshape(n, L // n, *x.shape[1:]), tree)

    cases = [  # (stages, microbatches, schedule, stage stack)
        (4, 4, GPipeSchedule, None), (4, 8, GPipeSchedule, None),
        (4, 4, StreamSchedule, None), (4, 8, StreamSchedule, None),
        (2, 4, StreamSchedule, RepeatedTransformerLayer),
    ]
    for n, m, schedule, stage in cases:
        stack = PipelinedTransformerLayer.default_config().set(num_stages=n, num_microbatches=m)
        stack.pipeline.schedule = schedule.default_config()
        if stage is not None:
            stack.stage = stage.default_config().set(layer=None)
        pipelined = model(stack)
        staged = to_stages(layers, n)
        if stage is None:  # layer{i} of stage n is layer n * L/N + i.
            stage_params = {f"layer{i}": jax.tree_util.tree_map(lambda x: x[:, i], staged)
                            for i in range(L // n)}
        else:
            stage_params = {"repeat": {"layer": staged}}
        pp = dict(params, decoder=dict(params["decoder"],
                                       transformer={"pipeline": {"layer": stage_params}}))
        specs = pipelined.create_parameter_specs_recursively()
        mesh = create_mesh((n, 1, 1, 4 // n, 1, 1), common.MESH_AXIS_NAMES)
        with jax.set_mesh(mesh):
            shardings = jax.tree_util.tree_map(
                lambda s: named_sharding(mesh, s.partition_spec), specs, is_leaf=is_parameter_spec)
            pp = jax.device_put(pp, shardings)
            loss, grads = step(pipelined)(pp, batch)
            hlo = step(pipelined).lower(pp, batch).compile().as_text()
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        got = grads["decoder"]["transformer"]["pipeline"]["layer"]
        if stage is None:
            got = jax.tree_util.tree_map(
                lambda *xs: jnp.stack(xs, 1), *[got[f"layer{i}"] for i in range(L // n)])
        else:
            got = got["repeat"]["layer"]
        for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got),
                                jax.tree_util.tree_leaves(to_stages(ref_layers, n))):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6, err_msg=str(path))
        for name in ("emb", "output_norm"):
            for g, r in zip(jax.tree_util.tree_leaves(grads["decoder"][name]),
                            jax.tree_util.tree_leaves(ref_grads["decoder"][name])):
                np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
        # Each device holds its stages' weights only, and the stages pass activations to
        # their neighbours instead of gathering the weights (FSDP, where the mesh has it,
        # gathers its shards of a stage's weights).
        leaf = jax.tree_util.tree_leaves(pp["decoder"]["transformer"]["pipeline"])[0]
        assert leaf.sharding.shard_shape(leaf.shape)[0] == leaf.shape[0] // n, leaf.sharding
        assert re.search(r"= \\S+ collective-permute\\(", hlo), (n, m, schedule)
        if n == 4:  # No FSDP: no weight is gathered, whole or one stage of it.
            gathered = {tuple(int(d) for d in dims.split(",") if d)
                        for dims in re.findall(r"= \\w+\\[([0-9,]*)\\]\\S* all-gather\\(", hlo)}
            weights = {s for x in jax.tree_util.tree_leaves(pp) for s in (x.shape, x.shape[1:])}
            assert not gathered & weights, (n, m, schedule, gathered & weights)
    print("MODEL_OK")
    """
)


@pytest.mark.slow
def test_pipelined_model_matches_the_unpipelined_model_on_a_pipeline_mesh():
    assert_prints_ok(_MODEL_SCRIPT, marker="MODEL_OK", devices=4, timeout=900)


# ----- the named CPU config through the trainer -----


def _train_losses(tmp_path, name: str, mesh_selector: str) -> tuple[list[float], str]:
    """Losses of 3 steps of gpt_pipeline_test on 4 fake CPU devices, and the run's log."""
    result = subprocess.run(
        [
            sys.executable, "-m", "axlearn.common.launch_trainer_main",
            "--config=gpt_pipeline_test", f"--mesh_selector={mesh_selector}",
            f"--trainer_dir={tmp_path / name}",
            "--config_override=max_step=3", "--config_override=log_every_n_steps=1",
            "--config_override=evalers={}",
            "--config_override=input.global_batch_size=8",
            "--config_override=input.max_sequence_length=64",
        ],
        cwd=REPO, env=fresh_env(devices=4), capture_output=True, text=True, timeout=600,
        check=False,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-3000:]
    return [float(x) for x in re.findall(r"step \d+/3 \| loss ([0-9.]+)", log)], log


@pytest.mark.slow
def test_named_pipeline_config_trains_on_a_pipeline_mesh_as_on_one_stage_group(tmp_path):
    pipelined, log = _train_losses(tmp_path, "pipelined", "none")  # The config's own mesh.
    assert "'pipeline': 2" in log
    flat, flat_log = _train_losses(tmp_path, "flat", "cpu")
    assert "'pipeline': 1" in flat_log
    assert len(pipelined) == len(flat) == 3
    np.testing.assert_allclose(pipelined, flat, rtol=1e-5)
    assert pipelined[-1] < pipelined[0]  # The steps trained something.
