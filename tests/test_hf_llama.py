"""hf_llama: our Llama-shaped model against transformers' LlamaForCausalLM (torch, CPU)."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import hf_llama
from axlearn.common.config import ConfigError, set_recursively
from axlearn.common.module import functional as F

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 61


def _hf_model(*, tied=False, head_dim=None, seed=0, **config_kwargs):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim or 8,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=tied,
        eos_token_id=2, pad_token_id=0, **config_kwargs,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF starts norms at one; random scales test their conversion too.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def _ids(batch=2, seq=9, seed=1):
    return np.random.RandomState(seed).randint(3, VOCAB, size=(batch, seq))


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def _our_logits(cfg, params, ids):
    model = cfg.instantiate(parent=None)

    def run(p, ids):
        out, _ = F(model.decoder, state=p["decoder"], inputs=(ids,), prng_key=None,
                   is_training=False)
        return out["logits"]

    return np.asarray(jax.jit(run)(params, jnp.asarray(ids)))


def _assert_close(actual, expected):
    rel = np.max(np.abs(actual - expected)) / np.max(np.abs(expected))
    assert rel < 1e-4, rel


@pytest.mark.parametrize("tied,head_dim", [(False, None), (True, 16)])
def test_converted_hf_weights_give_hf_logits(tied, head_dim):
    hf = _hf_model(tied=tied, head_dim=head_dim)
    cfg = hf_llama.llama_config_from_hf(hf.config)
    params = hf_llama.params_from_hf(hf.state_dict(), cfg)
    ids = _ids()
    _assert_close(_our_logits(cfg, params, ids), _hf_logits(hf, ids))


@pytest.mark.parametrize("repeated", [pytest.param(True, marks=pytest.mark.slow), False])
def test_our_weights_converted_to_hf_give_our_logits(repeated):
    cfg = hf_llama.llama_model_config(
        vocab_size=VOCAB, dim=32, num_layers=2, num_heads=4, num_kv_heads=1, hidden_dim=40,
        rope_theta=10000.0, norm_eps=1e-6, repeated=repeated,
    )
    model = cfg.instantiate(parent=None)
    params = jax.jit(model.initialize_parameters_recursively)(jax.random.PRNGKey(0))
    # Perturb norm scales away from one so that a misplaced scale shows.
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 1.1 if getattr(path[-1], "key", "") == "scale" else x, params
    )
    hf = transformers.LlamaForCausalLM(hf_llama.hf_config_from_llama_config(cfg)).eval()
    hf.load_state_dict(hf_llama.params_to_hf(params, cfg))
    ids = _ids(seed=2)
    _assert_close(_hf_logits(hf, ids), _our_logits(cfg, params, ids))


def test_params_round_trip_through_the_hf_state_dict():
    hf = _hf_model(tied=True)
    cfg = hf_llama.llama_config_from_hf(hf.config)
    params = hf_llama.params_from_hf(hf.state_dict(), cfg)
    state_dict = hf_llama.params_to_hf(params, cfg, framework="np")
    for name, value in hf.state_dict().items():
        if "rotary_emb" in name:
            continue
        np.testing.assert_array_equal(state_dict[name], value.numpy(), err_msg=name)
    back = hf_llama.params_from_hf(state_dict, cfg)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, params)


def test_converted_config_matches_the_hf_config():
    hf = _hf_model(tied=True, head_dim=16)
    cfg = hf_llama.llama_config_from_hf(hf.config)
    decoder = cfg.decoder
    attention = decoder.transformer.layer.self_attention.attention
    assert (decoder.vocab_size, decoder.dim, decoder.transformer.num_layers) == (VOCAB, 32, 2)
    assert attention.num_heads == 4 and attention.hidden_dim == 64
    assert attention.input_linear.input_linear.num_kv_heads == 2
    assert attention.input_linear.rope_pos_emb_layer.theta == 500000.0
    assert decoder.output_norm.eps == 1e-5 and decoder.lm_head is None
    assert (decoder.eos_token_id, decoder.pad_token_id) == (2, 0)


@pytest.mark.slow
def test_greedy_decoding_matches_hf_generate():
    hf = _hf_model()
    cfg = hf_llama.llama_config_from_hf(hf.config)
    cfg.decoder.eos_token_id = VOCAB + 5  # Never produced: both run to the same length.
    params = hf_llama.params_from_hf(hf.state_dict(), cfg)
    model = cfg.instantiate(parent=None)
    prompt = _ids(batch=1, seq=4, seed=3)
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor(prompt), max_new_tokens=8, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        ).numpy()
    out, _ = F(model, state=params, inputs=dict(prompt_ids=jnp.asarray(prompt), max_len=12),
               prng_key=None, is_training=False, method="greedy_decode")
    np.testing.assert_array_equal(out["sequences"], expected)


def test_non_llama_configs_are_rejected_with_the_field_path():
    cfg = hf_llama.llama_model_config(
        vocab_size=VOCAB, dim=32, num_layers=1, num_heads=4, num_kv_heads=2, hidden_dim=40
    )
    cfg.decoder.transformer.layer.self_attention.attention.input_linear.rotary_value = True
    with pytest.raises(ConfigError, match="rotary_value"):
        hf_llama.llama_dims(cfg)


def test_unsupported_hf_options_are_rejected():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      attention_bias=True)
    with pytest.raises(ConfigError, match="attention_bias"):
        hf_llama.llama_config_from_hf(config)


# Head dim 8 at theta 5e5: wavelengths 6.3, 167, 4.4e3 and 1.2e5 positions. With a context
# of 400, llama3 keeps the first (< 400/4), interpolates the second and divides the others.
ROPE_SCALINGS = {
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=400),
    "linear": dict(rope_type="linear", factor=4.0),
}


@pytest.mark.parametrize("rope_type", sorted(ROPE_SCALINGS))
def test_rope_scaling_gives_hf_logits(rope_type):
    hf = _hf_model(rope_scaling=dict(ROPE_SCALINGS[rope_type]))  # transformers edits it.
    default_inv_freq = 500000.0 ** (-np.arange(0, 8, 2) / 8)
    assert not np.allclose(hf.model.rotary_emb.inv_freq.numpy(), default_inv_freq)  # Scaled.
    cfg = hf_llama.llama_config_from_hf(hf.config)
    params = hf_llama.params_from_hf(hf.state_dict(), cfg)
    ids = _ids(batch=1, seq=24, seed=4)
    _assert_close(_our_logits(cfg, params, ids), _hf_logits(hf, ids))
    assert hf_llama.hf_config_dict(cfg)["rope_scaling"] == ROPE_SCALINGS[rope_type]


@pytest.mark.parametrize(
    "path,value",
    [
        ("decoder.logits_soft_cap", 30.0),
        ("decoder.transformer.layer.self_attention.attention.atten_logit_cap", 50.0),
        ("decoder.transformer.layer.self_attention.attention.query_scale.scale_factor", 1.0),
        ("decoder.transformer.layer.feed_forward.residual_weight", 0.5),
        ("decoder.transformer.layer.self_attention.norm.eps", 1e-3),
    ],
)
def test_export_refuses_each_field_a_llama_cannot_express_by_name(path, value):
    cfg = hf_llama.llama_model_config(
        vocab_size=VOCAB, dim=32, num_layers=1, num_heads=4, num_kv_heads=2, hidden_dim=40
    )
    set_recursively(cfg, path, value)
    with pytest.raises(ConfigError, match=re.escape(f"{path} is {value!r}")):
        hf_llama.hf_config_dict(cfg)


def test_settings_that_keep_the_function_export_and_qk_norm_is_refused():
    from experiments import gpt  # pylint: disable=import-outside-toplevel

    dims = hf_llama.llama_dims(gpt.named_trainer_configs()["gpt_1b"]().model)
    assert (dims.num_layers, dims.dim, dims.tied) == (16, 2048, True)
    with pytest.raises(ConfigError, match=re.escape("query_scale.norm is RMSNorm")):
        hf_llama.llama_dims(gpt.named_trainer_configs()["gpt_test"]().model)


def _config_json(**changes):
    config = dict(
        model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        rope_theta=10000.0, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    config.update(changes)
    return config


def test_unsupported_hf_fields_are_all_named():
    config = _config_json(
        hidden_act="gelu", mlp_bias=True, rope_scaling=dict(rope_type="yarn", factor=2.0)
    )
    with pytest.raises(ConfigError) as error:
        hf_llama.llama_config_from_hf(config)
    for name in ("hidden_act", "mlp_bias", "'yarn'"):
        assert name in str(error.value)


def test_a_list_of_eos_ids_and_no_pad_id_are_kept_both_ways():
    cfg = hf_llama.llama_config_from_hf(_config_json(eos_token_id=[3, 4, 5], pad_token_id=None))
    assert cfg.decoder.eos_token_id == [3, 4, 5] and cfg.decoder.pad_token_id is None
    config = hf_llama.hf_config_dict(cfg)
    assert config["eos_token_id"] == [3, 4, 5] and config["pad_token_id"] is None
    assert hf_llama.generation_config_dict(cfg) == {"eos_token_id": [3, 4, 5]}
    # generation_config.json's ids win over config.json's (Llama 3 Instruct lists end-of-turn).
    cfg = hf_llama.llama_config_from_hf(
        _config_json(eos_token_id=3), generation_config={"eos_token_id": [3, 7]}
    )
    assert cfg.decoder.eos_token_id == [3, 7]


def test_warm_start_takes_sizes_from_hf_and_sharding_from_the_recipe(tmp_path):
    from experiments import gpt  # pylint: disable=import-outside-toplevel

    (tmp_path / "config.json").write_text(json.dumps(_config_json(pad_token_id=None)))
    recipe = gpt.named_trainer_configs()["gpt_1b"]().model
    cfg = hf_llama.warm_start_model_config(recipe, str(tmp_path))
    assert hf_llama.llama_dims(cfg) == hf_llama.LlamaDims(
        vocab_size=VOCAB, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        hidden_dim=48, tied=False, repeated=True,
    )
    layer, recipe_layer = cfg.decoder.transformer.layer, recipe.decoder.transformer.layer
    assert layer.remat_spec == recipe_layer.remat_spec
    assert layer.feed_forward.linear1.param_partition_spec == (
        recipe_layer.feed_forward.linear1.param_partition_spec
    )
    assert cfg.z_loss_scale == recipe.z_loss_scale and cfg.decoder.pad_token_id is None
    # The recipe ties its head; the untied head is split like the table, transposed.
    table = recipe.decoder.emb.token_emb.param_partition_spec
    assert cfg.decoder.lm_head.param_partition_spec == tuple(reversed(tuple(table)))


def test_export_refuses_a_directory_holding_weights(tmp_path):
    cfg = hf_llama.llama_model_config(
        vocab_size=VOCAB, dim=16, num_layers=1, num_heads=2, num_kv_heads=1, hidden_dim=24
    )
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ConfigError, match="model.safetensors.index.json"):
        hf_llama.write_hf_model({}, cfg, str(tmp_path))


def test_a_stack_of_per_layer_configs_is_refused_naming_the_field():
    cfg = hf_llama.llama_model_config(
        vocab_size=32, dim=8, num_layers=2, num_heads=2, num_kv_heads=1, hidden_dim=16,
        repeated=False,
    )
    layer = cfg.decoder.transformer.layer
    cfg.decoder.transformer.layer = [layer.clone(), layer.clone()]
    with pytest.raises(ConfigError, match=r"decoder\.transformer\.layer: a list"):
        hf_llama.llama_dims(cfg)


def test_export_config_keeps_the_fields_of_the_model_it_started_from(tmp_path):
    source = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=7, eos_token_id=8,
        max_position_embeddings=512, initializer_range=0.05,
    )
    source.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    cfg = hf_llama.llama_config_from_hf(written)
    fields = hf_llama.source_fields(str(tmp_path))
    config = hf_llama.hf_config_dict(cfg, source=fields)
    for field in ("bos_token_id", "max_position_embeddings", "initializer_range"):
        assert config[field] == written[field], field
    # What the model config computes is not taken from the source: it is the model's.
    assert config["hidden_size"] == 32 and config["eos_token_id"] == 8
    assert hf_llama.generation_config_dict(cfg, source=fields)["bos_token_id"] == 7
    # The config transformers builds from it is the source's, field for field.
    rebuilt = transformers.LlamaConfig(**config).to_dict()
    for field in ("bos_token_id", "max_position_embeddings", "initializer_range"):
        assert rebuilt[field] == source.to_dict()[field], field
