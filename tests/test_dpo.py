"""DPOModel and preference_loss: the losses and their gradients against trl's own loss
code on the same log-probabilities, the reference options (the LoRA base with its adapters
off against a plain model loaded alone), the trl-named summaries."""

import collections
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import dpo, hf_llama, lora
from axlearn.common.config import ConfigError
from axlearn.common.hf_llama import llama_model_config
from axlearn.common.module import functional

B, T = 4, 6
# The comparisons with trl are slow: importing trl (transformers, accelerate, datasets)
# alone takes about 9 s of CPU.
trl_test = pytest.mark.slow


def _trl(module: str):
    pytest.importorskip("torch")
    return pytest.importorskip(module)


def _token_logps_and_masks(seed: int = 0):
    """Per-token log-probs [2B, T] (chosen rows, then rejected rows) and response masks."""
    rng = np.random.default_rng(seed)
    logps = -rng.uniform(0.1, 3.0, size=(2 * B, T)).astype(np.float32)
    lengths = rng.integers(1, T + 1, size=2 * B)
    mask = (np.arange(T)[None, :] >= T - lengths[:, None]).astype(np.float32)
    ref = -rng.uniform(0.1, 3.0, size=(2 * B,)).astype(np.float32)
    return logps * mask, mask, ref


def _trl_dpo_loss(token_logps, mask, ref, *, loss_type, beta):
    """trl's DPOTrainer._compute_loss on given per-token log-probs (its model and
    accelerator replaced by the least that call path reads), and the gradient of its loss
    with respect to those log-probs."""
    torch = _trl("torch")
    trl_dpo = _trl("trl.trainer.dpo_trainer")
    leaf = torch.tensor(token_logps, requires_grad=True)
    zeros = torch.zeros(2 * B, T)
    # trl sums log_probs over the sequence as its model gives them (zero at labels -100,
    # outside the responses); its completion_mask has one more leading column (the
    # first token, never scored).
    outputs = types.SimpleNamespace(
        log_probs=leaf * torch.tensor(mask), entropy=zeros, mean_logits=zeros, is_top1=zeros.bool()
    )
    mask_full = torch.tensor(np.concatenate([np.zeros((2 * B, 1), np.float32), mask], axis=1))
    model = lambda **kwargs: outputs  # noqa: E731
    model.training = True
    accelerator = types.SimpleNamespace(
        device="cpu", gather=lambda x: x, gather_for_metrics=lambda x: x
    )
    trainer = types.SimpleNamespace(
        model=model, accelerator=accelerator, aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type],
        loss_weights=[1.0], beta=beta, label_smoothing=0.0, use_weighting=False,
        _metrics={"train": collections.defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )
    inputs = dict(
        input_ids=torch.zeros(2 * B, T + 1, dtype=torch.long),
        attention_mask=torch.ones(2 * B, T + 1, dtype=torch.long),
        completion_mask=mask_full,
        ref_chosen_logps=torch.tensor(ref[:B]),
        ref_rejected_logps=torch.tensor(ref[B:]),
    )
    loss = trl_dpo.DPOTrainer._compute_loss(trainer, model, inputs, False)
    loss.backward()
    return float(loss.detach()), leaf.grad.numpy(), trainer._metrics["train"]


def _ours(token_logps, mask, ref, **kwargs):
    """Our mean loss and its gradient with respect to the per-token log-probs."""

    def loss_fn(token_logps):
        logps = jnp.sum(token_logps * mask, axis=-1)
        lengths = jnp.sum(mask, axis=-1)
        losses, chosen, rejected = dpo.preference_loss(
            chosen_logps=logps[:B], rejected_logps=logps[B:],
            reference_chosen_logps=ref[:B], reference_rejected_logps=ref[B:],
            chosen_lengths=lengths[:B], rejected_lengths=lengths[B:], **kwargs,
        )
        return jnp.mean(losses), (chosen, rejected)

    (loss, rewards), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(token_logps))
    return float(loss), np.asarray(grad), rewards


