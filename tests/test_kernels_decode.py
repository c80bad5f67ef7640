"""Tests of axlearn.common.kernels.decode_attention, interpreted on the CPU: against NumPy
alone, and inside a generator against transformers' greedy tokens."""

import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import attention, generate, hf_llama
from axlearn.common.kernels import dispatch
from axlearn.common.kernels.decode_attention import (
    decode_attention,
    decode_attention_mode,
    decode_attention_supported,
)
from tools import kernel_check

RNG = np.random.default_rng(0)


@pytest.mark.parametrize(
    "batch, keys, kv_heads, heads, head_dim, block",
    [
        (2, 200, 2, 4, 32, 64),  # A cache that is no multiple of the block: its end overlaps.
        (3, 48, 1, 1, 16, 128),  # Fewer keys than a block; one head.
        (1, 256, 8, 16, 128, 128),  # gpt_1b's heads.
        (2, 100, 4, 8, 64, 32),
    ],
)
def test_decode_attention_equals_numpy_over_each_row_s_length(
    batch, keys, kv_heads, heads, head_dim, block
):
    q = RNG.normal(size=(batch, heads, head_dim)).astype(np.float32) * 0.3
    k, v = (RNG.normal(size=(batch, keys, kv_heads, head_dim)).astype(np.float32) for _ in "kv")
    lengths = RNG.integers(0, keys + 1, size=batch).astype(np.int32)
    lengths[0] = keys  # One full row; the others may be empty.
    got = decode_attention(*map(jnp.asarray, (q, k, v, lengths)), block_keys=block, interpret=True)
    np.testing.assert_allclose(np.asarray(got), kernel_check.decode_attention_reference(q, k, v, lengths), atol=1e-5)


@pytest.mark.parametrize(
    "q_shape, k_shape, supported",
    [
        ((1, 16, 128), (1, 256, 8, 128), True),
        ((1, 16, 48), (1, 256, 8, 48), False),  # A head of no power of two.
        ((1, 12, 64), (1, 256, 8, 64), False),  # Heads no multiple of the kv heads.
        ((1, 16, 64), (1, 8, 8, 64), False),  # Fewer keys than a matmul tile.
        ((32, 16, 128), (32, 256, 8, 128), False),  # A batch that cuDNN's kernel runs faster.
    ],
)
def test_decode_attention_takes_the_shapes_it_supports_and_only_interpreted_on_a_cpu(
    q_shape, k_shape, supported
):
    q, k = jnp.zeros(q_shape, jnp.bfloat16), jnp.zeros(k_shape, jnp.bfloat16)
    assert decode_attention_supported(q_shape, k_shape) == supported
    assert decode_attention_mode(q, k) is None  # No GPU here.
    with dispatch.interpreted():
        assert decode_attention_mode(q, k) is (True if supported else None)


@pytest.mark.slow
def test_a_generator_attending_through_the_kernel_keeps_transformers_greedy_tokens(monkeypatch):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
        initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    hf = transformers.LlamaForCausalLM(config).eval()
    prompts = [[5, 17, 3, 40, 22], [9, 1]]
    with torch.no_grad():
        expected = [
            hf.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=20, do_sample=False, eos_token_id=[1], pad_token_id=1,
            )[0, len(p):].tolist()
            for p in prompts
        ]
    cfg = hf_llama.llama_config_from_hf(hf.config)
    assert hf_llama.token_id_list(cfg.decoder.eos_token_id) == [1]  # Its default EOS id.
    params = hf_llama.params_from_hf(hf.state_dict(), cfg)
    calls = []
    original = attention.decode_attention
    monkeypatch.setattr(
        attention, "decode_attention", lambda *a, **kw: calls.append(1) or original(*a, **kw)
    )
    with dispatch.interpreted():
        outputs, _ = generate.Generator(cfg, params).generate(
            prompts, max_new_tokens=20, batch_size=2
        )
    assert calls  # The decoding steps attended through the kernel.
    assert outputs == expected
