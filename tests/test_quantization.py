"""quantization: per-row int8/int6 against a NumPy reference written row by row, int6
packing against a bit-string reference, fake quantization's straight-through gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import quantization
from axlearn.common.base_layer import QuantizedWeight, WeightWithCopy, weight_einsum
from axlearn.common.config import ConfigError


def _reference_rows(w, axes, level):
    """(q, scale) computed one row at a time: the contracted axes moved last and flattened."""
    axes = [a % w.ndim for a in axes]
    kept = [a for a in range(w.ndim) if a not in axes]
    moved = np.transpose(w, kept + axes)
    rows = moved.reshape(-1, int(np.prod([w.shape[a] for a in axes])))
    q_rows, scales = [], []
    for row in rows:
        scale = np.float16(max(float(np.abs(row).max()) / level, 2.0**-24))
        q_rows.append([max(-level, min(level, round(float(v) / float(scale)))) for v in row])
        scales.append(scale)
    q = np.array(q_rows, np.int8).reshape(moved.shape)
    q = np.transpose(q, np.argsort(kept + axes))
    scale_shape = [1 if a in axes else n for a, n in enumerate(w.shape)]
    return q, np.array(scales, np.float16).reshape(scale_shape)


@pytest.mark.parametrize("bits, axes", [(8, (-2,)), (6, (-2, -1)), (8, (-3,))])
def test_per_row_quantization_matches_a_row_by_row_reference(bits, axes):
    w = np.random.default_rng(bits).normal(size=(3, 5, 4, 6)).astype(np.float32)
    w[0, 0] = 0.0  # An all-zero slice: a row of zeros for some axes.
    q, scale = quantization.quantize(w, bits, axes)
    ref_q, ref_scale = _reference_rows(w, axes, 2 ** (bits - 1) - 1)
    np.testing.assert_array_equal(scale, ref_scale)
    # Python's round() and NumPy's rint both round half to even.
    np.testing.assert_array_equal(q, ref_q)
    assert q.dtype == np.int8 and scale.dtype == np.float16
    np.testing.assert_array_equal(
        quantization.dequantize(q, scale), ref_q.astype(np.float32) * ref_scale.astype(np.float32)
    )


def test_int6_packing_matches_a_bit_string_reference():
    values = np.random.default_rng(0).integers(-31, 32, size=23).astype(np.int8)
    bits = "".join(format(int(v) & 0x3F, "06b")[::-1] for v in values)  # LSB first.
    bits += "0" * (-len(bits) % 24)
    expected = bytes(int(bits[i : i + 8][::-1], 2) for i in range(0, len(bits), 8))
    packed = quantization.pack_int6(values)
    assert packed == expected and len(packed) == quantization.packed_int6_size(23)
    np.testing.assert_array_equal(quantization.unpack_int6(packed, 23), values)


@pytest.mark.slow
def test_jax_quantization_equals_numpys():
    w = np.random.default_rng(1).normal(size=(16, 12)).astype(np.float32)
    q, scale = quantization.jax_quantize(jnp.asarray(w), 6, (-2,))
    ref_q, ref_scale = quantization.quantize(w, 6, (-2,))
    np.testing.assert_array_equal(np.asarray(q), ref_q)
    np.testing.assert_array_equal(np.asarray(scale), ref_scale)


def test_fake_quantization_passes_the_gradient_straight_through():
    rng = np.random.default_rng(2)
    w, x, t = (rng.normal(size=s).astype(np.float32) for s in ((8, 5), (4, 8), (4, 5)))
    loss = lambda w: jnp.sum((x @ quantization.fake_quantize(w, 8, (-2,)) - t) ** 2)  # noqa
    value, grad = jax.value_and_grad(loss)(jnp.asarray(w))
    wq = quantization.dequantize(*quantization.quantize(w, 8, (-2,)))
    residual = x @ wq - t
    np.testing.assert_allclose(value, np.sum(residual**2), rtol=1e-5)
    # Straight through: the gradient at the quantized weight, applied to the float one.
    np.testing.assert_allclose(np.asarray(grad), 2 * x.T @ residual, rtol=1e-5, atol=1e-5)


def test_fake_quantize_tree_quantizes_chosen_large_weights_and_the_copy_a_matmul_reads():
    rng = np.random.default_rng(3)
    big = rng.normal(size=(8, 6)).astype(np.float32)
    params = dict(
        a=dict(weight=jnp.asarray(big)),
        b=dict(weight=WeightWithCopy(jnp.asarray(big), jnp.asarray(big))),
        c=dict(weight=jnp.asarray(big)),
        norm=dict(scale=jnp.ones((6,))),
    )
    out = quantization.fake_quantize_tree(params, bits=8, param_regex="(a|b)/weight", min_size=48)
    expected = quantization.dequantize(*quantization.quantize(big, 8, (-2,)))
    np.testing.assert_array_equal(np.asarray(out["a"]["weight"]), expected)
    np.testing.assert_array_equal(np.asarray(out["b"]["weight"].copy), expected)
    np.testing.assert_array_equal(np.asarray(out["b"]["weight"].weight), big)
    np.testing.assert_array_equal(np.asarray(out["c"]["weight"]), big)  # Not matched.
    np.testing.assert_array_equal(np.asarray(out["norm"]["scale"]), np.ones(6))


def test_a_quantized_weight_multiplies_as_its_dequantized_weight():
    rng = np.random.default_rng(4)
    w, x = rng.normal(size=(6, 4, 3)).astype(np.float32), rng.normal(size=(2, 4, 3))
    q, scale = quantization.quantize(w, 8, (-2, -1))
    weight = QuantizedWeight(jnp.asarray(q), jnp.asarray(scale.astype(np.float32)), jnp.float32)
    y = weight_einsum("...nh,dnh->...d", jnp.asarray(x, jnp.float32), weight)
    np.testing.assert_allclose(
        np.asarray(y), np.einsum("bnh,dnh->bd", x, quantization.dequantize(q, scale)),
        rtol=1e-5, atol=1e-5,
    )


@pytest.mark.parametrize(
    "spec, x_shape, w_shape, axes",
    [
        ("...i,io->...o", (1, 1, 6), (6, 5), (-2,)),  # Linear, a decoding step.
        ("...i,io->...o", (3, 2, 6), (6, 5), (-2,)),  # Six rows: the einsum path.
        ("...d,pdnh->p...nh", (2, 1, 6), (3, 6, 2, 4), (-3,)),  # Fused QKV.
        ("...nh,hnd->...d", (1, 1, 2, 4), (4, 2, 6), (0, 1)),  # A spec's axes reordered.
        ("...d,vd->...v", (4, 6), (7, 6), (-1,)),  # The tied head (transposed weight).
    ],
)
@pytest.mark.parametrize("rows_last", [False, True])
def test_a_quantized_matmul_equals_numpy_on_the_dequantized_weight(
    spec, x_shape, w_shape, axes, rows_last
):
    # Up to MULTIPLY_REDUCE_MAX_ROWS rows the matmul is a multiply and a sum; past it, an
    # einsum of the converted values; the values in the weight's layout or with each row
    # last (decoding's): all against NumPy's einsum of values * scale.
    rng = np.random.default_rng(5)
    w, x = rng.normal(size=w_shape).astype(np.float32), rng.normal(size=x_shape)
    q, scale = quantization.quantize(w, 8, axes)
    make = QuantizedWeight.rows_last_layout if rows_last else QuantizedWeight
    weight = make(jnp.asarray(q), jnp.asarray(scale.astype(np.float32)), jnp.float32)
    if rows_last:  # Each row (one scale's values) contiguous, in the weight's order.
        moved = np.moveaxis(q, [a % q.ndim for a in axes], range(-len(axes), 0))
        np.testing.assert_array_equal(np.asarray(weight.values), moved)
    y = weight_einsum(spec, jnp.asarray(x, jnp.float32), weight)
    np_spec = spec.replace("...", "".join("ABC"[: len(x_shape) - len(spec.split(",")[0]) + 3]))
    expected = np.einsum(np_spec, x, quantization.dequantize(q, scale))
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(weight.dequantized()), quantization.dequantize(q, scale), rtol=1e-6
    )


@pytest.mark.parametrize(
    "w, message",
    [
        (np.array([[1.0, np.inf]] * 2, np.float32), "t: holds non-finite values"),
        (np.full((2, 2), 1e7, np.float32), "t: a row's largest magnitude 1e+07 exceeds"),
    ],
)
def test_a_tensor_that_cannot_be_quantized_is_one_line_naming_it(w, message):
    with pytest.raises(quantization.QuantizationError) as e:
        quantization.quantize(w, 8, (-1,), name="t")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_an_unsupported_quantization_is_one_line():
    with pytest.raises(quantization.QuantizationError, match=r"^--quantize='int4' is not "
                       r"supported: choose one of int6, int8$"):
        quantization.bits_of("int4")


def test_the_qat_modifier_makes_the_model_fake_quantized_and_refuses_unknown_bits():
    from experiments import golf  # pylint: disable=import-outside-toplevel

    cfg = golf.golf_baseline_qat()
    assert cfg.model.klass is quantization.FakeQuantizedModel
    assert cfg.model.quantize == "int6"
    assert cfg.model.decoder.vocab_size == golf.VOCAB_SIZE  # The other fields are kept.
    modifier = quantization.QuantizationAwareTrainingModifier.default_config().set(quantize="int5")
    with pytest.raises(ConfigError, match="quantize='int5' is not supported"):
        modifier.instantiate()(golf.golf_baseline())


@pytest.mark.slow
def test_a_fake_quantized_model_trains_on_the_weights_the_artifact_would_hold():
    from axlearn.common.module import functional  # pylint: disable=import-outside-toplevel
    from axlearn.common.utils import flatten_with_paths, unflatten_paths  # noqa
    from tools import generate_bench  # pylint: disable=import-outside-toplevel

    plain = generate_bench.llama_config("32x1x2x1x64x96").set(dtype=jnp.float32)
    model = plain.clone(name="model").instantiate(parent=None)
    params = model.initialize_parameters_recursively(jax.random.PRNGKey(0))
    qat = quantization.QuantizationAwareTrainingModifier.default_config().set(
        quantize="int8", min_size=1024
    ).instantiate()
    trainer_like = type("Cfg", (), {})()
    trainer_like.model = plain.clone()
    fake = qat(trainer_like).model.clone(name="model").instantiate(parent=None)
    expected = {}
    for path, x in flatten_with_paths(params):
        x = np.asarray(x)
        if x.ndim >= 2 and x.size >= 1024:
            x = quantization.dequantize(
                *quantization.quantize(x, 8, quantization.contracted_axes(path, x.ndim))
            )
        expected[path] = jnp.asarray(x)
    ids = jnp.asarray(np.random.default_rng(5).integers(1, 96, size=(2, 8)), jnp.int32)
    batch = dict(input_ids=ids, target_labels=jnp.roll(ids, -1, axis=1))
    loss = lambda m, p: functional(  # noqa: E731
        m, state=p, inputs=dict(input_batch=batch), prng_key=jax.random.PRNGKey(1),
        is_training=True,
    )[0][0]
    np.testing.assert_allclose(
        float(loss(fake, params)), float(loss(model, unflatten_paths(expected))), rtol=1e-6
    )
    # Evaluation sees the float weights.
    evaluated = functional(
        fake, state=params, inputs=dict(input_batch=batch), prng_key=None, is_training=False
    )[0][0]
    plain_eval = functional(
        model, state=params, inputs=dict(input_batch=batch), prng_key=None, is_training=False
    )[0][0]
    assert float(evaluated) == float(plain_eval)


def test_embeddings_read_the_rows_of_a_quantized_table():
    from axlearn.common.layers import Embedding, OneHotGradEmbedding  # pylint: disable=C0415
    from axlearn.common.module import functional  # pylint: disable=import-outside-toplevel

    table = np.random.default_rng(6).normal(size=(10, 4)).astype(np.float32)
    q, scale = quantization.quantize(table, 8, (-1,))
    weight = QuantizedWeight(jnp.asarray(q), jnp.asarray(scale.astype(np.float32)), jnp.float32)
    ids = jnp.asarray([[3, 0, 9]])
    for klass in (Embedding, OneHotGradEmbedding):
        layer = klass.default_config().set(name="emb", num_embeddings=10, dim=4).instantiate(
            parent=None
        )
        rows, _ = functional(layer, state=dict(weight=weight), inputs=[ids], prng_key=None,
                             is_training=False)
        expected = quantization.dequantize(q, scale)[[[3, 0, 9]]]
        np.testing.assert_array_equal(np.asarray(rows), expected)
