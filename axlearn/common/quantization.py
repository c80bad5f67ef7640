"""Weight-only quantization: per-row symmetric int8 and int6, in NumPy (artifacts) and in
JAX (quantization-aware training, int8 decoding).

A weight is quantized row by row, a row being what one output of its matmul reads: the
axes the matmul contracts (`contracted_axes`: the input axis of a Linear [in, out], the
model axis of a q/k/v projection [D, N, H], the heads of an output projection [D, N, H],
the vector of an embedding row [V, D]). Each row gets one float16 scale,
scale = max|row| / Q (Q = 127 for int8, 31 for int6), and the integers
q = round(w / scale) clipped to [-Q, Q]; the weight comes back as q * scale. Float
tensors of at least `MIN_QUANTIZED_SIZE` elements and two or more dims are quantized;
norms, biases and small tables stay as they are.

int6 values are stored packed: four values (6-bit two's complement) in three bytes,
v0 | v1 << 6 | v2 << 12 | v3 << 18, little-endian (`pack_int6`).

`FakeQuantizedModel` (made by `QuantizationAwareTrainingModifier`) trains a causal LM
whose chosen weights are quantized and dequantized in every training forward pass, the
gradient passing straight through to the float weights.
"""

import functools
import re
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from axlearn.common.base_layer import WeightWithCopy
from axlearn.common.causal_lm import Model
from axlearn.common.config import (
    REQUIRED,
    ConfigBase,
    ConfigError,
    ConfigModifier,
    Required,
    config_class,
)
from axlearn.common.utils import flatten_with_paths

# --quantize value -> bits.
BITS = {"int8": 8, "int6": 6}
# Tensors with fewer elements stay as they are (norm scales, biases, small embeddings).
MIN_QUANTIZED_SIZE = 65_536
# Scales are stored in float16: the largest row maximum a scale can stand for is this.
_FLOAT16_MAX = float(np.finfo(np.float16).max)
# The smallest scale (float16's smallest subnormal): an all-zero row gets it, and q = 0.
_MIN_SCALE = 2.0**-24


class QuantizationError(ValueError):
    """A tensor that cannot be quantized as asked, or an unknown quantization."""


def bits_of(quantize: str, *, where: str = "--quantize") -> int:
    """The bits of a quantization name; a one-line error for an unsupported one."""
    if quantize not in BITS:
        raise QuantizationError(
            f"{where}={quantize!r} is not supported: choose one of {', '.join(sorted(BITS))}"
        )
    return BITS[quantize]


def max_level(bits: int) -> int:
    """Q: the integers run over [-Q, Q]."""
    return 2 ** (bits - 1) - 1


def contracted_axes(path: str, ndim: int) -> tuple[int, ...]:
    """The axes (negative) of parameter `path` that one row (one scale) covers."""
    if path.endswith("emb/token_emb/weight") or path.endswith("token_emb/weight"):
        return (-1,)  # [V, D]: a token's vector (also the tied LM head's output rows).
    if path.endswith("o_proj/weight"):
        return (-2, -1)  # [D, N, H]: the product contracts the heads.
    if re.search(r"(qkv|q|k|v)_proj/weight$", path):
        return (-3,)  # [(P,) D, N, H]: the product contracts the model dim.
    return (-2,)  # [..., in, out]: a Linear's input axis (the LM head's model dim).


def is_quantized(path: str, shape: tuple, dtype: Any, *, min_size: int = MIN_QUANTIZED_SIZE,
                 keep: Optional[str] = None) -> bool:
    """Whether a tensor gets quantized: a float of 2+ dims and `min_size` elements or more,
    whose path `keep` (a regex, re.search) does not match."""
    if keep and re.search(keep, path):
        return False
    return (
        jnp.issubdtype(dtype, jnp.floating)
        and len(shape) >= 2
        and int(np.prod(shape)) >= min_size
    )


# ----- NumPy: the artifact's arithmetic -----


def quantize(w: np.ndarray, bits: int, axes: tuple[int, ...], *, name: str = "tensor"):
    """(int8 values, float16 scales with `w`'s rank, 1 along `axes`) of `w`, per row."""
    level = max_level(bits)
    w = np.asarray(w, dtype=np.float32)
    if not np.all(np.isfinite(w)):
        raise QuantizationError(f"{name}: holds non-finite values; it cannot be quantized")
    row_max = np.max(np.abs(w), axis=axes, keepdims=True)
    if np.any(row_max / level > _FLOAT16_MAX):
        raise QuantizationError(
            f"{name}: a row's largest magnitude {float(row_max.max()):.4g} exceeds what a "
            f"float16 scale can stand for at {bits} bits ({_FLOAT16_MAX * level:.4g})"
        )
    scale = np.maximum(row_max / level, _MIN_SCALE).astype(np.float16)
    q = np.clip(np.rint(w / scale.astype(np.float32)), -level, level).astype(np.int8)
    return q, scale


def dequantize(q: np.ndarray, scale: np.ndarray, dtype: Any = np.float32) -> np.ndarray:
    """q * scale, in `dtype`."""
    return (q.astype(np.float32) * scale.astype(np.float32)).astype(dtype)


def pack_int6(q: np.ndarray) -> bytes:
    """Values in [-32, 31], four to three bytes (the flat order; zeros pad the end)."""
    flat = q.reshape(-1).astype(np.int32) & 0x3F
    flat = np.concatenate([flat, np.zeros((-len(flat)) % 4, np.int32)]).reshape(-1, 4)
    word = flat[:, 0] | flat[:, 1] << 6 | flat[:, 2] << 12 | flat[:, 3] << 18
    return np.stack([word & 0xFF, word >> 8 & 0xFF, word >> 16 & 0xFF], axis=1).astype(
        np.uint8
    ).tobytes()


