"""Tests of the `_init` and `_regularizer` golden texts (axlearn.common.golden_config): they
are written as AXLearn writes them, so that AXLearn's own dumps of a model equal ours.

The reference is AXLearn's `fuji-test-v3` pair in shared/axlearn_goldens/ (skipped where
absent; its `_regularizer` is compared in test_axlearn_goldens.py); the format's rules are
checked on small layers too.
"""

import functools

from axlearn.common import golden_config
from axlearn.common.attention import RepeatedTransformerLayer, TransformerLayer
from axlearn.common.base_layer import BaseLayer, ParameterSpec
from axlearn.common.config import config_class
from axlearn.common.golden_text import init_lines, parse_flat_text
from axlearn.common.layers import RMSNorm
from axlearn.common.module import Module
from axlearn.common.param_init import FanAxes, constant_initializer, default_initializer_config
from tests.test_axlearn_goldens import golden_text


@functools.lru_cache(maxsize=None)
def _fuji_test_v3():
    """AXLearn's fuji-test-v3 trainer config, read from its golden text."""
    return parse_flat_text(golden_text("fuji-test-v3.txt"), source="fuji-test-v3.txt", foreign=True)


def test_fuji_test_v3_init_equals_axlearns_line_for_line():
    ours = golden_config.init_text(_fuji_test_v3())
    assert ours.splitlines() == golden_text("fuji-test-v3_init.txt").splitlines()


# ----- the format's rules, on small layers -----


class _OwnThenChildren(BaseLayer):
    """Own parameters 'z' then 'a', then children 'second' and 'first', in that order."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures _OwnThenChildren."""

    def __init__(self, cfg: Config, *, parent: Module):
        super().__init__(cfg, parent=parent)
        self._add_child("second", RMSNorm.default_config().set(input_dim=4))
        self._add_child("first", RMSNorm.default_config().set(input_dim=4))

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        return dict(
            z=ParameterSpec(shape=[2], initializer=constant_initializer(0.0)),
            a=ParameterSpec(shape=(2, 3), fan_axes=FanAxes()),
        )


def _layer(cfg):
    return cfg.set(name="layer", param_init=default_initializer_config(regex=".*")).instantiate(
        parent=None
    )


def test_lines_follow_creation_order_not_the_sorted_paths():
    lines = init_lines(_layer(_OwnThenChildren.default_config()))
    paths = [line.split(":")[0] for line in lines]
    assert paths == ["z", "a", "second/scale", "first/scale"]


def test_a_constant_is_written_without_shape_or_axes():
    lines = init_lines(_layer(_OwnThenChildren.default_config()))
    assert lines[0] == "z: constant(0.0)"
    assert lines[2] == "second/scale: constant(1.0)"


def test_a_weight_shows_its_shape_as_declared_list_or_tuple():
    lines = init_lines(_layer(_OwnThenChildren.default_config()))
    assert lines[1] == (
        "a: normal(0, 1.0 / fan_in), shape=(2, 3), "
        "axes=FanAxes(in_axis=-2, out_axis=-1, batch_axis=())"
    )


def test_a_repeated_layer_is_described_without_the_layer_axis():
    cfg = RepeatedTransformerLayer.default_config().set(
        input_dim=8, num_layers=3, layer=TransformerLayer.default_config()
    )
    cfg.layer.self_attention.attention.set(num_heads=2)
    cfg.layer.feed_forward.hidden_dim = 16
    lines = dict(line.split(": ", 1) for line in init_lines(_layer(cfg)))
    o_proj = lines["repeat/layer/self_attention/attention/o_proj/weight"]
    # The stacked spec is (3, 8, 2, 4) with a batch axis; the line shows one layer's weight.
    assert o_proj.endswith(
        "shape=(8, 2, 4), axes=FanAxes(in_axis=(1, 2), out_axis=0, batch_axis=())"
    )
