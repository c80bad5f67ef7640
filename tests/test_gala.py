"""Tests of experiments/gala.py: sigmoid attention with ALiBi in a GPT, trained on the CPU."""

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common.attention import ALiBiAttentionLogitBiasLayer, SigmoidAttention
from axlearn.common.module import functional as F
from experiments import gala
from tests.fresh_python import REPO, fresh_env


def test_every_layer_attends_by_sigmoid_with_alibi_and_no_rope():
    cfg = gala.gala_sigmoid_test_trainer()
    attention = cfg.model.decoder.transformer.layer.self_attention.attention
    assert attention.klass is SigmoidAttention and attention.seq_len == 256
    assert "rope_pos_emb_layer" not in attention.input_linear.keys()
    assert cfg.model.decoder.attention_mask.klass is ALiBiAttentionLogitBiasLayer
    assert cfg.model.decoder.attention_mask.num_heads == attention.num_heads


def test_the_qkv_weight_keeps_its_learner_scale_without_rope():
    """muP's per-parameter scale names the fused QKV weight by path; without RoPE's wrapper
    that path is shorter, and the scale must still reach it."""
    cfg = gala.gala_sigmoid_test_trainer()
    scales = cfg.learner.optimizer.inner.adam_update_transformation.per_param_scale
    path = "decoder/transformer/layer0/self_attention/attention/i_proj/qkv_proj/weight"
    assert [s for r, s in scales.scale_by_path if re.fullmatch(r, path)]


def _decoder(cfg):
    decoder_cfg = cfg.model.decoder.clone(name="decoder", dim=32, vocab_size=50)
    attention = decoder_cfg.transformer.layer.self_attention.attention
    attention.num_heads = 4
    attention.input_linear.cache_dtype = jnp.float32  # Decoding exactly as forward.
    decoder_cfg.transformer.layer.feed_forward.hidden_dim = 64
    decoder_cfg.set(param_init=cfg.model.param_init)
    decoder = decoder_cfg.instantiate(parent=None)
    return decoder, decoder.initialize_parameters_recursively(jax.random.PRNGKey(0))


@pytest.mark.slow  # A decoder compiled at several lengths: ~15 s.
def test_alibi_decoder_logits_depend_only_on_earlier_tokens_of_the_same_document():
    decoder, params = _decoder(gala.gala_sigmoid_test_trainer())

    def logits(ids, segment_ids, positions):
        out, _ = F(
            decoder, state=params, is_training=False, prng_key=None,
            inputs=dict(input_ids=jnp.asarray(ids), segment_ids=jnp.asarray(segment_ids),
                        positions=jnp.asarray(positions)),
        )
        return np.asarray(out["logits"])

    rng = np.random.default_rng(0)
    ids = rng.integers(2, 50, size=(1, 8))
    segments, positions = np.array([[1, 1, 1, 1, 2, 2, 2, 2]]), np.array([[0, 1, 2, 3] * 2])
    base = logits(ids, segments, positions)
    later = ids.copy()
    later[0, 2:4] = rng.integers(2, 50, size=2)  # Later tokens of the first document.
    np.testing.assert_allclose(logits(later, segments, positions)[0, :2], base[0, :2], atol=1e-5)
    # The second document alone, at the same positions, gives the same logits.
    alone = logits(ids[:, 4:], segments[:, 4:], positions[:, 4:])
    np.testing.assert_allclose(alone[0], base[0, 4:], atol=1e-5)
    assert not np.allclose(logits(later, segments, positions)[0, 2:4], base[0, 2:4])


@pytest.mark.slow  # A decoder compiled at several lengths: ~15 s.
def test_alibi_decoder_decodes_like_forward_one_token_and_two_at_a_time():
    decoder, params = _decoder(gala.gala_sigmoid_test_trainer())

    def run(method, **inputs):
        out, _ = F(
            decoder, state=params, is_training=False, prng_key=None, method=method, inputs=inputs
        )
        return out

    ids = jnp.asarray(np.random.default_rng(1).integers(2, 50, size=(2, 6)))
    full = np.asarray(run("forward", input_ids=ids)["logits"])
    for chunk in (1, 2):
        cache = run("init_states", batch_size=2, max_len=8)
        steps = []
        for t in range(0, 6, chunk):
            cache, out = run(
                "extend_step", cached_states=cache, input_ids=ids[:, t : t + chunk],
                time_step=jnp.full((2,), t, jnp.int32),
            )
            steps.append(np.asarray(out["logits"]))
        np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)


def _logged_losses(log: str) -> dict[int, float]:
    return {
        int(m.group(1)): float(m.group(2))
        for m in re.finditer(r"step +(\d+)/\d+ \| loss ([0-9.]+)", log)
    }


@pytest.mark.slow
def test_gala_sigmoid_test_trains_on_the_cpu(tmp_path):
    """Six steps through the launcher: the loss is finite and falls from about ln(vocab)."""
    run = subprocess.run(
        [
            sys.executable, "-m", "axlearn.common.launch_trainer_main",
            "--config=gala_sigmoid_test", f"--trainer_dir={tmp_path}",
            "--config_override=max_step=6", "--config_override=evalers={}",
            "--config_override=log_every_n_steps=1",
        ],
        cwd=REPO, env=fresh_env(), capture_output=True, text=True, timeout=600, check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    losses = _logged_losses(run.stderr)
    assert sorted(losses) == list(range(1, 7)), run.stderr[-3000:]
    assert losses[6] < losses[1] < np.log(384) + 0.5
