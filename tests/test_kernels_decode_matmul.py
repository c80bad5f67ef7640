"""Tests of axlearn.common.kernels.decode_matmul: a decoding step's matmul by a weight
stored rows last, interpreted on the CPU, against NumPy; and the int8 matmuls and a
quantized model taking it under `dispatch.interpreted()`.

Tolerances (`_assert_close`): the kernel's products are exact (an int8 or bf16 value
times a bf16 one fits float32's significand; float32 ones are multiplied in float32) and
it sums in float32, so against a float64 reference of the same inputs an output is within
K * 2^-24 of its sum of |terms|, plus, in bf16, its own rounding: 2^-8 of |y| (7 fraction bits).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import base_layer, generate, quantization
from axlearn.common.base_layer import QuantizedWeight, weight_einsum
from axlearn.common.kernels import dispatch
from axlearn.common.kernels.decode_matmul import (
    MAX_ROWS,
    decode_matmul,
    decode_matmul_supported,
)
from axlearn.common.module import functional as F

RNG = np.random.default_rng(0)


def _assert_close(y, x, w, scale=None):
    """y against x @ w^T * scale in float64, within the bound of the module's doc."""
    x, w = (np.float64(jnp.asarray(t).astype(jnp.float32)) for t in (x, w))
    scale = 1.0 if scale is None else np.float64(scale)
    expected, magnitude = (x @ w.T) * scale, (np.abs(x) @ np.abs(w).T) * scale
    bound = x.shape[1] * 2.0**-24 * magnitude
    if y.dtype == jnp.bfloat16:
        bound += 2.0**-8 * np.abs(expected)
    np.testing.assert_array_less(np.abs(np.float64(y.astype(jnp.float32)) - expected), bound)


def _int8_weight(n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    values = RNG.integers(-127, 128, size=(n, k)).astype(np.int8)
    return values, RNG.uniform(1e-3, 1e-2, size=(n,)).astype(np.float32)


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n, k", [(256, 512), (100, 300)])  # Tiled by the blocks; ragged.
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("dot", [True, False])  # The tensor-core or the elementwise product.
def test_int8_weight_with_row_scales_matches_numpy(rows, n, k, x_dtype, dot):
    values, scale = _int8_weight(n, k)
    x = jnp.asarray(RNG.normal(size=(rows, k)), x_dtype)
    y = decode_matmul(x, jnp.asarray(values), jnp.asarray(scale), dot=dot, interpret=True)
    assert y.shape == (rows, n) and y.dtype == x_dtype
    _assert_close(y, x, values, scale)


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n, k", [(256, 512), (100, 300)])
def test_bf16_weight_matches_numpy(rows, n, k):
    w = jnp.asarray(RNG.normal(size=(n, k)), jnp.bfloat16)
    x = jnp.asarray(RNG.normal(size=(rows, k)), jnp.bfloat16)
    y = decode_matmul(x, w, interpret=True)
    assert y.shape == (rows, n) and y.dtype == jnp.bfloat16
    _assert_close(y, x, w)


@pytest.mark.parametrize(
    "rows, dot, blocks",
    [(1, True, dict(block_n=64, block_k=128)), (3, False, dict(block_n=8, block_k=64))],
)
def test_other_blocks_give_the_same_matmul(rows, dot, blocks):
    # The benchmark's sweep of block sizes, for either product.
    values, scale = _int8_weight(192, 640)
    x = jnp.asarray(RNG.normal(size=(rows, 640)), jnp.float32)
    y = decode_matmul(
        x, jnp.asarray(values), jnp.asarray(scale), dot=dot, interpret=True, **blocks
    )
    _assert_close(y, x, values, scale)


def test_more_rows_than_a_dot_operand_are_not_taken():
    assert decode_matmul_supported((MAX_ROWS, 512), 256)
    assert not decode_matmul_supported((MAX_ROWS + 1, 512), 256)
    with pytest.raises(ValueError, match="do not fit"):
        decode_matmul(jnp.zeros((MAX_ROWS + 1, 64)), jnp.zeros((32, 64), jnp.int8), interpret=True)


@pytest.mark.parametrize(
    "spec, x_shape, w_shape, axes",
    [
        ("...i,io->...o", (1, 1, 160), (160, 96), (-2,)),  # Linear, a decoding step.
        ("...i,io->...o", (3, 2, 160), (160, 96), (-2,)),  # Six rows: the dot.
        ("...d,dnh->...nh", (2, 1, 64), (64, 6, 16), (-3,)),  # Fused grouped QKV.
        ("...d,pdnh->p...nh", (2, 1, 64), (3, 64, 2, 16), (-3,)),  # Stacked QKV.
        ("...nh,dnh->...d", (1, 1, 4, 16), (48, 4, 16), (-2, -1)),  # The output projection.
        ("...d,vd->...v", (4, 64), (100, 64), (-1,)),  # The tied head.
    ],
)
def test_int8_matmuls_take_the_kernel_and_equal_numpy_on_the_dequantized_weight(
    spec, x_shape, w_shape, axes
):
    w, x = RNG.normal(size=w_shape).astype(np.float32), RNG.normal(size=x_shape)
    q, scale = quantization.quantize(w, 8, axes)
    weight = QuantizedWeight.rows_last_layout(
        jnp.asarray(q), jnp.asarray(scale.astype(np.float32)), jnp.float32
    )
    with dispatch.interpreted():
        jaxpr = jax.make_jaxpr(lambda x_: weight_einsum(spec, x_, weight))(jnp.float32(x))
        y = weight_einsum(spec, jnp.asarray(x, jnp.float32), weight)
    assert "decode_matmul" in str(jaxpr)
    np_spec = spec.replace("...", "".join("ABC"[: len(x_shape) - len(spec.split(",")[0]) + 3]))
    expected = np.einsum(np_spec, x, quantization.dequantize(q, scale))
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)


