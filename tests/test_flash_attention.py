"""flash_attention: FlashAttention against a NumPy causal grouped-query attention, its
kernel settings and modifiers, and the remat policy that saves the kernel's outputs."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from axlearn.common import attention as attn
from axlearn.common.config import ConfigError
from axlearn.common.flash_attention import remat
from axlearn.common.flash_attention.layer import FlashAttention, FlashBlockSizeModifier
from axlearn.common.module import functional as F
from axlearn.common.sharding import create_mesh
from axlearn.experiments import trainer_config_utils
from axlearn.experiments.trainer_config_utils import (
    SplashAttentionConfigModifier,
    V6eFlashConfigModifier,
)
from tests.trainer_script import tiny_trainer_config

RNG = np.random.default_rng(0)
B, T, D, N, K = 2, 6, 8, 4, 2
H = D // N
BATCH = ("data", "expert", "fsdp")
AXES = ("pipeline", "data", "expert", "fsdp", "seq", "model")


def _flash_config(**kwargs) -> FlashAttention.Config:
    cfg = FlashAttention.default_config().set(
        name="attention", query_dim=D, key_dim=D, value_dim=D, output_dim=D, num_heads=N,
        causal=True, dtype=jnp.float32,
        input_linear=attn.GroupedQKVLinear.default_config().set(num_kv_heads=K),
        output_linear=attn.MultiheadOutputLinear.default_config().set(bias=False),
        mha_dim_to_partition_spec={
            "btnh": PartitionSpec(BATCH, None, ("seq", "model"), None),
            "bsnh": PartitionSpec(BATCH, None, ("seq", "model"), None),
            "bnts": PartitionSpec(BATCH, None, None, None),
        },
        output_dim_to_partition_spec={"btnh": PartitionSpec(BATCH, "seq", "model", None)},
    )
    cfg.input_linear.layer.bias = False
    return cfg.set(**kwargs)


def _np_attention(x, p):
    """Causal grouped-query attention in float64 NumPy."""
    proj = {
        name: np.einsum("btd,dnh->btnh", x, np.asarray(p["i_proj"][name]["weight"], np.float64))
        for name in ("q_proj", "k_proj", "v_proj")
    }
    q = proj["q_proj"] / np.sqrt(H)
    k, v = (np.repeat(proj[name], N // K, axis=2) for name in ("k_proj", "v_proj"))
    logits = np.einsum("btnh,bsnh->bnts", q, k)
    logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    context = np.einsum("bnts,bsnh->btnh", probs, v)
    return np.einsum("btnh,dnh->btd", context, np.asarray(p["o_proj"]["weight"], np.float64))


def test_flash_attention_matches_numpy_under_its_sharding_constraints():
    layer = _flash_config().instantiate(parent=None)
    specs = layer.create_parameter_specs_recursively()
    params = jax.tree.map(
        lambda s: jnp.asarray(RNG.normal(size=s.shape) / np.sqrt(D), jnp.float32),
        specs,
        is_leaf=lambda s: hasattr(s, "fan_axes"),
    )
    x = RNG.normal(size=(B, T, D))

    def run(params, x):
        out, _ = F(layer, state=params, inputs=dict(query=x), prng_key=None, is_training=False)
        return out

    mesh = create_mesh((1, 1, 1, 1, 1, 1), AXES, jax.devices()[:1])
    with jax.set_mesh(mesh):
        out = jax.jit(run)(params, jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(out, _np_attention(x, params), rtol=1e-4, atol=1e-5)


def test_unknown_tensor_names_in_the_partition_specs_are_rejected():
    cfg = _flash_config(output_dim_to_partition_spec={"bsnh": PartitionSpec()})
    with pytest.raises(ConfigError, match=r"output_dim_to_partition_spec: unknown .*'bsnh'"):
        cfg.instantiate(parent=None)


def _trainer_with_flash():
    cfg = tiny_trainer_config(trainer_dir=None, max_step=1)
    cfg.model.decoder.transformer.layer.self_attention.attention = _flash_config().set(name=None)
    return cfg


def _flash(cfg):
    return cfg.model.decoder.transformer.layer.self_attention.attention


def test_block_size_modifier_sets_the_tpu_size_and_the_gpu_size_as_an_override():
    cfg = FlashBlockSizeModifier.default_config().set(tpu_block_size=1024, gpu_block_size=64)
    flash = _flash(cfg.instantiate()(_trainer_with_flash()))
    assert flash.tpu_block_size == 1024 and flash.backend_overrides == {"gpu_block_size": 64}


def test_tpu_modifiers_set_fields_only(monkeypatch):
    monkeypatch.setattr(trainer_config_utils, "_backend", lambda: "tpu")
    cfg = V6eFlashConfigModifier.default_config().set(tpu_block_size=2048).instantiate()(
        _trainer_with_flash()
    )
    cfg = SplashAttentionConfigModifier.default_config().set(
        splash_block_q=4096, splash_block_kv_compute=1024
    ).instantiate()(cfg)
    assert _flash(cfg).tpu_block_size == 2048
    overrides = {"splash_block_q": 4096, "splash_block_kv_compute": 1024}
    assert _flash(cfg).backend_overrides == overrides


def test_remat_policy_saves_the_cudnn_kernel_outputs_only():
    assert remat.policy(types.SimpleNamespace(name="dot_product_attention_fwd_wrapper"))
    assert not remat.policy(types.SimpleNamespace(name="dot_general"))
    assert not remat.policy(types.SimpleNamespace(name="name"), name="context")