@trl_test
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_and_ipo_losses_and_gradients_match_trl(loss_type):
    token_logps, mask, ref = _token_logps_and_masks()
    want_loss, want_grad, metrics = _trl_dpo_loss(token_logps, mask, ref, loss_type=loss_type, beta=0.3)
    loss, grad, (chosen, rejected) = _ours(token_logps, mask, ref, loss_type=loss_type, beta=0.3)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(jnp.mean(chosen)), metrics["rewards/chosen"][0], rtol=1e-5)
    margins = chosen - rejected
    np.testing.assert_allclose(float(jnp.mean(margins)), metrics["rewards/margins"][0], rtol=1e-5)
    assert float(jnp.mean(margins > 0)) == metrics["rewards/accuracies"][0]


@trl_test
def test_reference_free_dpo_matches_trl_with_zero_reference():
    token_logps, mask, ref = _token_logps_and_masks(1)
    zero = np.zeros_like(ref)
    want_loss, want_grad, _ = _trl_dpo_loss(token_logps, mask, zero, loss_type="sigmoid", beta=0.1)
    loss, grad, _ = _ours(token_logps, mask, zero, loss_type="sigmoid", beta=0.1)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)


def _trl_cpo_loss(
    token_logps, mask, *, loss_type, beta, label_smoothing, simpo_gamma=0.0, reference=None
):
    """trl's CPOTrainer.cpo_loss (SimPO; and the label-smoothed sigmoid, which trl's
    DPOTrainer no longer has: fed log-ratios, it is conservative DPO) of summed or, for
    SimPO, averaged log-probs, less `reference` [2B] where given."""
    torch = _trl("torch")
    trl_cpo = _trl("trl.experimental.cpo.cpo_trainer")
    leaf = torch.tensor(token_logps, requires_grad=True)
    m = torch.tensor(mask)
    logps = (leaf * m).sum(-1)
    if loss_type == "simpo":
        logps = logps / m.sum(-1)
    if reference is not None:
        logps = logps - torch.tensor(reference)
    trainer = types.SimpleNamespace(
        alpha=0.0, loss_type=loss_type, beta=beta, label_smoothing=label_smoothing,
        simpo_gamma=simpo_gamma, accelerator=types.SimpleNamespace(device="cpu"),
    )
    losses, _, _ = trl_cpo.CPOTrainer.cpo_loss(trainer, logps[:B], logps[B:])
    loss = losses.mean()
    loss.backward()
    return float(loss.detach()), leaf.grad.numpy()


@trl_test
def test_simpo_loss_and_gradient_match_trl():
    token_logps, mask, _ = _token_logps_and_masks(2)
    kwargs = dict(beta=2.0, label_smoothing=0.1, simpo_gamma=0.7)
    want_loss, want_grad = _trl_cpo_loss(token_logps, mask, loss_type="simpo", **kwargs)
    zero = np.zeros(2 * B, np.float32)
    loss, grad, _ = _ours(token_logps, mask, zero, loss_type="simpo", **kwargs)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)


@trl_test
def test_label_smoothed_dpo_matches_trl_conservative_sigmoid():
    token_logps, mask, ref = _token_logps_and_masks(3)
    kwargs = dict(beta=0.5, label_smoothing=0.2)
    want_loss, want_grad = _trl_cpo_loss(
        token_logps, mask, loss_type="sigmoid", reference=ref, **kwargs
    )
    loss, grad, _ = _ours(token_logps, mask, ref, loss_type="sigmoid", **kwargs)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)


# ----- the model -----


def _policy_config():
    return llama_model_config(
        vocab_size=32, dim=8, num_layers=1, num_heads=2, num_kv_heads=1, hidden_dim=16
    )


def _pair_batch(seed: int = 0) -> dict[str, jnp.ndarray]:
    rng = np.random.default_rng(seed)
    batch = {}
    for side in dpo.SIDES:
        ids = rng.integers(3, 32, size=(2, 7)).astype(np.int32)
        weights = np.zeros((2, 6), np.float32)
        weights[:, 3:] = 1.0
        batch[f"{side}_input_ids"] = jnp.asarray(ids[:, :-1])
        batch[f"{side}_target_labels"] = jnp.asarray(ids[:, 1:])
        batch[f"{side}_target_weights"] = jnp.asarray(weights)
    return batch


