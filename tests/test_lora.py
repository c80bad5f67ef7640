"""lora and hf_peft: LoRA layers against peft's on the same weights (torch, CPU, float32),
PEFT adapter directories both ways, merging, and freezing through the learner."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import hf_llama, hf_peft, lora
from axlearn.common.config import ConfigError, config_for_function
from axlearn.common.learner import Learner
from axlearn.common.module import functional as F
from axlearn.common.optimizers import optax_optimizer
from axlearn.common.utils import flatten_with_paths

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 61
ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _hf_model(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
        rope_theta=10000.0, eos_token_id=2, pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _peft_model(hf, targets=ALL_SEVEN, rank=4, alpha=8.0, seed=1):
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets),
        init_lora_weights=False,  # Random A and B: a zero B would hide B's mapping.
    )
    return peft.get_peft_model(hf, config).eval()


def _modifier(targets=ALL_SEVEN, rank=4, alpha=8.0):
    return lora.LoraConfigModifier.default_config().set(
        target_modules=list(targets), rank=rank, alpha=alpha, base_dtype=None
    ).instantiate()


def _ours(hf, targets=ALL_SEVEN, rank=4, alpha=8.0, repeated=True):
    """(LoRA model config, model, specs, base params) for the HF model's weights."""
    base_cfg = hf_llama.llama_config_from_hf(hf.config, repeated=repeated)
    base_params = hf_llama.params_from_hf(
        hf.state_dict(), base_cfg
    )
    cfg = _modifier(targets, rank, alpha).apply_to_model(base_cfg.clone())
    model = cfg.clone(name="model").instantiate(parent=None)
    return cfg, model, model.create_parameter_specs_recursively(), base_params


def _peft_state(peft_model):
    return {
        name.replace(".default.weight", ".weight"): p.detach().clone()
        for name, p in peft_model.named_parameters()
        if "lora_" in name
    }


def _our_params(model, specs, base_params, tensors):
    base = dict(flatten_with_paths(base_params))
    adapters = {k: jnp.asarray(v) for k, v in
                hf_peft.adapter_params_from_peft(model, specs, tensors).items()}
    return lora.join_params(model, specs, base, adapters)


def _logits(model, params, ids):
    def run(p, ids):
        out, _ = F(model.decoder, state=p["decoder"], inputs=(ids,), prng_key=None,
                   is_training=False)
        return out["logits"]

    return np.asarray(jax.jit(run)(params, jnp.asarray(ids)))


def _ids(batch=2, seq=7, seed=2):
    return np.random.RandomState(seed).randint(3, VOCAB, size=(batch, seq))


def _close(actual, expected, tol=1e-4):
    rel = np.max(np.abs(actual - expected)) / np.max(np.abs(expected))
    assert rel < tol, rel


@pytest.mark.slow
def test_lora_forward_and_adapter_gradients_equal_peft():
    hf = _hf_model()
    _, model, specs, base_params = _ours(hf)
    pm = _peft_model(hf)
    params = _our_params(model, specs, base_params, _peft_state(pm))
    ids = _ids()
    probe = np.random.RandomState(3).randn(2, 7, VOCAB).astype(np.float32)

    out = pm(torch.tensor(ids)).logits
    (out * torch.tensor(probe)).sum().backward()
    torch_grads = {
        name.replace(".default.weight", ".weight"): p.grad.numpy()
        for name, p in pm.named_parameters() if "lora_" in name
    }
    _close(_logits(model, params, ids), out.detach().numpy())

    def objective(p):
        out, _ = F(model.decoder, state=p["decoder"], inputs=(jnp.asarray(ids),),
                   prng_key=None, is_training=False)
        return jnp.sum(out["logits"] * probe)

    grads = hf_peft.peft_tensors(model, jax.grad(objective)(params))
    assert sorted(grads) == sorted(torch_grads)
    for name, grad in grads.items():
        _close(grad, torch_grads[name], tol=1e-4)