def unpack_int6(data: bytes, count: int) -> np.ndarray:
    """The `count` int8 values `pack_int6` packed into `data`."""
    raw = np.frombuffer(data, np.uint8).astype(np.int32).reshape(-1, 3)
    word = raw[:, 0] | raw[:, 1] << 8 | raw[:, 2] << 16
    six = np.stack([word >> shift & 0x3F for shift in (0, 6, 12, 18)], axis=1).reshape(-1)
    return np.where(six >= 32, six - 64, six)[:count].astype(np.int8)


def packed_int6_size(count: int) -> int:
    """Bytes `pack_int6` makes of `count` values."""
    return -(-count // 4) * 3


# ----- JAX: training and decoding -----


def jax_quantize(w: jax.Array, bits: int, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """`quantize` in JAX (no checks): (int8 values, float16 scales)."""
    level = max_level(bits)
    w = w.astype(jnp.float32)
    row_max = jnp.max(jnp.abs(w), axis=axes, keepdims=True)
    scale = jnp.maximum(row_max / level, _MIN_SCALE).astype(jnp.float16)
    q = jnp.clip(jnp.round(w / scale.astype(jnp.float32)), -level, level).astype(jnp.int8)
    return q, scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def fake_quantize(w: jax.Array, bits: int, axes: tuple[int, ...]) -> jax.Array:
    """`w` quantized and dequantized (in its dtype); the gradient passes straight through."""
    q, scale = jax_quantize(w, bits, axes)
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)).astype(w.dtype)


def _fake_quantize_fwd(w, bits, axes):
    return fake_quantize(w, bits, axes), None


def _fake_quantize_bwd(bits, axes, residual, g):
    del bits, axes, residual
    return (g,)


fake_quantize.defvjp(_fake_quantize_fwd, _fake_quantize_bwd)


def fake_quantize_tree(
    params: Any, *, bits: int, param_regex: str, min_size: int = MIN_QUANTIZED_SIZE
) -> Any:
    """`params` with each weight whose path matches `param_regex` (re.fullmatch) and that
    `is_quantized` fake-quantized (a `WeightWithCopy`'s train-dtype copy, which the
    matmul reads)."""
    is_leaf = lambda x: isinstance(x, WeightWithCopy)  # noqa: E731
    flat = flatten_with_paths(params, is_leaf=is_leaf)
    treedef = jax.tree_util.tree_structure(params, is_leaf=is_leaf)
    out = []
    for path, leaf in flat:
        value = leaf.copy if isinstance(leaf, WeightWithCopy) else leaf
        if re.fullmatch(param_regex, path) and is_quantized(
            path, value.shape, value.dtype, min_size=min_size
        ):
            value = fake_quantize(value, bits, contracted_axes(path, value.ndim))
            leaf = WeightWithCopy(leaf.weight, value) if isinstance(leaf, WeightWithCopy) else value
        out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


class FakeQuantizedModel(Model):
    """A causal LM whose chosen weights are quantized and dequantized in every training
    forward pass (per row, as the artifacts quantize them), with straight-through
    gradients: a model trained so loses less when its artifact is made. Evaluation and
    decoding see the float weights."""

    @config_class
    class Config(Model.Config):
        """Configures FakeQuantizedModel."""

        quantize: Required[str] = REQUIRED  # 'int8' or 'int6'.
        # Parameters (paths under the model, e.g. decoder/emb/token_emb/weight) quantized
        # where the regex matches the whole path, of 2+ dims and min_size+ elements.
        param_regex: str = ".*"
        min_size: int = MIN_QUANTIZED_SIZE  # Smaller tensors stay as they are.

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        try:
            self._bits = bits_of(cfg.quantize, where=f"{self.path()}.quantize")
            re.compile(cfg.param_regex)
        except (QuantizationError, re.error) as e:
            raise ConfigError(f"{self.path()}: {e}") from e

    def _functional_call(self, method, state, prng_key, is_training, args, kwargs):
        if is_training:
            cfg = self.config
            state = fake_quantize_tree(
                state, bits=self._bits, param_regex=cfg.param_regex, min_size=cfg.min_size
            )
        return super()._functional_call(method, state, prng_key, is_training, args, kwargs)


class QuantizationAwareTrainingModifier(ConfigModifier):
    """Makes the trainer's model (a causal_lm.Model) a `FakeQuantizedModel` with these
    settings, its other fields kept."""

    @config_class
    class Config(ConfigModifier.Config):
        """Configures QuantizationAwareTrainingModifier."""

        quantize: str = "int6"  # 'int8' or 'int6': what the artifact will be.
        param_regex: str = ".*"  # FakeQuantizedModel.param_regex.
        min_size: int = MIN_QUANTIZED_SIZE  # FakeQuantizedModel.min_size.

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        ours = self.config
        try:
            bits_of(ours.quantize, where="QuantizationAwareTrainingModifier.quantize")
        except QuantizationError as e:
            raise ConfigError(str(e)) from e
        if not isinstance(cfg.model, Model.Config):
            raise ConfigError(
                "QuantizationAwareTrainingModifier: model must be a causal_lm.Model config, "
                f"got {type(cfg.model).__qualname__}"
            )
        model = FakeQuantizedModel.default_config()
        for name in cfg.model.keys():
            if name != "klass":
                setattr(model, name, getattr(cfg.model, name))
        cfg.model = model.set(
            quantize=ours.quantize, param_regex=ours.param_regex, min_size=ours.min_size
        )
        return cfg