def test_without_the_switch_or_past_the_rows_the_matmul_stays_on_xla(monkeypatch):
    q, scale = quantization.quantize(RNG.normal(size=(64, 32)).astype(np.float32), 8, (-2,))
    weight = QuantizedWeight.rows_last_layout(
        jnp.asarray(q), jnp.asarray(scale.astype(np.float32)), jnp.float32
    )

    def jaxpr(rows):
        return str(jax.make_jaxpr(lambda x_: weight_einsum("...i,io->...o", x_, weight))(
            jnp.zeros((rows, 64))
        ))

    with dispatch.interpreted():
        assert "decode_matmul" in jaxpr(MAX_ROWS)
        assert "decode_matmul" not in jaxpr(MAX_ROWS + 1)
        monkeypatch.setattr(base_layer, "DECODE_MATMUL_KERNEL", False)
        assert "decode_matmul" not in jaxpr(1)
    # Outside `interpreted()`: the compiled kernel on a GPU, XLA elsewhere.
    monkeypatch.setattr(base_layer, "DECODE_MATMUL_KERNEL", True)
    on_gpu = dispatch.compiled_kernels_available()
    assert ("decode_matmul" in jaxpr(1)) == on_gpu


def _tiny_llama():
    """A float32 Llama whose matmul weights all reach quantization's minimum size."""
    from tools import generate_bench  # pylint: disable=import-outside-toplevel

    cfg = generate_bench.model_config("256x1x4x2x512x300", 1)
    cfg.dtype = jnp.float32
    params = generate_bench.random_params(cfg, generate.make_mesh(1))
    params = jax.tree.map(lambda p: p * 10 if p.ndim > 1 else p, params)  # Std 0.2.
    return cfg.clone(name="model").instantiate(parent=None), params


@pytest.mark.slow
def test_a_quantized_model_decodes_through_the_kernel_as_numpys_dequantized_weights(monkeypatch):
    model, params = _tiny_llama()
    quantized = generate.quantize_for_decoding(params, jnp.float32)
    is_quantized = lambda x: isinstance(x, QuantizedWeight)  # pylint: disable=C3001
    dequantized = jax.tree.map(
        lambda x: jnp.asarray(quantization.dequantize(
            np.asarray(x.weight_layout_values()), np.asarray(x.scale)
        )) if is_quantized(x) else x,
        quantized, is_leaf=is_quantized,
    )
    ids = jnp.asarray(RNG.integers(1, 300, size=(2, 3)), jnp.int32)  # Six rows: the dot.

    def logits(state):
        out, _ = F(model.decoder, state=state["decoder"], inputs=(ids,), prng_key=None,
                   is_training=False)
        return out["logits"]

    expected = np.asarray(logits(dequantized))
    with dispatch.interpreted():
        kernels = str(jax.make_jaxpr(logits)(quantized)).count("name=decode_matmul")
        through_kernel = np.asarray(logits(quantized))
        monkeypatch.setattr(base_layer, "DECODE_MATMUL_KERNEL", False)
        through_xla = np.asarray(logits(quantized))
    assert kernels == 6  # q/k/v, the output projection, the MLP's three; the LM head.
    for got in (through_kernel, through_xla):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