@pytest.mark.slow
def test_adapters_disabled_computes_the_base_model():
    hf = _hf_model()
    _, model, specs, base_params = _ours(hf, repeated=False)
    pm = _peft_model(hf)
    params = _our_params(model, specs, base_params, _peft_state(pm))
    ids = _ids()
    with lora.adapters_disabled():
        disabled = _logits(model, params, ids)
    with pm.disable_adapter(), torch.no_grad():
        expected = pm(torch.tensor(ids)).logits.numpy()
    _close(disabled, expected)
    assert np.max(np.abs(_logits(model, params, ids) - disabled)) > 1e-3


@pytest.mark.slow
def test_peft_adapter_round_trip(tmp_path):
    hf = _hf_model()
    cfg, model, specs, base_params = _ours(hf, targets=["q_proj", "v_proj", "down_proj"])
    pm = _peft_model(hf, targets=["q_proj", "v_proj", "down_proj"])
    state = _peft_state(pm)
    params = _our_params(model, specs, base_params, state)
    written = hf_peft.write_adapter(str(tmp_path / "adapter"), model, params)
    assert written == ["adapter_config.json", "adapter_model.safetensors"]
    # peft reads it onto a fresh transformers model: the same logits as ours.
    loaded = peft.PeftModel.from_pretrained(_hf_model(), str(tmp_path / "adapter")).eval()
    ids = _ids()
    with torch.no_grad():
        _close(loaded(torch.tensor(ids)).logits.numpy(), _logits(model, params, ids))
    # And back: the adapters as peft holds them.
    back = hf_peft.read_adapter(str(tmp_path / "adapter"), model, specs)
    ours = dict(flatten_with_paths(params))
    for path, value in back.items():
        np.testing.assert_array_equal(value, np.asarray(ours[path]))
    np.testing.assert_array_equal(
        back["decoder/transformer/repeat/layer/self_attention/attention/i_proj/i_proj/"
             "adapter/lora_down/weight"][1, :, 1].T,
        state["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"].numpy(),
    )
    del cfg


@pytest.mark.slow
def test_merged_weights_give_transformers_our_logits():
    hf = _hf_model()
    cfg, model, specs, base_params = _ours(hf)
    pm = _peft_model(hf)
    params = _our_params(model, specs, base_params, _peft_state(pm))
    merged = lora.merged_params(model, params)
    base_cfg = lora.base_model_config(cfg)
    target = _hf_model(seed=5)
    target.load_state_dict(hf_llama.params_to_hf(merged, base_cfg))
    ids = _ids()
    with torch.no_grad():
        _close(target(torch.tensor(ids)).logits.numpy(), _logits(model, params, ids))


@pytest.mark.slow
@pytest.mark.parametrize(
    "change,message",
    [
        (dict(r=8), "r is 8"),
        (dict(target_modules=["q_proj", "v_proj"]), "target_modules"),
        (dict(use_dora=True), "use_dora"),
    ],
)
def test_an_adapter_config_for_another_model_is_refused_naming_the_file(
    tmp_path, change, message
):
    hf = _hf_model()
    _, model, specs, base_params = _ours(hf)
    pm = _peft_model(hf, targets=ALL_SEVEN)
    params = _our_params(model, specs, base_params, _peft_state(pm))
    directory = tmp_path / "adapter"
    hf_peft.write_adapter(str(directory), model, params)
    config_path = directory / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config.update(change)
    config_path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"{config_path}.*{message}"):
        hf_peft.read_adapter(str(directory), model, specs)


@pytest.mark.slow
def test_adapter_tensors_of_another_shape_are_refused_naming_the_file(tmp_path):
    hf = _hf_model()
    _, model, specs, base_params = _ours(hf, rank=4)
    # A rank-2 adapter whose config claims rank 4: the tensors give it away.
    pm = _peft_model(_hf_model(), rank=2, alpha=8.0)
    pm.save_pretrained(str(tmp_path / "adapter"))
    config_path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["r"] = 4
    config_path.write_text(json.dumps(config))
    weights = os.path.join(str(tmp_path / "adapter"), "adapter_model.safetensors")
    with pytest.raises(ConfigError, match=f"{weights}: .* has shape"):
        hf_peft.read_adapter(str(tmp_path / "adapter"), model, specs)