def _model(**kwargs):
    cfg = dpo.DPOModel.default_config().set(name="model", policy=_policy_config(), **kwargs)
    return cfg.instantiate(parent=None)


def _run(model, params, batch):
    """((loss, aux), summaries) of the model's forward, jitted."""

    def run(params, batch):
        outputs, collection = functional(
            model, state=params, inputs=dict(input_batch=batch), prng_key=None, is_training=True
        )
        return outputs, collection.summaries

    return jax.jit(run)(params, batch)


def _numpy_response_logps(model, params, batch, side):
    """Summed response log-probs from the policy's logits, by NumPy log-softmax."""
    out, _ = functional(model.policy.decoder, state=params["policy"]["decoder"],
                        inputs=(batch[f"{side}_input_ids"],), prng_key=None, is_training=False)
    logits = np.asarray(out["logits"], np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    labels = np.asarray(batch[f"{side}_target_labels"])
    picked = np.take_along_axis(logp, labels[..., None], -1)[..., 0]
    return (picked * np.asarray(batch[f"{side}_target_weights"])).sum(-1)


@pytest.mark.slow
def test_frozen_copy_starts_equal_to_the_policy_and_gives_zero_rewards():
    model = _model(reference="frozen_copy")
    params = model.initialize_parameters_recursively(jax.random.PRNGKey(0))
    jax.tree.map(np.testing.assert_array_equal, params["reference"], params["policy"])
    (loss, aux), collection = _run(model, params, _pair_batch())
    np.testing.assert_allclose(float(loss), np.log(2.0), rtol=1e-6)  # d = 0: -log sigmoid(0).
    np.testing.assert_array_equal(np.asarray(aux["chosen_rewards"]), 0.0)
    assert set(dpo.METRIC_NAMES) <= set(collection)


@pytest.mark.slow  # Compiles several models: seconds of the quick suite's budget.
def test_response_log_probs_are_the_policy_logits_log_softmax_over_response_tokens():
    model = _model(reference="none")
    params = model.initialize_parameters_recursively(jax.random.PRNGKey(1))
    batch = _pair_batch(1)
    (_, aux), _ = _run(model, params, batch)
    for side in dpo.SIDES:
        want = _numpy_response_logps(model, params, batch, side)
        np.testing.assert_allclose(np.asarray(aux[f"{side}_logps"]), want, rtol=1e-5)


@pytest.mark.slow
def test_batch_reference_equals_the_frozen_copy_it_was_computed_with():
    frozen = _model(reference="frozen_copy")
    params = frozen.initialize_parameters_recursively(jax.random.PRNGKey(2))
    params["policy"] = jax.tree.map(lambda p: p * 1.1, params["policy"])
    batch = _pair_batch(2)
    (want, _), _ = _run(frozen, params, batch)
    ahead, _ = functional(frozen, state=params, inputs=dict(input_batch=batch), prng_key=None,
                          is_training=False, method="reference_log_probs")
    from_batch = _model(reference="batch")
    (loss, _), _ = _run(from_batch, {"policy": params["policy"]}, dict(batch, **ahead))
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)


@pytest.mark.slow
def test_frozen_reference_gets_no_gradient():
    model = _model(reference="frozen_copy")
    params = model.initialize_parameters_recursively(jax.random.PRNGKey(3))
    grads = jax.jit(jax.grad(lambda p: _run(model, p, _pair_batch(3))[0][0]))(params)
    for leaf in jax.tree.leaves(grads["reference"]):
        np.testing.assert_array_equal(np.asarray(leaf), 0.0)
    assert any(np.any(np.asarray(leaf) != 0) for leaf in jax.tree.leaves(grads["policy"]))


