"""Tests of axlearn.common.repeat.Repeat: stacked parameters, scan semantics, outputs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common.base_layer import BaseLayer, ParameterSpec
from axlearn.common.config import ConfigError, config_class, config_for_function
from axlearn.common.golden_text import init_lines
from axlearn.common.layers import Linear
from axlearn.common.module import F
from axlearn.common.param_init import FanAxes, constant_initializer, default_initializer_config
from axlearn.common.repeat import Repeat, _drop_by_regex

RNG = np.random.default_rng(0)


class _ScaleAndShift(BaseLayer):
    """x * 2 + shift; reports summaries, a state update and a module output."""

    @config_class
    class Config(BaseLayer.Config):
        dim: int = 3

    def _create_layer_parameter_specs(self):
        return dict(
            shift=ParameterSpec(
                shape=[self.config.dim],
                mesh_axes=("model",),
                initializer=constant_initializer(0.0),
                fan_axes=FanAxes(),
            )
        )

    def forward(self, x):
        self.add_summary("mean", jnp.mean(x))
        self.add_state_update("count", jnp.ones(()))
        self.add_module_output("doubled", x * 2)
        noise = jax.random.normal(self.prng_key, ()) if self.prng_key is not None else 0.0
        self.add_summary("noise", noise)
        return x * 2 + self.parameters["shift"]


def _repeat(layer_cfg, num_layers=4, **kwargs):
    cfg = Repeat.default_config().set(
        name="repeat",
        layer=layer_cfg,
        num_layers=num_layers,
        param_init=default_initializer_config(),
        **kwargs,
    )
    layer = cfg.instantiate(parent=None)
    return layer, layer.initialize_parameters_recursively(jax.random.PRNGKey(0))


def _forward(layer, params, x, prng_key=None):
    return F(layer, state=params, inputs=(x,), prng_key=prng_key, is_training=True)


def test_parameters_are_stacked_on_a_leading_replicated_axis():
    layer, params = _repeat(_ScaleAndShift.default_config(), num_layers=4)
    spec = layer.create_parameter_specs_recursively()["layer"]["shift"]
    assert tuple(spec.shape) == (4, 3)
    assert tuple(spec.mesh_axes) == (None, "model")
    assert spec.fan_axes == FanAxes().prepend_axis()
    assert params["layer"]["shift"].shape == (4, 3)


def test_stacked_weights_are_initialized_with_per_layer_fans():
    linear = Linear.default_config().set(input_dim=300, output_dim=200)
    layer, params = _repeat(linear, num_layers=8)
    assert params["layer"]["weight"].shape == (8, 300, 200)
    # fan_in is 300 (not 8 * 300): the layer axis is a batch axis.
    np.testing.assert_allclose(np.var(params["layer"]["weight"]), 1 / 300, rtol=0.05)
    # The `_init` golden line describes one layer's weight, as AXLearn's does: no layer axis.
    weight_line = init_lines(layer)[0]
    assert weight_line.startswith("layer/weight: normal(0, 1.0 / fan_in), shape=")
    assert re.search(r"shape=[\[(]300, 200[\])], ", weight_line), weight_line
    assert weight_line.endswith("axes=FanAxes(in_axis=-2, out_axis=-1, batch_axis=())")


def test_repeat_equals_a_python_loop_over_the_layers():
    layer, params = _repeat(Linear.default_config().set(input_dim=5, output_dim=5), num_layers=3)
    params = jax.tree_util.tree_map(lambda p: jnp.asarray(RNG.normal(size=p.shape)), params)
    x = RNG.normal(size=(2, 5)).astype(np.float32)
    out, _ = _forward(layer, params, jnp.asarray(x))
    expected = x.astype(np.float64)
    for i in range(3):
        weight, bias = params["layer"]["weight"][i], params["layer"]["bias"][i]
        expected = expected @ np.asarray(weight) + np.asarray(bias)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def test_summaries_and_state_updates_are_stacked_along_the_layer_axis():
    layer, params = _repeat(_ScaleAndShift.default_config(), num_layers=4)
    x = jnp.ones((2, 3))
    _, collection = _forward(layer, params, x)
    # Layer i sees 2^i (shift is zero at init).
    np.testing.assert_allclose(collection.summaries["layer"]["mean"], [1, 2, 4, 8])
    np.testing.assert_array_equal(collection.state_updates["layer"]["count"], np.ones(4))


def test_module_outputs_are_dropped_by_default():
    layer, params = _repeat(_ScaleAndShift.default_config())
    _, collection = _forward(layer, params, jnp.ones((2, 3)))
    assert "doubled" not in collection.module_outputs.get("layer", {})
    assert "mean" in collection.summaries["layer"]


def test_drop_output_none_keeps_module_outputs():
    layer, params = _repeat(_ScaleAndShift.default_config(), num_layers=2, drop_output=None)
    _, collection = _forward(layer, params, jnp.ones((1, 3)))
    assert collection.module_outputs["layer"]["doubled"].shape == (2, 1, 3)


def test_drop_output_rules_select_summaries_by_path():
    drop = config_for_function(_drop_by_regex).set(rules=["summaries/layer/noise"])
    layer, params = _repeat(_ScaleAndShift.default_config(), num_layers=2, drop_output=drop)
    _, collection = _forward(layer, params, jnp.ones((1, 3)))
    assert set(collection.summaries["layer"]) == {"mean"}


def test_each_layer_gets_its_own_prng_key():
    layer, params = _repeat(_ScaleAndShift.default_config(), num_layers=4)
    _, collection = _forward(layer, params, jnp.ones((1, 3)), prng_key=jax.random.PRNGKey(7))
    noise = np.asarray(collection.summaries["layer"]["noise"])
    assert len(set(noise.tolist())) == 4


def test_layer_remat_spec_applies_to_every_iteration():
    linear = Linear.default_config().set(input_dim=4, output_dim=4)
    x = jnp.ones((2, 4))

    def scan_body_primitives(layer_cfg):
        layer, params = _repeat(layer_cfg, num_layers=3)
        jaxpr = jax.make_jaxpr(lambda p: _forward(layer, p, x)[0])(params).jaxpr
        (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
        return {e.primitive.name for e in scan.params["jaxpr"].jaxpr.eqns}

    # The remat primitive is 'remat2' in jax 0.10 and 'checkpoint' in later versions.
    remat_names = {"remat2", "checkpoint"}
    assert not remat_names & scan_body_primitives(linear)
    rematted = linear.clone(remat_spec={"prevent_cse": False, "policy": "nothing_saveable"})
    assert remat_names & scan_body_primitives(rematted)


def test_num_layers_must_be_positive():
    with pytest.raises(ConfigError, match="num_layers"):
        _repeat(_ScaleAndShift.default_config(), num_layers=0)


def test_drop_by_regex_matches_whole_paths():
    drop = _drop_by_regex(["module_outputs.*", "summaries/x"])
    assert drop("module_outputs/layer/a")
    assert drop("summaries/x")
    assert not drop("summaries/x/y")
    assert not drop("summaries/module_outputs")
