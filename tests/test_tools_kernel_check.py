"""tools/kernel_check.py: its float64 references against jax's autodiff, and a run on the
CPU at a small shape, where the XLA cases must match them to bf16 precision."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tools import kernel_check


def test_swiglu_reference_is_the_vjp_of_silu_times_b():
    rng = np.random.default_rng(0)
    a, b, dh = (rng.normal(size=(8, 16)).astype(np.float32) for _ in range(3))
    _, vjp = jax.vjp(lambda a, b: jax.nn.silu(a) * b, a, b)
    for got, want in zip(kernel_check.swiglu_cotangents_reference(a, b, dh), vjp(dh)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_decode_attention_reference_is_jax_s_attention_over_each_row_s_length():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 4, 8)).astype(np.float32)
    k, v = (rng.normal(size=(2, 10, 2, 8)).astype(np.float32) for _ in range(2))
    lengths = np.array([10, 3], np.int32)
    want = jax.nn.dot_product_attention(
        q[:, None], k, v, scale=1.0, key_value_seq_lengths=jnp.asarray(lengths)
    )[:, 0]
    got = kernel_check.decode_attention_reference(q, k, v, lengths)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_rms_norm_reference_is_the_vjp_of_the_residual_and_its_norms():
    rng = np.random.default_rng(0)
    x, dres, dy0, dy1 = (rng.normal(size=(8, 16)).astype(np.float32) for _ in range(4))
    scale = (1 + 0.1 * rng.normal(size=(16,))).astype(np.float32)

    def norm(x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + 1e-5) * scale

    _, vjp = jax.vjp(lambda x: (x, norm(x), norm(x)), x)
    (want,) = vjp((dres, dy0, dy1))
    got = kernel_check.rms_norm_dx_reference(x, scale, [dy0, dy1], dres)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_rotated_reference_is_the_layers_rotation():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 8)).astype(np.float32)
    angles = rng.uniform(0, 6, size=(2, 4))
    sin_cos = np.concatenate([np.sin(angles), np.cos(angles)], axis=-1).astype(np.float32)
    # Rotating (x[i], x[i + 4]) by an angle: a complex product, written independently.
    pairs = (x[..., :4] + 1j * x[..., 4:]) * np.exp(1j * angles)[:, None]
    want = np.concatenate([pairs.real, pairs.imag], axis=-1)
    np.testing.assert_allclose(kernel_check.rotated_reference(x, sin_cos), want, atol=1e-6)


@pytest.mark.slow
def test_each_case_matches_the_reference_or_reports_why_it_failed(tmp_path):
    out = tmp_path / "kernels.json"
    kernel_check.main([
        "--tokens=64", "--hidden=128", "--mlp_hidden=256", "--decode_batch=2", "--heads=4",
        "--kv_heads=2", "--head_dim=32", "--cache=64", "--length=40", f"--json_out={out}",
    ])
    results = json.loads(out.read_text())
    cases = {k: v for k, v in results.items() if k not in ("jax_version", "device")}
    assert set(cases) == {
        "gated_product xla", "gated_product kernel",
        "rms_norm 1 dy: xla", "rms_norm 1 dy: kernel",
        "rms_norm 2 dy: xla", "rms_norm 2 dy: kernel",
        "decode_attention xla", "decode_attention cudnn", "decode_attention kernel",
        "decode_step xla", "decode_step kernel", "decode_step unfinished norm: xla",
        "decode_step unfinished norm: kernel", "rms_norm forward xla", "rms_norm forward kernel",
    }
    for name, entry in cases.items():
        if name.endswith("xla"):
            assert entry["max_rel_err"] < 2e-2, (name, entry)
        else:  # The kernels and cuDNN compile only on a GPU.
            assert "error" in entry or entry["max_rel_err"] < 2e-2, (name, entry)
