"""attention.StackedTransformerLayer with one config per layer (AXLearn's MoE configs
alternate dense and mixture-of-experts layers this way): each layer is built from its own
config, runs in order, and decodes; a list of the wrong length fails naming the path."""

import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import attention as attn
from axlearn.common.config import ConfigError
from tests.test_attention import RNG, _build, _call, _layer_config, _randomize

DIM = 16


def _two_kinds_of_layer() -> list[attn.TransformerLayer.Config]:
    """Two layers that differ in their feed-forward hidden size."""
    narrow, wide = _layer_config(), _layer_config()
    narrow.feed_forward.hidden_dim = 8
    wide.feed_forward.hidden_dim = 24
    return [narrow, wide]


def _stack(num_layers: int = 2) -> attn.StackedTransformerLayer.Config:
    return attn.StackedTransformerLayer.default_config().set(
        input_dim=DIM, num_layers=num_layers, layer=_two_kinds_of_layer()
    )


def _instantiate(cfg):
    return cfg.set(name="layer").instantiate(parent=None)


def test_a_layer_list_builds_each_layer_from_its_own_config():
    specs = _instantiate(_stack()).create_parameter_specs_recursively()
    hidden = [specs[f"layer{i}"]["feed_forward"]["linear1_0"]["weight"].shape for i in (0, 1)]
    assert [list(shape) for shape in hidden] == [[DIM, 8], [DIM, 24]]


def test_a_layer_list_of_the_wrong_length_fails_naming_the_path():
    with pytest.raises(ConfigError, match=r"layer\.layer: 2 layer configs for num_layers=3"):
        _instantiate(_stack(num_layers=3))


def test_a_repeated_layer_refuses_a_layer_list():
    cfg = attn.RepeatedTransformerLayer.default_config().set(
        input_dim=DIM, num_layers=2, layer=_two_kinds_of_layer()
    )
    with pytest.raises(ConfigError, match=r"layer\.layer: .*StackedTransformerLayer"):
        _instantiate(cfg)


@pytest.mark.slow  # Compiles a stack, its layers alone, and decoding steps.
def test_a_layer_list_runs_its_layers_in_order_and_decodes_as_it_runs():
    stack, params = _build(_stack())
    params = _randomize(params, scale=0.3)
    x = jnp.asarray(RNG.normal(size=(2, 5, DIM)), jnp.float32)
    expected = _call(stack, params, data=x)
    y = x
    for i, cfg in enumerate(_two_kinds_of_layer()):
        alone, _ = _build(cfg.set(input_dim=DIM))
        y = _call(alone, params[f"layer{i}"], data=y)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)

    cache = _call(stack, params, method="init_states", batch_size=2, max_len=8)
    cache, prefill = _call(
        stack, params, method="extend_step", cached_states=cache, data=x[:, :3],
        time_step=jnp.zeros(2, jnp.int32),
    )
    outputs = [prefill]
    for t in range(3, 5):
        cache, out = _call(
            stack, params, method="extend_step", cached_states=cache, data=x[:, t : t + 1],
            time_step=jnp.full(2, t, jnp.int32),
        )
        outputs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outputs, axis=1), expected, rtol=1e-5, atol=1e-5)
