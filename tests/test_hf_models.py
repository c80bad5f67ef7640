"""hf_models: our Qwen2, Qwen3, Qwen3-MoE and Mistral models against transformers' (torch,
CPU): logits, greedy generation, export reloaded, --init_from_hf; refusals by name."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import generate, hf_models, trainer_dir
from axlearn.common.attention import SlidingWindowAttentionLogitBiasLayer
from axlearn.common.config import ConfigError
from axlearn.common.layers import RMSNorm
from axlearn.common.module import functional as F
from tests.fresh_python import REPO, fresh_env

VOCAB = 61
# torch and transformers take seconds to import: only the tests that compare with them
# (marked slow) do.
slow_with_hf = pytest.mark.slow

# (model_type, config fields): one shape per family, each with its features on.
SHAPES = {
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2_sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0,
                                    num_key_value_heads=4)),
    "qwen3_bias_mqa": ("qwen3", dict(attention_bias=True, num_key_value_heads=1, head_dim=16)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                    moe_intermediate_size=16, num_hidden_layers=3)),
    "mistral_sliding": ("mistral", dict(sliding_window=5)),
}


def _transformers():
    return pytest.importorskip("torch"), pytest.importorskip("transformers")


def _hf_config(model_type, **fields):
    _, transformers = _transformers()
    base = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
        rope_theta=10000.0, eos_token_id=2, pad_token_id=0, initializer_range=0.2,
    )
    base.update(fields)
    return transformers.AutoConfig.for_model(model_type, **base)


def _hf_model(shape, seed=0):
    torch, transformers = _transformers()
    model_type, fields = SHAPES[shape]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(model_type, **fields)).eval()
    with torch.no_grad():  # HF starts norms at one, biases and the router near zero.
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias") or name.endswith("mlp.gate.weight"):
                param.add_(0.3 * torch.randn_like(param))
    return model


def _ids(batch=2, seq=12, seed=1):
    return np.random.RandomState(seed).randint(3, VOCAB, size=(batch, seq))


def _hf_logits(model, ids):
    torch, _ = _transformers()
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def _our_logits(cfg, params, ids):
    model = cfg.clone(name="model").instantiate(parent=None)
    out, _ = F(model.decoder, state=params["decoder"], inputs=(jnp.asarray(ids),),
               prng_key=None, is_training=False)
    return np.asarray(out["logits"])


def _assert_close(actual, expected):
    assert np.max(np.abs(actual - expected)) <= 1e-4 * np.max(np.abs(expected))


@slow_with_hf
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_converted_hf_weights_give_hf_logits(shape):
    hf_model = _hf_model(shape)
    cfg = hf_models.model_config_from_hf(hf_model.config)
    params = hf_models.params_from_hf(hf_model.state_dict(), cfg)
    ids = _ids()
    _assert_close(_our_logits(cfg, params, ids), _hf_logits(hf_model, ids))


@slow_with_hf
@pytest.mark.parametrize("shape", ["qwen3_moe", "qwen2_sliding"])
def test_our_weights_loaded_into_transformers_give_our_logits(shape):
    model_type, fields = SHAPES[shape]
    cfg = hf_models.model_config_from_hf(_hf_config(model_type, **fields))
    model = cfg.clone(name="model").instantiate(parent=None)
    params = model.initialize_parameters_recursively(jax.random.PRNGKey(3))
    params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(4), x.shape),
                          params)  # Biases and norms off their constant starts.
    _, transformers = _transformers()
    hf_config = hf_models.hf_config_object(cfg, model_type=model_type)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    hf_model.load_state_dict(hf_models.params_to_hf(params, cfg, model_type=model_type))
    ids = _ids(seed=2)
    _assert_close(_hf_logits(hf_model, ids), _our_logits(cfg, params, ids))


def _hf_greedy(hf_model, prompt, max_new_tokens):
    torch, _ = _transformers()
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


@slow_with_hf
@pytest.mark.parametrize("shape", ["qwen2_sliding", "qwen3_bias_mqa", "qwen3_moe",
                                   "mistral_sliding"])
def test_export_reloads_in_transformers_and_generates_greedily_as_transformers(shape, tmp_path):
    # Prompts and continuations longer than the sliding windows: decoding masks the cache.
    _, transformers = _transformers()
    hf_model = _hf_model(shape, seed=5)
    cfg = hf_models.model_config_from_hf(hf_model.config)
    params = hf_models.params_from_hf(hf_model.state_dict(), cfg)
    written = hf_models.write_hf_model(
        params, cfg, str(tmp_path), model_type=hf_model.config.model_type, dtype="float32"
    )
    assert "config.json" in written
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(hf_model)
    ids = _ids(seed=3)
    _assert_close(_hf_logits(reloaded, ids), _hf_logits(hf_model, ids))
    prompts = [[5, 9, 17, 3, 44, 12, 8], [40, 22]]
    expected = [_hf_greedy(hf_model, p, 10) for p in prompts]
    generator, _ = generate.from_hf_dir(str(tmp_path), dtype="float32", devices=1)
    generator.set_eos_ids([VOCAB + 1])  # No EOS: all 10 tokens.
    outputs, _ = generator.generate(prompts, max_new_tokens=10, batch_size=2)
    assert outputs == expected


@slow_with_hf
def test_biased_qkv_split_for_several_devices_loads_and_decodes_as_transformers(tmp_path):
    # On several devices q/k/v are three projections (generate.decoding_config): Qwen2's
    # fused bias is split with its weight, from the files and from a checkpoint alike.
    hf_model = _hf_model("qwen2_tied", seed=6)
    hf_model.save_pretrained(tmp_path)
    fused = hf_models.model_config_from_hf(hf_model.config, repeated=False)
    split = generate.decoding_config(fused, num_devices=2)
    specs = split.clone(name="model").instantiate(parent=None)
    specs = specs.create_parameter_specs_recursively()
    mesh = generate.make_mesh(1)
    loaded = generate._load_hf_for_decoding(  # pylint: disable=protected-access
        str(tmp_path), fused, split, specs, generate.tensor_parallel_shardings(specs, mesh)
    )
    unfused = generate.unfuse_qkv(
        hf_models.params_from_hf(hf_model.state_dict(), fused), fused, split
    )
    attention = unfused["decoder"]["transformer"]["layer0"]["self_attention"]["attention"]
    assert sorted(attention["i_proj"]["i_proj"]["q_proj"]) == ["bias", "weight"]
    prompts = [[5, 9, 17], [40, 22, 3, 8]]
    expected = [_hf_greedy(hf_model, p, 6) for p in prompts]
    for params in (loaded, unfused):
        generator = generate.Generator(split, params)
        generator.set_eos_ids([VOCAB + 1])
        assert generator.generate(prompts, max_new_tokens=6)[0] == expected


@slow_with_hf
def test_a_qwen3_moe_run_warm_starts_trains_and_exports_for_transformers(tmp_path):
    _, transformers = _transformers()
    hf_dir, run_dir, out_dir = tmp_path / "hf", tmp_path / "run", tmp_path / "out"
    _hf_model("qwen3_moe").save_pretrained(hf_dir)
    run = [
        sys.executable, "-m", "axlearn.common.launch_trainer_main", "--config=gpt_test",
        "--data_dir=FAKE", "--jax_backend=cpu", f"--init_from_hf={hf_dir}",
        f"--trainer_dir={run_dir}", "--config_override=input.global_batch_size=2",
        "--config_override=input.max_sequence_length=16",
        "--config_override=evalers['validation'].input.global_batch_size=2",
        "--config_override=evalers['validation'].input.max_sequence_length=16",
        "--config_override=max_step=2",
    ]
    env = fresh_env(1)
    result = subprocess.run(run, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "a Qwen3-MoE of 3 layers" in result.stderr and "step 2/2 | loss" in result.stderr
    export = [sys.executable, "-m", "axlearn.common.hf_models", "export",
              f"--trainer_dir={run_dir}", f"--output={out_dir}", "--dtype=float32"]
    result = subprocess.run(export, env=env, cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "as Qwen3MoeForCausalLM" in result.stdout
    with open(out_dir / "config.json", encoding="utf-8") as f:
        assert json.load(f)["initializer_range"] == 0.2  # A source field, kept.
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
    cfg = trainer_dir.read_trainer_config(str(run_dir))
    _, params = trainer_dir.restore_model_params(str(run_dir))
    ids = _ids(seed=4)
    _assert_close(_hf_logits(reloaded, ids), _our_logits(cfg.model, params, ids))


# ----- refusals and the window, without transformers -----


def _qwen_json(model_type="qwen3", **fields):
    config = dict(
        model_type=model_type, vocab_size=VOCAB, hidden_size=32, intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True, eos_token_id=2,
    )
    config.update(fields)
    return config


def test_unsupported_hf_fields_are_refused_by_name():
    with pytest.raises(ConfigError) as error:
        hf_models.model_config_from_hf(_qwen_json(
            "qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
            norm_topk_prob=False, mlp_only_layers=[1], hidden_act="gelu",
        ))
    message = str(error.value)
    for field in ("norm_topk_prob=False", "mlp_only_layers=[1]", "hidden_act='gelu'"):
        assert field in message, message


def test_a_sliding_window_on_some_layers_only_is_refused_by_name():
    config = _qwen_json("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    with pytest.raises(ConfigError, match="layer_types=.*max_window_layers=1"):
        hf_models.model_config_from_hf(config)
    # A window that Qwen's use_sliding_window turns off is no window.
    config = _qwen_json("qwen2", use_sliding_window=False, sliding_window=8)
    assert hf_models.model_config_from_hf(config).decoder.attention_mask == "causal"


def test_qk_norm_after_rope_is_refused_as_no_hf_qwen3():
    # AXLearn's Qwen3 configs normalize queries and keys in query_scale/key_scale, after
    # the rotary embeddings: another function than Hugging Face's Qwen3 (norm, then RoPE).
    cfg = hf_models.family_model_config(
        "llama", vocab_size=VOCAB, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
        hidden_dim=24,
    )
    attention = cfg.decoder.transformer.layer.self_attention.attention
    attention.query_scale.norm = RMSNorm.default_config()
    with pytest.raises(ConfigError, match=r"query_scale\.norm is RMSNorm"):
        hf_models.model_dims(cfg)


def test_the_sliding_window_lets_a_token_see_itself_and_the_window_before_it():
    layer = SlidingWindowAttentionLogitBiasLayer.default_config().set(
        name="mask", sliding_window_size=2
    ).instantiate(parent=None)
    positions = jnp.arange(6)[None]
    segments = jnp.asarray([[1, 1, 1, 1, 2, 2]])
    biases, _ = F(layer, state={}, inputs=dict(segment_ids=segments, positions=positions),
                  prng_key=None, is_training=False)
    q, k = np.arange(6)[:, None], np.arange(6)[None, :]
    expected = (k <= q) & (q - k <= 2) & (np.asarray(segments[0])[:, None] == segments[0][None])
    np.testing.assert_array_equal(np.asarray(biases[0, 0]) == 0, expected)


def test_a_run_that_did_not_start_from_hf_exports_as_the_family_its_features_name():
    sizes = dict(vocab_size=VOCAB, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                 hidden_dim=24)
    families = {
        "llama": {},
        "qwen2": dict(qkv_bias=True),
        "qwen3": dict(qk_norm=True),
        "qwen3_moe": dict(qk_norm=True, num_experts=4, num_experts_per_token=2),
        "mistral": dict(sliding_window=8),
    }
    for model_type, features in families.items():
        cfg = hf_models.family_model_config(model_type, **sizes, **features)
        found, _ = hf_models.model_dims(cfg)
        assert found.model_type == model_type
        assert hf_models.hf_config_dict(cfg)["model_type"] == model_type
    with pytest.raises(ConfigError, match="qkv_bias=True .a Mistral has False"):
        hf_models.family_model_config("mistral", **sizes, qkv_bias=True)