def test_the_modifier_freezes_all_but_the_adapters_in_bf16():
    hf = _hf_model()
    base_cfg = hf_llama.llama_config_from_hf(hf.config)
    cfg = lora.LoraConfigModifier.default_config().set(
        target_modules=ALL_SEVEN, rank=4, alpha=8.0
    ).instantiate().apply_to_model(base_cfg)
    specs = cfg.clone(name="model").instantiate(parent=None).create_parameter_specs_recursively()
    dtypes = {path: spec.dtype for path, spec in flatten_with_paths(
        specs, is_leaf=lambda x: hasattr(x, "shape"))}
    adapters = {p for p in dtypes if "/adapter/" in p}
    assert len(adapters) == 2 * 5  # Fused QKV, o_proj, linear1_0, linear1_1, linear2.
    assert all(dtypes[p] == jnp.float32 for p in adapters)
    assert all(dtypes[p] == jnp.bfloat16 for p in set(dtypes) - adapters)


def test_gate_without_up_is_refused():
    with pytest.raises(ConfigError, match="gate_proj and up_proj"):
        _modifier(targets=["gate_proj"]).apply_to_model(
            hf_llama.llama_config_from_hf(_hf_model().config)
        )


@pytest.mark.slow  # Compiles several models: seconds of the quick suite's budget.
def test_a_frozen_base_gets_no_gradient_no_update_and_no_optimizer_state():
    import optax  # pylint: disable=import-outside-toplevel

    rng = np.random.RandomState(0)
    params = {"linear": {  # As a LoraLinear's: its base layer and adapter.
        "layer": {"weight": jnp.asarray(rng.randn(8, 8), jnp.bfloat16)},
        "adapter": {
            "lora_down": {"weight": jnp.asarray(rng.randn(8, 2), jnp.float32)},
            "lora_up": {"weight": jnp.asarray(rng.randn(2, 8), jnp.float32)},
        },
    }}
    learner = Learner.default_config().set(
        name="learner",
        optimizer=config_for_function(optax_optimizer).set(
            transformation=config_for_function(optax.adam).set(learning_rate=0.1)
        ),
        update_rules=[(lora.ADAPTER_PARAM_REGEX, "all"), (".*", "no_update")],
    ).instantiate(parent=None)
    state = learner.init(params)
    x = jnp.asarray(rng.randn(4, 8), jnp.float32)

    def loss_fn(p, inputs, key):
        del key
        a = p["linear"]["adapter"]
        y = inputs @ p["linear"]["layer"]["weight"].astype(jnp.float32)
        y = y + inputs @ a["lora_down"]["weight"] @ a["lora_up"]["weight"]
        return jnp.mean(y**2), {}

    _, _, grads = learner.compute_gradients(loss_fn, params, x, None)
    assert grads["linear"]["layer"]["weight"] is None  # Not differentiated at all.
    # The adapters' gradients are the full function's (optax's reference: jax.grad).
    expected = jax.grad(lambda p: loss_fn(p, x, None)[0])(params)
    ours, theirs = grads["linear"]["adapter"], expected["linear"]["adapter"]
    for name in ("lora_down", "lora_up"):
        np.testing.assert_allclose(ours[name]["weight"], theirs[name]["weight"], rtol=1e-6)
    opt_paths = [p for p, v in flatten_with_paths(state["optimizer"]) if np.ndim(v) > 0]
    assert opt_paths and all("adapter/" in p for p in opt_paths)
    new_params, _, _ = learner.update(params, grads, state)
    new, old = new_params["linear"], params["linear"]
    assert new["layer"]["weight"] is old["layer"]["weight"]  # Passed through, still bf16.
    assert new["layer"]["weight"].dtype == jnp.bfloat16
    for name in ("lora_down", "lora_up"):
        assert not np.array_equal(new["adapter"][name]["weight"], old["adapter"][name]["weight"])
