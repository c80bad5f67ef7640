"""causal_lm's composable loss metrics: cross entropy, auxiliary losses that layers report,
weighted composites, and the model's default."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common.causal_lm import (
    AuxLossMetrics,
    CompositeLossMetrics,
    CrossEntropyLossMetrics,
    metrics_config,
)
from axlearn.common.config import ConfigError
from axlearn.common.hf_llama import llama_model_config
from axlearn.common.hf_mixtral import mixtral_model_config
from axlearn.common.module import functional as F

VOCAB, DIM, BATCH, SEQ = 29, 16, 2, 8


def _batch() -> dict[str, jax.Array]:
    rng = np.random.RandomState(0)
    ids = rng.randint(1, VOCAB, size=(BATCH, SEQ))
    labels = np.roll(ids, -1, axis=1)
    labels[0, -2:] = 0  # Padding: dead targets.
    return dict(input_ids=jnp.asarray(ids, jnp.int32), target_labels=jnp.asarray(labels, jnp.int32))


def _np_cross_entropy(logits, labels, z_loss_scale):
    """(mean cross entropy, mean z-loss) over live targets, in float64."""
    logits = np.asarray(logits, np.float64)
    labels = np.asarray(labels)
    live = labels > 0
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    target = np.take_along_axis(logits, np.maximum(labels, 0)[..., None], -1)[..., 0]
    n = live.sum()
    return ((lse - target) * live).sum() / n, z_loss_scale * (lse**2 * live).sum() / n


def _forward(cfg):
    model = cfg.set(name="model").instantiate(parent=None)
    params = model.initialize_parameters_recursively(jax.random.PRNGKey(0))
    run = jax.jit(
        lambda p, b: F(model, state=p, inputs=(b,), prng_key=None, is_training=True)
    )
    return run(params, _batch())


@pytest.fixture(name="moe_run", scope="module")
def fixture_moe_run():
    """A scanned two-layer Mixtral-shaped model whose loss is 0.5 x its aux loss plus the
    cross entropy with z-loss: ((loss, aux), output collection)."""
    cfg = mixtral_model_config(
        vocab_size=VOCAB, dim=DIM, num_layers=2, num_heads=2, num_kv_heads=1, hidden_dim=12,
        num_experts=4, num_experts_per_token=2, repeated=True,
    )
    cfg.z_loss_scale = 1e-2
    cfg.metrics.loss_weights = {"aux": 0.5}
    return _forward(cfg)


def test_composite_loss_is_the_weighted_sum_of_cross_entropy_and_aux_loss(moe_run):
    (loss, aux), collection = moe_run
    cross_entropy, z_loss = _np_cross_entropy(aux["logits"], _batch()["target_labels"], 1e-2)
    per_layer = collection.module_outputs["decoder"]["transformer"]["repeat"]["layer"]
    layer_losses = np.asarray(per_layer["feed_forward"]["aux_loss"])
    assert layer_losses.shape == (2,)  # The scan kept each layer's aux loss, and only that.
    np.testing.assert_allclose(aux["aux_loss"], layer_losses.mean(), rtol=1e-6)
    np.testing.assert_allclose(loss, cross_entropy + z_loss + 0.5 * layer_losses.mean(), rtol=1e-5)
    summaries = collection.summaries
    np.testing.assert_allclose(summaries["loss"].mean, loss, rtol=1e-6)
    np.testing.assert_allclose(summaries["cross_entropy"].mean, cross_entropy, rtol=1e-5)
    np.testing.assert_allclose(summaries["aux_loss"].mean, layer_losses.mean(), rtol=1e-6)
    assert float(summaries["aux_loss"].weight) == float(summaries["loss"].weight) == 14
    assert "metrics" not in summaries  # The children's summaries are lifted to the model.


def test_the_default_loss_is_cross_entropy_with_the_model_z_loss_scale():
    """Model.metrics None: the loss tests/test_causal_lm.py checks against NumPy."""
    cfg = llama_model_config(
        vocab_size=VOCAB, dim=DIM, num_layers=1, num_heads=2, num_kv_heads=1, hidden_dim=12
    ).set(z_loss_scale=1e-2)
    assert cfg.metrics is None
    metrics = cfg.instantiate(parent=None).metrics
    assert type(metrics) is CrossEntropyLossMetrics
    assert metrics.config.z_loss_scale == 1e-2


def _aux_metrics(module_outputs, regex=".*/aux_loss"):
    metrics = AuxLossMetrics.default_config().set(name="aux", aux_loss_regex=regex)
    live = jnp.ones((2, 3))
    return F(
        metrics.instantiate(parent=None),
        state={},
        inputs=dict(
            input_batch={}, predict_outputs=dict(live_targets=live), module_outputs=module_outputs
        ),
        prng_key=None,
        is_training=True,
    )


def test_aux_loss_is_the_mean_over_matching_outputs_each_by_its_mean():
    module_outputs = {
        "stack": {"aux_loss": jnp.array([1.0, 3.0])},  # A scanned stack's two layers.
        "last": {"aux_loss": jnp.array(5.0), "other": jnp.array(100.0)},
    }
    (loss, metrics), collection = _aux_metrics(module_outputs)
    assert float(loss.mean) == float(metrics["aux_loss"]) == 3.5  # mean(2, 5)
    assert float(loss.weight) == 6
    assert float(collection.summaries["aux_loss"].mean) == 3.5


def test_aux_loss_regex_that_matches_nothing_is_an_error_listing_the_outputs():
    with pytest.raises(ValueError, match=r"matches none of the module outputs \['a/other'\]"):
        _aux_metrics({"a": {"other": jnp.array(1.0)}})


def test_loss_weights_of_an_unknown_child_are_a_config_error():
    cfg = metrics_config(aux_loss_regex=".*/aux_loss").set(name="metrics", loss_weights={"ax": 1.0})
    with pytest.raises(ConfigError, match=r"loss_weights names \['ax'\]"):
        cfg.instantiate(parent=None)


def test_a_z_loss_scale_set_on_the_model_and_its_metrics_is_a_config_error():
    cfg = llama_model_config(
        vocab_size=VOCAB, dim=DIM, num_layers=1, num_heads=2, num_kv_heads=1, hidden_dim=12
    ).set(z_loss_scale=1e-3, metrics=metrics_config(z_loss_scale=1e-4))
    with pytest.raises(ConfigError, match="set it in one place"):
        cfg.instantiate(parent=None)


def test_the_model_z_loss_scale_fills_each_cross_entropy_child():
    cfg = llama_model_config(
        vocab_size=VOCAB, dim=DIM, num_layers=1, num_heads=2, num_kv_heads=1, hidden_dim=12
    ).set(z_loss_scale=1e-3, metrics=metrics_config(aux_loss_regex=".*"))
    model = cfg.instantiate(parent=None)
    assert model.metrics.lm.config.z_loss_scale == 1e-3
    assert isinstance(model.metrics, CompositeLossMetrics)
