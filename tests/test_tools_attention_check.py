"""tools/attention_check.py: its float32 reference against NumPy, and both parts run on
the CPU at a small shape, where the XLA cases must match it to bf16 precision."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from tools import attention_check


def _numpy_attention(q, k, v, scale):
    """Causal attention in float64; query head n reads K/V head n // (N / K)."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    out = np.zeros_like(q)
    seq = q.shape[1]
    for n in range(q.shape[2]):
        logits = np.einsum("bth,bsh->bts", q[:, :, n], k[:, :, n // groups]) * scale
        logits = np.where(np.tril(np.ones((seq, seq), bool)), logits, -np.inf)
        weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        out[:, :, n] = np.einsum("bts,bsh->bth", weights, v[:, :, n // groups])
    return out


def test_reference_is_causal_grouped_query_attention():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 8, 4, 16)).astype(np.float32)
    k, v = (rng.normal(size=(2, 8, 2, 16)).astype(np.float32) for _ in range(2))
    got = attention_check.reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale=0.25)
    np.testing.assert_allclose(got, _numpy_attention(q, k, v, 0.25), rtol=1e-5, atol=1e-5)


def test_rejects_query_heads_that_do_not_split_into_kv_groups(capsys):
    with pytest.raises(SystemExit):
        attention_check.main(["--num_heads=4", "--num_kv_heads=3"])
    assert "--num_heads=4 is no multiple of --num_kv_heads" in capsys.readouterr().err


@pytest.mark.slow
def test_both_parts_check_xla_and_report_paths_that_fail(tmp_path):
    out = tmp_path / "attention.json"
    attention_check.main([
        "--batch=2", "--seq_len=32", "--num_heads=4", "--num_kv_heads=2", "--head_dim=16",
        f"--json_out={out}",
    ])
    results = json.loads(out.read_text())
    layer, op = results["layer"], results["op"]
    assert set(layer) == {"xla", "cudnn", "xla+segments", "cudnn+segments"}
    assert set(op) == set(attention_check.op_paths(1.0))
    for name in ("xla", "xla+segments"):
        assert layer[name]["out_rel_err"] < 2e-2 and layer[name]["grad_rel_err"] < 2e-2
        assert layer[name]["hlo_has_cudnn_call"] is False
    assert max(op["xla"]["rel_err_out_dq_dk_dv"]) < 2e-2
    # Every other path either ran (as closely) or reported why not (no GPU, no tokamax).
    for entries in (layer, op):
        for entry in entries.values():
            errors = [v for k, v in entry.items() if "rel_err" in k]
            assert "error" in entry or max(np.max(e) for e in errors) < 2e-2, entry