@pytest.mark.slow
def test_batch_reference_without_its_keys_names_them():
    model = _model(reference="batch")
    params = {"policy": model.policy.initialize_parameters_recursively(jax.random.PRNGKey(0))}
    with pytest.raises(KeyError, match="reference_chosen_logps"):
        _run(model, params, _pair_batch())


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(loss_type="kto"), "loss_type must be one of"),
        (dict(loss_type="simpo"), "SimPO is reference-free"),
        (dict(loss_type="ipo", label_smoothing=0.1), "IPO has none"),
        (dict(reference="ema"), "reference must be one of"),
    ],
)
def test_bad_settings_are_refused_by_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        _model(**fields)


def _load(model_cfg, init_params):
    """`model_cfg`'s parameters as `init_params` (an init_params config) loads them."""
    model = model_cfg.clone(name="model").instantiate(parent=None)
    specs = model.create_parameter_specs_recursively()
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    shardings = jax.tree.map(lambda _: cpu, specs, is_leaf=lambda x: hasattr(x, "shape"))
    return init_params.instantiate().load(
        model_config=model_cfg, param_specs=specs, shardings=shardings
    )


def _numpy_pair_logps(decoder, params, batch):
    """Summed response log-probs [2, B] (chosen, rejected) of `decoder`'s logits (one jitted
    call), by NumPy log-softmax."""
    ids = jnp.concatenate([batch[f"{side}_input_ids"] for side in dpo.SIDES])
    logits = jax.jit(lambda p, x: functional(
        decoder, state=p, inputs=(x,), prng_key=None, is_training=False)[0]["logits"])(params, ids)
    logits = np.asarray(logits, np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    labels = np.concatenate([np.asarray(batch[f"{side}_target_labels"]) for side in dpo.SIDES])
    weights = np.concatenate([np.asarray(batch[f"{side}_target_weights"]) for side in dpo.SIDES])
    picked = np.take_along_axis(logp, labels[..., None], -1)[..., 0]
    return (picked * weights).sum(-1).reshape(2, -1)


@pytest.mark.slow  # Compiles several models: seconds of the quick suite's budget.
def test_adapters_disabled_reference_equals_a_separately_loaded_base(tmp_path):
    base_cfg = _policy_config()
    base = base_cfg.clone(name="model").instantiate(parent=None)
    hf_llama.write_hf_model(
        jax.jit(base.initialize_parameters_recursively)(jax.random.PRNGKey(4)), base_cfg,
        str(tmp_path), dtype="float32",
    )
    weights = hf_llama.HfLlamaWeights.default_config().set(path=str(tmp_path))
    # The plain model, loaded by itself.
    base_params = _load(base_cfg, weights)
    # A LoRA policy on all seven maps under DPO, its base loaded from the same directory.
    policy_cfg = lora.LoraConfigModifier.default_config().set(
        target_modules=list(lora.PEFT_LLAMA_MODULES), rank=2, alpha=4.0, base_dtype=None
    ).instantiate().apply_to_model(_policy_config())
    dpo_cfg = dpo.DPOModel.default_config().set(policy=policy_cfg, reference="adapters_disabled")
    params = _load(dpo_cfg, dpo.DPOModel.init_params_config(weights))
    # Nonzero adapters: lora_up drawn at random (it starts at zero).
    rng = np.random.default_rng(5)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(rng.normal(size=x.shape), x.dtype)
        if "lora_up" in jax.tree_util.keystr(path) else x,
        params,
    )
    assert set(params) == {"policy"}  # No second copy of the weights.
    model = dpo_cfg.clone(name="model").instantiate(parent=None)
    batch = _pair_batch(4)
    reference = jax.jit(lambda p, b: functional(
        model, state=p, inputs=dict(input_batch=b), prng_key=None, is_training=False,
        method="reference_log_probs")[0])(params, batch)
    got = np.stack([np.asarray(reference[f"reference_{side}_logps"]) for side in dpo.SIDES])
    want = _numpy_pair_logps(base.decoder, base_params["decoder"], batch)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # The policy itself (adapters on) scores the responses otherwise.
    adapted = _numpy_pair_logps(model.policy.decoder, params["policy"]["decoder"], batch)
    assert np.min(np.abs(adapted - got)) > 1e-3
