"""Names AXLearn's Fuji goldens refer to in its experiment modules: the feed-forward
`scale_fn` (against its arithmetic) and the offload remat policies (against jax's own)."""

import math
import types

import jax
import pytest

from axlearn.common.config import ConfigError
from axlearn.experiments.text.gpt import fuji
from axlearn.experiments.text.gpt.common import scale_fn


@pytest.mark.parametrize(
    "dim,scale,multiple", [(8, 8 / 3, 16), (4096, 8 / 3, 256), (2048, 3.5, 256)]
)
def test_scale_fn_rounds_the_scaled_dim_up_to_the_multiple(dim, scale, multiple):
    want = math.ceil(math.ceil(dim * scale) / multiple) * multiple
    assert scale_fn(dim, scale=scale, round_up_to_multiples_of=multiple) == want


def test_scale_fn_needs_the_layer_to_set_input_dim():
    with pytest.raises(ConfigError, match="input_dim is set by the feed-forward layer"):
        scale_fn(scale=2.0)


def _name(name: str):
    return types.SimpleNamespace(name="name"), {"name": name}


def test_attention_proj_policy_offloads_qkv_projections_only():
    for name, offloaded in (("Attention.q_proj", True), ("Attention.o_proj", False)):
        prim, params = _name(name)
        decision = fuji.offload_attention_proj_policy(prim, **params)
        assert (getattr(decision, "dst", None) == "pinned_host") is offloaded


def test_dots_policy_decides_as_jax_offload_dot_with_no_batch_dims():
    want = jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        offload_src="device", offload_dst="pinned_host"
    )
    prim = jax.lax.dot_general_p
    params = dict(dimension_numbers=(((1,), (0,)), ((), ())))
    assert fuji.offload_dots_saveable_policy(prim, **params) == want(prim, **params)
