"""hf_mixtral: our Mixtral-shaped model against transformers' MixtralForCausalLM (torch, CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import hf_mixtral
from axlearn.common.base_layer import is_parameter_spec
from axlearn.common.config import ConfigError
from axlearn.common.hf_llama import llama_model_config
from axlearn.common.module import functional as F

VOCAB = 61
# torch and transformers take seconds to import: only the tests that compare with them
# (marked slow) do.
slow_with_hf = pytest.mark.slow


def _torch_and_transformers():
    return pytest.importorskip("torch"), pytest.importorskip("transformers")


def _hf_config():
    _, transformers = _torch_and_transformers()
    return transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6, eos_token_id=2, pad_token_id=0,
    )


def _hf_model(seed=0):
    torch, transformers = _torch_and_transformers()
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(_hf_config()).eval()
    with torch.no_grad():  # HF starts norms at one and the router near zero: spread them.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    return model


def _ids(batch=2, seq=9, seed=1):
    return np.random.RandomState(seed).randint(3, VOCAB, size=(batch, seq))


def _hf_logits(model, ids):
    torch, _ = _torch_and_transformers()
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def _our_logits(cfg, params, ids):
    model = cfg.set(name="model").instantiate(parent=None)

    def run(p, ids):
        out, _ = F(model.decoder, state=p["decoder"], inputs=(ids,), prng_key=None,
                   is_training=False)
        return out["logits"]

    return np.asarray(jax.jit(run)(params, jnp.asarray(ids)))


def _assert_close(actual, expected):
    rel = np.max(np.abs(actual - expected)) / np.max(np.abs(expected))
    assert rel < 1e-4, rel


@slow_with_hf
def test_converted_hf_weights_give_hf_logits():
    hf_model = _hf_model()
    cfg = hf_mixtral.mixtral_config_from_hf(hf_model.config)
    params = hf_mixtral.params_from_hf(hf_model.state_dict(), cfg)
    ids = _ids()
    _assert_close(_our_logits(cfg, params, ids), _hf_logits(hf_model, ids))


@slow_with_hf
def test_our_weights_converted_to_hf_give_our_logits():
    _, transformers = _torch_and_transformers()
    cfg = hf_mixtral.mixtral_model_config(
        vocab_size=VOCAB, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=24,
        num_experts=4, num_experts_per_token=2, repeated=False, eos_token_id=2,
    )
    model = cfg.clone(name="model").instantiate(parent=None)
    params = model.initialize_parameters_recursively(jax.random.PRNGKey(3))
    hf_model = transformers.MixtralForCausalLM(hf_mixtral.hf_config_from_mixtral_config(cfg))
    hf_model.load_state_dict(hf_mixtral.params_to_hf(params, cfg))
    ids = _ids(seed=4)
    _assert_close(_hf_logits(hf_model.eval(), ids), _our_logits(cfg, params, ids))


def test_per_expert_state_dicts_of_transformers_4_read_like_fused_ones():
    cfg = hf_mixtral.mixtral_model_config(
        vocab_size=VOCAB, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=24,
        num_experts=4, num_experts_per_token=2,
    )
    specs = cfg.clone(name="model").instantiate(parent=None).create_parameter_specs_recursively()
    rng = np.random.RandomState(5)
    params = jax.tree.map(
        lambda spec: rng.randn(*spec.shape).astype(np.float32), specs, is_leaf=is_parameter_spec
    )
    per_expert = hf_mixtral.params_to_hf(params, cfg, framework="np", fused=False)
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in per_expert
    back = hf_mixtral.params_from_hf(per_expert, cfg)
    for ours, theirs in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        np.testing.assert_array_equal(ours, theirs)


@slow_with_hf
def test_converted_config_matches_the_hf_config():
    hf_config = _hf_config()
    back = hf_mixtral.hf_config_from_mixtral_config(hf_mixtral.mixtral_config_from_hf(hf_config))
    for field in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "num_local_experts",
        "num_experts_per_tok", "rms_norm_eps", "tie_word_embeddings",
    ):
        assert getattr(back, field) == getattr(hf_config, field), field
    assert back.router_aux_loss_coef == pytest.approx(hf_config.router_aux_loss_coef)


def test_dense_llama_configs_are_rejected_naming_the_feed_forward_layer():
    cfg = llama_model_config(
        vocab_size=VOCAB, dim=32, num_layers=1, num_heads=4, num_kv_heads=2, hidden_dim=24
    )
    with pytest.raises(ConfigError, match="feed_forward: Mixtral needs"):
        hf_mixtral.mixtral_dims(cfg)


@slow_with_hf
def test_sliding_window_attention_is_rejected():
    hf_config = _hf_config()
    hf_config.sliding_window = 4
    with pytest.raises(ConfigError, match="sliding_window"):
        hf_mixtral.mixtral_config_from_hf(hf_config)
