"""experiments/golf.py: the speedrun-style baseline is the model it claims, picks its remat
by GPU count, and trains and evaluates end to end on token shards (at reduced size)."""

import json
import math
import random

import jax
import numpy as np
import pytest

from axlearn.common.causal_lm import count_parameters
from axlearn.common.input_tokens import build_token_shards
from axlearn.common.input_vocab import ByteVocabulary
from axlearn.common.launch_trainer import build_trainer_config
from experiments import golf


def test_golf_model_has_the_baseline_shape_and_parameter_count():
    cfg = golf.golf_baseline()
    model = cfg.model.clone(name="model").instantiate(parent=None)
    specs = model.create_parameter_specs_recursively()  # Shapes only; nothing allocated.
    dim, layers, heads, kv_heads, head_dim, hidden, vocab = 512, 9, 8, 4, 64, 1024, 1024
    per_layer = (
        dim * (heads + 2 * kv_heads) * head_dim  # Fused q, k, v.
        + heads * head_dim * dim  # Output projection.
        + 2 * dim * hidden  # ReLU^2 MLP: one matrix in, one out.
        + 2 * dim  # Attention and MLP pre-norms.
        + 2 * head_dim  # QK-norm scales.
    )
    tied_embedding = vocab * dim  # No separate LM head.
    assert count_parameters(specs) == tied_embedding + layers * per_layer + dim
    assert "lm_head" not in specs["decoder"]
    decoder = cfg.model.decoder
    assert decoder.logits_soft_cap == 30.0
    assert decoder.transformer.layer.feed_forward.activation == "squared_relu"
    assert cfg.input.global_batch_size * cfg.input.max_sequence_length == 524_288


def test_golf_runs_unrolled_without_remat_on_single_hosts():
    for selector in ("gpu-h100-1", "gpu-h100-2", "gpu-h200-4", "gpu-h100-8"):
        cfg = build_trainer_config(config_name="golf_baseline", mesh_selector=selector)
        transformer = cfg.model.decoder.transformer
        assert transformer.klass.__name__ == "StackedTransformerLayer"
        assert transformer.num_layers == 9 and transformer.layer.remat_spec is None
        assert transformer.layer.feed_forward.activation == "squared_relu"


def _texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["golf", "par", "birdie", "eagle", "green", "bunker"]
    return [
        " ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) for _ in range(count)
    ]


@pytest.mark.slow
def test_golf_trains_on_token_shards_and_reports_bits_per_byte(tmp_path):
    vocab = ByteVocabulary()  # 259 ids: fits the model's 1024.
    build_token_shards(_texts(120, seed=0), vocab=vocab, output_prefix=str(tmp_path / "train"))
    validation = _texts(30, seed=1)
    build_token_shards(validation, vocab=vocab, output_prefix=str(tmp_path / "validation"))
    small = [
        f"input.paths=['{tmp_path}/train-*.tok']",
        f"evalers['validation'].input.paths=['{tmp_path}/validation-*.tok']",
        "input.global_batch_size=4",
        "input.max_sequence_length=64",
        "evalers['validation'].input.global_batch_size=4",
        "evalers['validation'].input.max_sequence_length=64",
        "evalers['validation'].eval_policy.n=2",
        "model.decoder.transformer.num_layers=2",
        "max_step=2",
        "learner.optimizer.inner.learning_rate.max_step=2",
        "learner.optimizer.inner.adamw_learning_rate.max_step=2",
    ]
    cfg = build_trainer_config(
        config_name="golf_baseline",
        mesh_selector="cpu",
        config_overrides=small,
        trainer_dir=str(tmp_path / "run"),
    )
    summaries = cfg.instantiate(parent=None, devices=jax.devices()[:1]).run()
    assert np.isfinite(summaries["loss"])

    lines = (tmp_path / "run" / "summaries" / "validation" / "metrics.jsonl").read_text()
    metrics = json.loads(lines.splitlines()[-1])
    # One pass over the validation set: bits per byte = nats / ln 2 / bytes and cross-entropy
    # = nats / targets, where the byte vocabulary has one target per byte plus one EOS per
    # document.
    num_bytes = sum(len(text.encode("utf-8")) for text in validation)
    num_targets = num_bytes + len(validation)
    expected_ratio = num_targets / (math.log(2) * num_bytes)
    ratio = metrics["bits_per_byte"] / metrics["cross_entropy"]
    np.testing.assert_allclose(ratio, expected_ratio, rtol=1e-5)
    assert (tmp_path / "run" / "checkpoints" / "step_00000002" / "index.json").exists()
