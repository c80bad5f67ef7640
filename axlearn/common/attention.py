"""Multi-head attention and the transformer stack built on it.

Shapes: B batch, T query length, S key/value length, D model dim, N query heads,
K key/value heads (N is a multiple of K; K == N without grouping), H per-head dim.

Pieces, bottom up:
- Projections: `MultiheadInputLinear` ([B,T,D] -> [B,T,N,H]) and `MultiheadOutputLinear`
  ([B,T,N,H] -> [B,T,D]); the QKV layers (`QKVLinear`, `FusedQKVLinear`,
  `GroupedQKVLinear`, `FusedGroupedQKVLinear`) and `RoFormerQKVLinear`, which applies
  rotary position embeddings on top of any of them (`QKNormQKVLinear` between the two
  normalizes query and key heads before the rotation, as Qwen3 does).
- `ScaleQuery` / `ScaleKey`: optional per-head norm (QK-norm), then the 1/sqrt(H) scale
  on the query.
- `MultiheadAttention` / `GroupedQueryAttention`: softmax(q k^T) v with causal and
  packed-document (segment id) masking, either on XLA or through cuDNN flash attention.
- `TransformerAttentionLayer`, `TransformerFeedForwardLayer`, `TransformerLayer` and the
  stacks `StackedTransformerLayer` (one child per layer) and `RepeatedTransformerLayer`
  (one scanned child with stacked parameters).
- Attention logit biases, which a Decoder's `attention_mask` computes once for every
  self-attention (`attention_logit_biases`): `CausalAttentionLogitBiasLayer` and
  `ALiBiAttentionLogitBiasLayer` (ALiBi's linear position penalty),
  `SlidingWindowAttentionLogitBiasLayer` (causal within a window, as Mistral's); and
  `SigmoidAttention`, an elementwise sigmoid in place of the softmax.

Every layer that attends also decodes: `init_states(batch_size=, max_len=)` gives an
empty key/value cache and `extend_step(cache, x, time_step=)` appends S new tokens per
example at position `time_step` and returns their outputs, equal to `forward`'s outputs
at those positions.
"""

import functools
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from axlearn.common import base_layer, utils
from axlearn.common.base_layer import BaseLayer, MeshAxes, ParameterSpec
from axlearn.common.base_layer import is_parameter_spec, stacked_parameter_spec
from axlearn.common.config import (
    REQUIRED,
    ConfigError,
    InstantiableConfig,
    Required,
    config_class,
    config_for_function,
    maybe_instantiate,
    register_configurable,
)
from axlearn.common.fp8 import Fp8Matmul
from axlearn.common.kernels.decode_attention import (
    decode_attention,
    decode_attention_mode,
    decode_step_attention,
    decode_step_mode,
)
from axlearn.common.kv_cache.kv_cache import KVCache
from axlearn.common.layers import (
    Dropout,
    LayerNorm,
    Linear,
    RMSNorm,
    StochasticDepth,
    gated_product,
    get_activation_fn,
    inverse_rms,
    residual_add,
    rms,
)
from axlearn.common.module import Module, Tensor
from axlearn.common.param_init import FanAxes, constant_initializer
from axlearn.common.pipeline import Pipeline
from axlearn.common.repeat import Repeat
from axlearn.common.sharding import maybe_shard, whole_heads_if_uneven

# Added to masked logits: far below any real logit, yet finite, so a fully masked row
# gives a uniform distribution instead of NaN.
_NEG_INF = -0.7 * float(jnp.finfo(jnp.float32).max)


# ----- projections -----


class _MultiheadLinear(BaseLayer):
    """A projection between model_dim and (num_heads, per_head_dim); weight [model_dim, N, H]."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures a multi-head projection."""

        model_dim: Required[int] = REQUIRED
        num_heads: Required[int] = REQUIRED
        per_head_dim: Required[int] = REQUIRED
        bias: bool = True
        # The product in FP8 (child `fp8`, with its scaling state); None: in the input's dtype.
        fp8: Optional[Fp8Matmul.Config] = None

    # Set by subclasses: which weight axes are the fan-in and fan-out, and the einsum of
    # the input with the weight.
    _FAN_AXES: FanAxes
    _EINSUM: str

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        if cfg.fp8 is not None:
            self._add_child("fp8", cfg.fp8)

    def _bias_shape_and_axes(self, spec) -> tuple[list[int], Optional[tuple]]:
        raise NotImplementedError(type(self))

    def forward(self, x: Tensor) -> Tensor:
        matmul = self.fp8.einsum if self.config.fp8 is not None else base_layer.weight_einsum
        y = matmul(
            self._EINSUM, x, self.parameters["weight"],
            partition_spec=self.config.param_partition_spec,
        )
        if self.config.bias:
            y = y + self.parameters["bias"]
        return y

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self.config
        spec = cfg.param_partition_spec
        specs = dict(
            weight=ParameterSpec(
                shape=(cfg.model_dim, cfg.num_heads, cfg.per_head_dim),  # A tuple, as AXLearn's.
                mesh_axes=spec,
                fan_axes=self._FAN_AXES,
            )
        )
        if cfg.bias:
            shape, mesh_axes = self._bias_shape_and_axes(spec)
            specs["bias"] = ParameterSpec(
                shape=shape, mesh_axes=mesh_axes, initializer=constant_initializer(0.0)
            )
        return specs


class MultiheadInputLinear(_MultiheadLinear):
    """[..., model_dim] -> [..., num_heads, per_head_dim]; weight [model_dim, N, H]."""

    _FAN_AXES = FanAxes(in_axis=0, out_axis=(1, 2))  # Axes counted from the front, as AXLearn's.
    _EINSUM = "...d,dnh->...nh"

    def forward_stacked(self, x: Tensor, *, stacked_inputs: bool = False) -> Tensor:
        """The projection by each of P weights that a parent stacked (`FusedQKVLinear`):
        weight [P, D, N, H], bias [P, N, H].

        x is [..., D], or with `stacked_inputs` [P, ..., D] (slice p through weight p);
        returns [P, ..., N, H].
        """
        cfg = self.config
        spec = "p...d,pdnh->p...nh" if stacked_inputs else "...d,pdnh->p...nh"
        partition_spec = cfg.param_partition_spec
        if partition_spec is not None:
            partition_spec = (None, *partition_spec)
        matmul = self.fp8.einsum if cfg.fp8 is not None else base_layer.weight_einsum
        y = matmul(spec, x, self.parameters["weight"], partition_spec=partition_spec)
        if cfg.bias:
            bias = self.parameters["bias"]  # [P, N, H]: one per slice, broadcast over "...".
            y = y + bias.reshape(bias.shape[:1] + (1,) * (y.ndim - 3) + bias.shape[1:])
        return y

    def _bias_shape_and_axes(self, spec):
        cfg = self.config
        return [cfg.num_heads, cfg.per_head_dim], (tuple(spec[1:]) if spec else None)


class MultiheadOutputLinear(_MultiheadLinear):
    """[..., num_heads, per_head_dim] -> [..., model_dim]; weight [model_dim, N, H]."""

    _FAN_AXES = FanAxes(in_axis=(1, 2), out_axis=0)  # Axes counted from the front, as AXLearn's.
    _EINSUM = "...nh,dnh->...d"

    def _bias_shape_and_axes(self, spec):
        return [self.config.model_dim], ((spec[0],) if spec else None)


class QKV(NamedTuple):
    """Projected queries [B,T,N,H], keys [B,S,K,H] and values [B,S,K,H]."""

    query: Tensor
    key: Tensor
    value: Tensor


class BaseQKVLinear(BaseLayer):
    """Projects query/key/value inputs to heads.

    `forward(query, *, key=None, value=None, query_positions=None, key_positions=None)`;
    key and value default to the query (self-attention). Positions ([B,T] ints) are
    read only by rotary layers.
    """

    @config_class
    class Config(BaseLayer.Config):
        """Configures BaseQKVLinear."""

        query_dim: Required[int] = REQUIRED  # Set by the attention layer.
        key_dim: Required[int] = REQUIRED
        value_dim: Required[int] = REQUIRED
        num_heads: Required[int] = REQUIRED
        per_head_dim: Required[int] = REQUIRED
        # Dtype of the decoding key/value cache; None: the attention layer's dtype.
        cache_dtype: Optional[jnp.dtype] = None

    @property
    def num_kv_heads(self) -> int:
        return self._config.num_heads

    @property
    def cache_dtype(self) -> Optional[jnp.dtype]:
        return self._config.cache_dtype

    @property
    def scales_with_input(self) -> bool:
        """Whether multiplying a row of the input by c multiplies that row's
        `joined_unrotated` projections by c (matmuls alone: no bias, no FP8 scaling)."""
        return False

    def joined_unrotated(self, query: Tensor) -> Tensor:
        """Self-attention's projections of query [B,T,D] before any rotary embedding,
        joined along heads: [B, T, N + 2K, H], query heads then key then value heads."""
        return jnp.concatenate(self(query), axis=2)

    def _kv_inputs(self, query: Tensor, key: Optional[Tensor], value: Optional[Tensor]):
        if (key is None) != (value is None):
            raise ValueError(f"{self.path()}: give both key and value, or neither")
        return (query, query) if key is None else (key, value)


def _plain_matmuls(layer: MultiheadInputLinear.Config) -> bool:
    """Whether a projection `layer` configures is its matmul alone (`scales_with_input`)."""
    return layer.klass is MultiheadInputLinear and not layer.bias and layer.fp8 is None


class QKVLinear(BaseQKVLinear):
    """Three separate projections, children q_proj, k_proj and v_proj."""

    @config_class
    class Config(BaseQKVLinear.Config):
        """Configures QKVLinear."""

        layer: MultiheadInputLinear.Config = MultiheadInputLinear.default_config()

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        for name, dim, heads in (
            ("q_proj", cfg.query_dim, cfg.num_heads),
            ("k_proj", cfg.key_dim, self.num_kv_heads),
            ("v_proj", cfg.value_dim, self.num_kv_heads),
        ):
            self._add_child(
                name,
                cfg.layer.clone(model_dim=dim, num_heads=heads, per_head_dim=cfg.per_head_dim),
            )

    @property
    def scales_with_input(self) -> bool:
        return _plain_matmuls(self._config.layer)

    def forward(
        self,
        query: Tensor,
        *,
        key: Optional[Tensor] = None,
        value: Optional[Tensor] = None,
        query_positions: Optional[Tensor] = None,
        key_positions: Optional[Tensor] = None,
    ) -> QKV:
        del query_positions, key_positions  # Not rotary.
        key, value = self._kv_inputs(query, key, value)
        return QKV(self.q_proj(query), self.k_proj(key), self.v_proj(value))


class GroupedQKVLinear(QKVLinear):
    """QKVLinear with `num_kv_heads` key/value heads shared by groups of query heads."""

    @config_class
    class Config(QKVLinear.Config):
        """Configures GroupedQKVLinear."""

        num_kv_heads: Required[int] = REQUIRED

    @property
    def num_kv_heads(self) -> int:
        return self._config.num_kv_heads


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def split_heads(x: Tensor, sizes: tuple[int, ...]) -> tuple[Tensor, ...]:
    """Splits x [..., N, H] along its heads axis into parts of `sizes` heads.

    The backward pass concatenates the parts' cotangents. Autodiff of the slices would
    pad each to N heads and add them, which XLA fuses with the RoPE and QK-norm backward
    into one slow kernel that evaluates every pad at every element.
    """
    starts = np.cumsum((0,) + tuple(sizes))
    return tuple(x[..., a:b, :] for a, b in zip(starts[:-1], starts[1:]))


def _split_heads_fwd(x, sizes):
    return split_heads(x, sizes), None


def _split_heads_bwd(sizes, _, cotangents):
    del sizes
    return (jnp.concatenate(cotangents, axis=-2),)


split_heads.defvjp(_split_heads_fwd, _split_heads_bwd)


class FusedGroupedQKVLinear(BaseQKVLinear):
    """One projection (child `qkv_proj`) to num_heads + 2 * num_kv_heads heads.

    The weight is [D, N + 2K, H]: query heads first, then key heads, then value heads.
    Only self-attention (one input for query, key and value).
    """

    @config_class
    class Config(BaseQKVLinear.Config):
        """Configures FusedGroupedQKVLinear."""

        layer: MultiheadInputLinear.Config = MultiheadInputLinear.default_config()
        num_kv_heads: Required[int] = REQUIRED

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        if not cfg.query_dim == cfg.key_dim == cfg.value_dim:
            raise ConfigError(
                f"{self.path()}: a fused projection needs query_dim == key_dim == value_dim, "
                f"got {cfg.query_dim}, {cfg.key_dim}, {cfg.value_dim}"
            )
        self._add_child(
            "qkv_proj",
            cfg.layer.clone(
                model_dim=cfg.query_dim,
                num_heads=cfg.num_heads + 2 * self.num_kv_heads,
                per_head_dim=cfg.per_head_dim,
            ),
        )

    @property
    def num_kv_heads(self) -> int:
        return self._config.num_kv_heads

    @property
    def scales_with_input(self) -> bool:
        return _plain_matmuls(self._config.layer)

    def forward(
        self,
        query: Tensor,
        *,
        key: Optional[Tensor] = None,
        value: Optional[Tensor] = None,
        query_positions: Optional[Tensor] = None,
        key_positions: Optional[Tensor] = None,
    ) -> QKV:
        del query_positions, key_positions  # Not rotary.
        if key is not None or value is not None:
            raise ValueError(f"{self.path()}: a fused projection supports self-attention only")
        n, k = self._config.num_heads, self.num_kv_heads
        return QKV(*split_heads(self.qkv_proj(query), (n, k, k)))

    def joined_unrotated(self, query: Tensor) -> Tensor:
        """The projection's output itself (see `BaseQKVLinear.joined_unrotated`)."""
        return self.qkv_proj(query)


@jax.custom_vjp
def unstack(x: Tensor) -> tuple[Tensor, ...]:
    """The slices x[0], x[1], ... of x's leading axis.

    The backward pass stacks the slices' cotangents, where autodiff of the indexing would
    pad each to x's shape and add them (see `split_heads`).
    """
    return tuple(x[i] for i in range(x.shape[0]))


def _unstack_fwd(x):
    return unstack(x), None


def _unstack_bwd(_, cotangents):
    return (jnp.stack(cotangents),)


unstack.defvjp(_unstack_fwd, _unstack_bwd)


class FusedQKVLinear(BaseQKVLinear):
    """Query, key and value heads (as many of each) from one weight [3, D, N, H].

    The child `qkv_proj` is a MultiheadInputLinear for one of the three; its weight
    [D, N, H] and bias [N, H] are stacked three times on a leading axis (query, key,
    value), the layout AXLearn stores. Each slice is initialized as its own [D, N, H]
    weight (fan_in D), and the `_init` golden describes one slice, as AXLearn's does.
    The child's own children (its FP8 scaling state) are shared by the three slices.
    Key and value inputs, if given, must have the query's shape.
    """

    @config_class
    class Config(BaseQKVLinear.Config):
        """Configures FusedQKVLinear."""

        layer: MultiheadInputLinear.Config = MultiheadInputLinear.default_config()

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        if not cfg.query_dim == cfg.key_dim == cfg.value_dim:
            raise ConfigError(
                f"{self.path()}: a fused projection needs query_dim == key_dim == value_dim, "
                f"got {cfg.query_dim}, {cfg.key_dim}, {cfg.value_dim}"
            )
        self._add_child(
            "qkv_proj",
            cfg.layer.clone(
                model_dim=cfg.query_dim, num_heads=cfg.num_heads, per_head_dim=cfg.per_head_dim
            ),
        )

    @property
    def scales_with_input(self) -> bool:
        return _plain_matmuls(self._config.layer)

    def create_parameter_specs_recursively(self) -> dict[str, Any]:
        specs = super().create_parameter_specs_recursively()
        specs["qkv_proj"] = {
            name: stacked_parameter_spec(spec, 3) if is_parameter_spec(spec) else spec
            for name, spec in specs["qkv_proj"].items()
        }
        return specs

    def forward(
        self,
        query: Tensor,
        *,
        key: Optional[Tensor] = None,
        value: Optional[Tensor] = None,
        query_positions: Optional[Tensor] = None,
        key_positions: Optional[Tensor] = None,
    ) -> QKV:
        del query_positions, key_positions  # Not rotary.
        if (key is None) != (value is None):
            raise ValueError(f"{self.path()}: give both key and value, or neither")
        if key is None:  # Self-attention: one input through the three weights.
            proj = self.qkv_proj.forward_stacked(query)
        else:
            if not query.shape == key.shape == value.shape:
                raise ValueError(
                    f"{self.path()}: a fused projection needs query, key and value of one "
                    f"shape, got {query.shape}, {key.shape}, {value.shape}"
                )
            inputs = jnp.stack([query, key, value])
            proj = self.qkv_proj.forward_stacked(inputs, stacked_inputs=True)
        return QKV(*unstack(proj))


# ----- rotary position embeddings -----


class RoFormerSinusoidalPositionalEmbedding(BaseLayer):
    """Sines and cosines of position * theta^(-2i/dim), i < dim/2 (rotary embeddings)."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures RoFormerSinusoidalPositionalEmbedding."""

        dim: Required[int] = REQUIRED  # The per-head dim; must be even.
        theta: float = 10000.0  # Base of the geometric sequence of wavelengths.
        # A function config returning a map of the inverse frequencies [dim/2] to rescaled
        # ones, for contexts longer than pretraining's (`linear_rope_scaling`,
        # `llama3_rope_scaling`); None: unscaled.
        frequency_scaling: Optional[InstantiableConfig] = None

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        if cfg.dim % 2:
            raise ConfigError(
                f"{self.path()}.dim: rotary embeddings need an even dim, got {cfg.dim}"
            )
        self._scale_frequencies = (
            None if cfg.frequency_scaling is None else cfg.frequency_scaling.instantiate()
        )

    def forward(self, positions: Tensor) -> Tensor:
        """[..., T] int positions -> [..., T, dim]: sin in the first half, cos in the second."""
        cfg = self.config
        exponents = jnp.arange(0, cfg.dim, 2, dtype=jnp.float32) / cfg.dim
        inv_freq = 1.0 / (cfg.theta**exponents)
        if self._scale_frequencies is not None:
            inv_freq = self._scale_frequencies(inv_freq)
        angles = positions.astype(jnp.float32)[..., None] * inv_freq
        return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


def linear_rope_scaling(*, factor: float) -> Callable[[Tensor], Tensor]:
    """Position interpolation: every inverse frequency divided by `factor`, so that
    positions up to `factor` times the pretraining context fall within its angles
    (Hugging Face rope_type 'linear')."""
    if factor <= 0:
        raise ConfigError(f"linear_rope_scaling: factor must be > 0, got {factor}")
    return lambda inv_freq: inv_freq / factor


@register_configurable
def llama3_rope_scaling(
    *,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> Callable[[Tensor], Tensor]:
    """Llama 3.1's rescaling (Hugging Face rope_type 'llama3'), by wavelength 2*pi/freq:
    shorter than context/high_freq_factor: kept; longer than context/low_freq_factor:
    divided by `factor`; in between: interpolated linearly in context/wavelength between
    the two. `context` is original_max_position_embeddings."""
    if not (factor > 0 and 0 < low_freq_factor < high_freq_factor):
        raise ConfigError(
            "llama3_rope_scaling: need factor > 0 and 0 < low_freq_factor < high_freq_factor, "
            f"got {factor}, {low_freq_factor}, {high_freq_factor}"
        )
    context = float(original_max_position_embeddings)

    def scale(inv_freq: Tensor) -> Tensor:
        wavelength = 2 * math.pi / inv_freq
        # 0 at wavelength context/low_freq_factor, 1 at context/high_freq_factor.
        smooth = (context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
        interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = jnp.where(wavelength > context / low_freq_factor, inv_freq / factor, inv_freq)
        medium = (wavelength >= context / high_freq_factor) & (
            wavelength <= context / low_freq_factor
        )
        return jnp.where(medium, interpolated, scaled)

    return scale


def _rotate(x: Tensor, sin: Tensor, cos: Tensor) -> Tensor:
    """[x1 cos - x2 sin, x2 cos + x1 sin] in float32, x = [x1, x2] split in halves."""
    half = x.shape[-1] // 2
    # The halves on their own axis: XLA then indexes whole contiguous rows of `half`
    # elements instead of splitting the minor axis, which vectorizes.
    y = x.astype(jnp.float32).reshape(*x.shape[:-1], 2, half)
    # y * cos + (y with its halves swapped) * [-sin, sin]: elementwise with a reversal,
    # one loop fusion for XLA, where stacking the two halves' results made it a
    # concatenation. The same float32 formula (a + (-b) is a - b); where XLA contracts a
    # product and a sum into one FMA, a result may differ in its last bf16 bit.
    signs = jnp.asarray([[-1.0], [1.0]], jnp.float32)
    out = y * cos[..., None, :] + jnp.flip(y, axis=-2) * (sin[..., None, :] * signs)
    return out.reshape(x.shape).astype(x.dtype)


@jax.custom_vjp
def _rotate_halves(x: Tensor, sin: Tensor, cos: Tensor) -> Tensor:
    return _rotate(x, sin, cos)


def _rotate_halves_fwd(x, sin, cos):
    return _rotate(x, sin, cos), (x, sin, cos)


def _rotate_halves_bwd(residuals, dy):
    # The rotation is orthogonal, so its transpose rotates by the opposite angle: the
    # backward pass is one fusion shaped like the forward one. Autodiff of the halves'
    # slices and concatenation instead builds pads, which XLA fuses with the rest of the
    # QKV backward into one slow kernel.
    x, sin, cos = residuals
    half = x.shape[-1] // 2
    dx = _rotate(dy, -sin, cos)
    # The angles' cotangents (summed over heads); unused when positions are integers,
    # in which case XLA drops this computation.
    y, g = x.astype(jnp.float32), dy.astype(jnp.float32)
    x1, x2, g1, g2 = y[..., :half], y[..., half:], g[..., :half], g[..., half:]
    dsin = _sum_to_shape(x1 * g2 - x2 * g1, sin.shape).astype(sin.dtype)
    dcos = _sum_to_shape(x1 * g1 + x2 * g2, cos.shape).astype(cos.dtype)
    return dx, dsin, dcos


def _sum_to_shape(x: Tensor, shape: Sequence[int]) -> Tensor:
    """Sums x over the axes along which an operand of `shape` was broadcast to x's shape."""
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return jnp.sum(x, axis=axes, keepdims=True)


_rotate_halves.defvjp(_rotate_halves_fwd, _rotate_halves_bwd)


def apply_rotary_position_embeddings(x: Tensor, sin_cos: Tensor) -> Tensor:
    """Rotates x [B,T,N,H] by the angles of sin_cos [B,T,H].

    Pairs (x[i], x[i + H/2]) are rotated together ("rotate half", as in GPT-NeoX and
    Llama), so weights converted from those models need no permutation.
    """
    half = x.shape[-1] // 2
    return _rotate_halves(x, sin_cos[..., None, :half], sin_cos[..., None, half:])


def _default_positions(x: Tensor) -> Tensor:
    batch, length = x.shape[0], x.shape[1]
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


class _WrappedQKVLinear(BaseQKVLinear):
    """A QKV projection around another (child `i_proj`, built from `input_linear` with this
    layer's dims), whose key/value head count and cache dtype it takes."""

    @config_class
    class Config(BaseQKVLinear.Config):
        """Configures _WrappedQKVLinear."""

        input_linear: BaseQKVLinear.Config = QKVLinear.default_config()  # The projection.

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        self._add_child(
            "i_proj",
            cfg.input_linear.clone(
                query_dim=cfg.query_dim,
                key_dim=cfg.key_dim,
                value_dim=cfg.value_dim,
                num_heads=cfg.num_heads,
                per_head_dim=cfg.per_head_dim,
            ),
        )

    @property
    def num_kv_heads(self) -> int:
        return self.i_proj.num_kv_heads

    @property
    def cache_dtype(self) -> Optional[jnp.dtype]:
        return self._config.cache_dtype or self.i_proj.cache_dtype


class RoFormerQKVLinear(_WrappedQKVLinear):
    """Any QKV projection (child `i_proj`) followed by rotary position embeddings."""

    @config_class
    class Config(_WrappedQKVLinear.Config):
        """Configures RoFormerQKVLinear."""

        rope_pos_emb_layer: RoFormerSinusoidalPositionalEmbedding.Config = (
            RoFormerSinusoidalPositionalEmbedding.default_config()
        )
        rotary_value: bool = True  # Whether values are rotated too (queries and keys always).

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        self._add_child("rope_pos_emb_layer", cfg.rope_pos_emb_layer.clone(dim=cfg.per_head_dim))

    def forward(
        self,
        query: Tensor,
        *,
        key: Optional[Tensor] = None,
        value: Optional[Tensor] = None,
        query_positions: Optional[Tensor] = None,
        key_positions: Optional[Tensor] = None,
    ) -> QKV:
        q, k, v = self.i_proj(query, key=key, value=value)
        if query_positions is None:
            query_positions = _default_positions(query)
        if key_positions is None:
            key_positions = query_positions if key is None else _default_positions(key)
        q_emb = self.rope_pos_emb_layer(query_positions)
        k_emb = q_emb
        if key_positions is not query_positions:
            k_emb = self.rope_pos_emb_layer(key_positions)
        q = apply_rotary_position_embeddings(q, q_emb)
        k = apply_rotary_position_embeddings(k, k_emb)
        if self.config.rotary_value:
            v = apply_rotary_position_embeddings(v, k_emb)
        return QKV(q, k, v)

    def joined_unrotated(self, query: Tensor) -> Tensor:
        """The wrapped projection's, which rotates nothing (see
        `BaseQKVLinear.joined_unrotated`)."""
        return self.i_proj.joined_unrotated(query)

    @property
    def scales_with_input(self) -> bool:
        return self.i_proj.scales_with_input

    def angles(self, positions: Tensor) -> Tensor:
        """The rotary angles at positions [B,T]: sin_cos [B,T,H], sines first."""
        return self.rope_pos_emb_layer(positions)


class QKNormQKVLinear(_WrappedQKVLinear):
    """Any QKV projection (child `i_proj`) whose query and key heads are then normalized
    over H (children `q_norm`, `k_norm`), as Qwen3 normalizes them before rotary
    embeddings: put it under a RoFormerQKVLinear (`input_linear`). A norm in
    `query_scale`/`key_scale` (`ScaleQuery`) acts after the rotary embeddings instead, a
    different function where the norm's scale differs between the dims RoPE pairs."""

    @config_class
    class Config(_WrappedQKVLinear.Config):
        """Configures QKNormQKVLinear."""

        norm: Required[BaseLayer.Config] = REQUIRED  # E.g. RMSNorm; its input_dim is set to H.

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        self._add_child("q_norm", cfg.norm.clone(input_dim=cfg.per_head_dim))
        self._add_child("k_norm", cfg.norm.clone(input_dim=cfg.per_head_dim))

    def forward(
        self,
        query: Tensor,
        *,
        key: Optional[Tensor] = None,
        value: Optional[Tensor] = None,
        query_positions: Optional[Tensor] = None,
        key_positions: Optional[Tensor] = None,
    ) -> QKV:
        q, k, v = self.i_proj(
            query, key=key, value=value, query_positions=query_positions,
            key_positions=key_positions,
        )
        return QKV(self.q_norm(q), self.k_norm(k), v)


# ----- query / key scaling -----


class PerDimScale(BaseLayer):
    """x * softplus(param) / softplus(0): a learned per-dim scale that starts at one."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures PerDimScale."""

        dim: Required[int] = REQUIRED

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        return dict(
            param=ParameterSpec(
                shape=[self.config.dim], mesh_axes=(None,), initializer=constant_initializer(0.0)
            )
        )

    def forward(self, x: Tensor) -> Tensor:
        scale = jax.nn.softplus(self.parameters["param"].astype(jnp.float32)) / math.log(2.0)
        return (x * scale).astype(x.dtype)


class BaseScaleQK(BaseLayer):
    """Per-head processing of projected queries or keys [B,T,N,H]: norm, then scale."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures BaseScaleQK."""

        per_head_dim: Required[int] = REQUIRED  # Set by the attention layer.
        norm: Optional[BaseLayer.Config] = None  # E.g. RMSNorm over H (QK-norm); None: none.
        per_dim_scale: Optional[PerDimScale.Config] = None  # None: no learned scale.
        scale_factor: Optional[float] = None  # None: the class default (see subclasses).

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        if cfg.norm is not None:
            self._add_child("norm", cfg.norm.clone(input_dim=cfg.per_head_dim))
        if cfg.per_dim_scale is not None:
            self._add_child("per_dim_scale", cfg.per_dim_scale.clone(dim=cfg.per_head_dim))

    def _default_scale(self) -> float:
        raise NotImplementedError(type(self))

    @property
    def constant_scale(self) -> Optional[float]:
        """The factor, where the processing is a constant multiply alone (no norm, no
        learned scale); else None."""
        cfg = self._config
        if cfg.norm is not None or cfg.per_dim_scale is not None:
            return None
        return cfg.scale_factor if cfg.scale_factor is not None else self._default_scale()

    def forward(self, proj: Tensor) -> Tensor:
        cfg = self.config
        if cfg.norm is not None:
            proj = self.norm(proj)
        if cfg.per_dim_scale is not None:
            proj = self.per_dim_scale(proj)
        scale = cfg.scale_factor if cfg.scale_factor is not None else self._default_scale()
        return proj * jnp.asarray(scale, proj.dtype) if scale != 1.0 else proj


class ScaleQuery(BaseScaleQK):
    """Queries: optional norm, then * scale_factor (default 1/sqrt(per_head_dim)).

    The attention layer applies it after i_proj, i.e. after rotary embeddings.
    """

    def _default_scale(self) -> float:
        return 1.0 / math.sqrt(self._config.per_head_dim)


class ScaleKey(BaseScaleQK):
    """Keys: optional norm, then * scale_factor (default 1)."""

    def _default_scale(self) -> float:
        return 1.0


# ----- attention -----

_IMPLEMENTATIONS = (None, "xla", "cudnn")
# Self-attention projections that take no positions (nothing to rotate).
_POSITIONLESS_PROJECTIONS = (QKVLinear, FusedGroupedQKVLinear, FusedQKVLinear)


class MultiheadAttention(BaseLayer):
    """Attention with num_heads heads; children i_proj, o_proj, dropout, scale_query, scale_key.

    Rematerialization names (for `remat_spec` policies): q_proj, k_proj, v_proj (after
    i_proj), context (before o_proj) and o_proj (after it), prefixed with the class name.
    """

    @config_class
    class Config(BaseLayer.Config):
        """Configures MultiheadAttention."""

        query_dim: Required[int] = REQUIRED  # Set by TransformerAttentionLayer.
        key_dim: Required[int] = REQUIRED
        value_dim: Required[int] = REQUIRED
        output_dim: Required[int] = REQUIRED
        hidden_dim: Optional[int] = None  # num_heads * per_head_dim; None: query_dim.
        num_heads: Required[int] = REQUIRED
        input_linear: BaseQKVLinear.Config = QKVLinear.default_config()
        output_linear: MultiheadOutputLinear.Config = MultiheadOutputLinear.default_config()
        dropout: Dropout.Config = Dropout.default_config()  # On attention probabilities.
        query_scale: BaseScaleQK.Config = ScaleQuery.default_config()
        key_scale: BaseScaleQK.Config = ScaleKey.default_config()
        # Whether a query attends only to keys at or before it; None or False: not causal.
        causal: Optional[bool] = None
        atten_logit_cap: Optional[float] = None  # cap * tanh(logits / cap); None: no cap.
        # 'xla', 'cudnn' (jax.nn.dot_product_attention's flash kernel, GPU, bf16/fp16),
        # or None: cuDNN where it applies, XLA elsewhere. On cuDNN, segment ids become
        # a [B,1,T,S] mask (the public API has no packed-segment mode); decoding
        # (extend_step) uses it one token at a time, the XLA path for longer steps. None
        # decodes a token through `kernels.decode_attention` where it applies (GPU, small
        # batches, short caches): the whole step (RoPE, cache write, attention) in one
        # kernel where the layer allows it (`_one_kernel_mode`), cuDNN elsewhere.
        attention_implementation: Optional[str] = None
        # The key/value cache for decoding (child `kv_cache`); None: a default KVCache.
        kv_cache: Optional[BaseLayer.Config] = None
        # Sharding of the output projection's result [B, T, output_dim] (AXLearn's
        # o_partition_spec); None: left to the partitioner.
        o_partition_spec: Optional[MeshAxes] = None

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        hidden_dim = cfg.hidden_dim or cfg.query_dim
        if hidden_dim % cfg.num_heads:
            raise ConfigError(
                f"{self.path()}: hidden_dim {hidden_dim} is not a multiple of "
                f"num_heads {cfg.num_heads}"
            )
        if cfg.attention_implementation not in _IMPLEMENTATIONS:
            raise ConfigError(
                f"{self.path()}.attention_implementation: '{cfg.attention_implementation}' "
                f"is not one of {_IMPLEMENTATIONS}"
            )
        if cfg.attention_implementation == "cudnn" and (
            cfg.atten_logit_cap is not None or cfg.dropout.rate
        ):
            raise ConfigError(
                f"{self.path()}: attention_implementation='cudnn' supports neither "
                "atten_logit_cap nor dropout.rate; use 'xla' or None"
            )
        self._per_head_dim = hidden_dim // cfg.num_heads
        self._add_child(
            "i_proj",
            cfg.input_linear.clone(
                query_dim=cfg.query_dim,
                key_dim=cfg.key_dim,
                value_dim=cfg.value_dim,
                num_heads=cfg.num_heads,
                per_head_dim=self._per_head_dim,
            ),
        )
        # AXLearn's child order, which is the order of the `_init` golden lines.
        self._add_child(
            "o_proj",
            cfg.output_linear.clone(
                model_dim=cfg.output_dim, num_heads=cfg.num_heads, per_head_dim=self._per_head_dim
            ),
        )
        self._add_child("dropout", cfg.dropout)
        self._add_child("scale_query", cfg.query_scale.clone(per_head_dim=self._per_head_dim))
        self._add_child("scale_key", cfg.key_scale.clone(per_head_dim=self._per_head_dim))
        self._check_kv_heads(self.i_proj.num_kv_heads)
        # The cache's dtype defaults to input_linear's cache_dtype (see init_states).
        self._add_child("kv_cache", cfg.kv_cache or KVCache.default_config())

    def _check_kv_heads(self, num_kv_heads: int) -> None:
        if num_kv_heads != self._config.num_heads:
            raise ConfigError(
                f"{self.path()}: input_linear has {num_kv_heads} key/value heads but "
                f"num_heads is {self._config.num_heads}; use GroupedQueryAttention"
            )

    @property
    def per_head_dim(self) -> int:
        return self._per_head_dim

    @property
    def num_kv_heads(self) -> int:
        return self.i_proj.num_kv_heads

    # --- projections ---

    def _project(
        self,
        query: Tensor,
        *,
        key: Optional[Tensor],
        value: Optional[Tensor],
        query_positions: Optional[Tensor],
    ) -> QKV:
        q, k, v = self.i_proj(query, key=key, value=value, query_positions=query_positions)
        k, v = (whole_heads_if_uneven(t, axis=-2) for t in (k, v))
        q = self._remat_name(q, "q_proj")
        k = self._remat_name(k, "k_proj")
        v = self._remat_name(v, "v_proj")
        return QKV(self.scale_query(q), self.scale_key(k), v)

    def _output(self, context: Tensor) -> Tensor:
        context = self._remat_name(context, "context")
        o_proj = maybe_shard(self.o_proj(context), self.config.o_partition_spec)
        return self._remat_name(o_proj, "o_proj")

    # --- the attention itself ---

    def _use_cudnn(self, q: Tensor, k: Tensor, *, decoding: bool = False) -> bool:
        """Whether q [B,T,N,H] attends to k [B,S,K,H] through cuDNN's flash kernel: as
        configured, or (None) where the kernel takes the shapes and dtypes, on GPU only.
        `decoding`: one query a row against a cache (any S), on GPU only even where cuDNN
        is configured (a model trained on GPUs may decode on a CPU)."""
        cfg = self._config
        if cfg.attention_implementation == "xla":
            return False
        if decoding and jax.default_backend() != "gpu":
            return False
        if cfg.attention_implementation == "cudnn":
            return True
        same_length = q.shape[1] == k.shape[1] and q.shape[1] % 2 == 0
        return (
            jax.default_backend() == "gpu"
            and q.dtype in (jnp.bfloat16, jnp.float16)
            and k.dtype == q.dtype
            and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 128
            and (decoding or same_length)
            and cfg.atten_logit_cap is None
            and not (self.is_training and cfg.dropout.rate)
        )

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        q_index: Optional[Tensor] = None,
        kv_valid: Optional[Tensor] = None,
        kv_lengths: Optional[Tensor] = None,
        segment_ids: Optional[Tensor] = None,
        logit_biases: Optional[Tensor] = None,
    ) -> Tensor:
        """softmax(q k^T) v: q [B,T,N,H], k/v [B,S,K,H] -> [B,T,N,H].

        q_index [B,T]: the index of each query among the keys (default: arange(T), i.e.
        queries and keys are the same sequence); kv_valid [B,S]: which keys exist, and
        kv_lengths [B], where given, the same as a count (they are the first ones);
        logit_biases [B,1|N,T,S]: added to the logits (an attention-mask layer's output).
        """
        cfg = self._config
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        # Decoding one token: the keys it may see are the first q_index + 1 (causal), all
        # written (kv_lengths), so a length is the whole mask. One kernel (ours, or cuDNN's
        # where so configured) instead of the einsum path's five (two matmuls, three
        # softmax passes): docs/performance.md's generation figures.
        if (
            q.shape[1] == 1
            and q_index is not None
            and kv_lengths is not None
            and cfg.causal
            and segment_ids is None
            and logit_biases is None
            and cfg.atten_logit_cap is None
        ):
            lengths = jnp.minimum(q_index[:, 0] + 1, kv_lengths).astype(jnp.int32)
            # Unconfigured, our kernel where it applies (one launch, no key past the length).
            interpret = (
                decode_attention_mode(q[:, 0], k) if cfg.attention_implementation is None else None
            )
            if interpret is not None:
                return decode_attention(q[:, 0], k, v, lengths, interpret=interpret)[:, None]
            if self._use_cudnn(q, k, decoding=True):
                return jax.nn.dot_product_attention(
                    q, k, v, scale=1.0, key_value_seq_lengths=lengths, implementation="cudnn"
                )
        if q_index is None and kv_valid is None and self._use_cudnn(q, k):
            mask = None
            if segment_ids is not None:
                mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
            bias = None if logit_biases is None else logit_biases.astype(q.dtype)
            # The query is already scaled (ScaleQuery), hence scale=1.
            return jax.nn.dot_product_attention(
                q, k, v, bias=bias, mask=mask, scale=1.0, is_causal=bool(cfg.causal),
                implementation="cudnn",
            )
        batch, q_len, num_heads, head_dim = q.shape
        kv_len, num_kv_heads = k.shape[1], k.shape[2]
        groups = num_heads // num_kv_heads
        q = q.reshape(batch, q_len, num_kv_heads, groups, head_dim)
        logits = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
        if cfg.atten_logit_cap is not None:
            logits = cfg.atten_logit_cap * jnp.tanh(logits / cfg.atten_logit_cap)
        if logit_biases is not None:
            heads = (num_kv_heads, groups) if logit_biases.shape[1] > 1 else (1, 1)
            logits = logits + logit_biases.reshape(batch, *heads, q_len, kv_len)
        mask = self._mask(batch, q_len, kv_len, q_index, kv_valid, segment_ids)
        if mask is not None:
            logits = jnp.where(mask[:, None, None], logits, _NEG_INF)
        probs = self._probs(logits).astype(v.dtype)
        probs = self.dropout(probs)
        context = jnp.einsum("bkgts,bskh->btkgh", probs, v)
        return context.reshape(batch, q_len, num_heads, head_dim)

    def _probs(self, logits: Tensor) -> Tensor:
        """Attention probabilities from float32 logits [..., T, S]: softmax over S."""
        return jax.nn.softmax(logits, axis=-1)

    def _mask(self, batch, q_len, kv_len, q_index, kv_valid, segment_ids) -> Optional[Tensor]:
        """[B,T,S] bool (True: attend), or None for no masking."""
        masks = []
        if self._config.causal:
            if q_index is None:
                q_index = jnp.arange(q_len)[None, :]
            masks.append(q_index[:, :, None] >= jnp.arange(kv_len)[None, None, :])
        if kv_valid is not None:
            masks.append(kv_valid[:, None, :])
        if segment_ids is not None:
            masks.append(segment_ids[:, :, None] == segment_ids[:, None, :])
        if not masks:
            return None
        mask = masks[0]
        for m in masks[1:]:
            mask = jnp.logical_and(mask, m)
        return jnp.broadcast_to(mask, (batch, q_len, kv_len))

    # --- public methods ---

    def forward(
        self,
        query: Tensor,
        *,
        key: Optional[Tensor] = None,
        value: Optional[Tensor] = None,
        segment_ids: Optional[Tensor] = None,
        positions: Optional[Tensor] = None,
        attention_logit_biases: Optional[Tensor] = None,
    ) -> Tensor:
        """query [B,T,D] (key/value [B,S,*] for cross-attention) -> [B,T,output_dim].

        segment_ids [B,T]: tokens attend only within their own segment (packed
        documents; self-attention only). positions [B,T]: rotary positions (default
        arange(T)). attention_logit_biases [B,1|N,T,S]: added to the logits (e.g. ALiBi's).
        """
        if segment_ids is not None and key is not None:
            raise ValueError(f"{self.path()}: segment_ids apply to self-attention only")
        q, k, v = self._project(query, key=key, value=value, query_positions=positions)
        context = self._attend(
            q, k, v, segment_ids=segment_ids, logit_biases=attention_logit_biases
        )
        return self._output(context)

    def init_states(self, *, batch_size: int, max_len: int) -> dict[str, Tensor]:
        """An empty key/value cache (the `kv_cache` child's): {'key', 'value'} of
        [B, max_len, K, H] zeros."""
        return self.kv_cache.init_states(
            batch_size=batch_size,
            max_len=max_len,
            num_kv_heads=self.num_kv_heads,
            per_head_dim=self._per_head_dim,
            dtype=self.i_proj.cache_dtype or self.dtype,
        )

    def extend_step(
        self,
        cached_states: dict[str, Tensor],
        query: Tensor,
        *,
        time_step: Tensor,
        attention_logit_biases: Optional[Tensor] = None,
        norm_input: Optional[Tensor] = None,
        norm_eps: float = 0.0,
    ) -> tuple[dict[str, Tensor], Tensor]:
        """Self-attention for query [B,S,D] at positions time_step[b] + arange(S).

        The new keys/values are written into the cache at those positions (the caller
        keeps time_step + S <= max_len). Returns (new cache, outputs [B,S,output_dim]).
        attention_logit_biases [B,1|N,S,max_len]: added to the logits against the cache.
        norm_input [B,1,D]: query is `layers.RMSNorm.unfinished(norm_input)` (an RMSNorm
        of epsilon `norm_eps`), which the step kernel finishes; only where
        `takes_unfinished_norm` says so.
        """
        time_step = time_step.astype(jnp.int32)
        interpret = self._one_kernel_mode(cached_states, query, attention_logit_biases)
        if norm_input is not None:
            if not self.takes_unfinished_norm(cached_states, query, attention_logit_biases):
                raise ValueError(f"{self.path()}: this step cannot finish a norm of its query")
            return self._decode_in_one_kernel(
                cached_states, query, time_step, interpret, norm_input[:, 0], norm_eps
            )
        if interpret is not None:
            return self._decode_in_one_kernel(cached_states, query, time_step, interpret)
        steps = query.shape[1]
        q_index = time_step[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]
        q, k, v = self._project(query, key=None, value=None, query_positions=q_index)
        new_states, cached = self.kv_cache.extend_step(
            cached_states, k_proj=k, v_proj=v, time_step=time_step
        )
        context = self._attend(
            q, cached.k_proj, cached.v_proj, q_index=q_index, kv_valid=cached.kv_valid,
            kv_lengths=cached.kv_lengths, logit_biases=attention_logit_biases,
        )
        return new_states, self._output(context)

    def takes_unfinished_norm(
        self,
        cached_states: dict[str, Tensor],
        query: Tensor,
        attention_logit_biases: Optional[Tensor] = None,
    ) -> bool:
        """Whether `extend_step` can take its query as an unfinished RMSNorm (`norm_input`):
        where the step is one kernel and the projections scale with their input."""
        interpret = self._one_kernel_mode(cached_states, query, attention_logit_biases)
        return interpret is not None and self.i_proj.scales_with_input

    def _one_kernel_mode(
        self, cached_states: dict[str, Tensor], query: Tensor, logit_biases: Optional[Tensor]
    ) -> Optional[bool]:
        """The `interpret` flag of `decode_step_attention` (rotation, cache write and
        attention in one kernel) where a step of one token a row takes it, else None: no
        logit biases, unconfigured attention, causal, uncapped, with the plain KVCache and a
        query scale alone, over a rotary projection that leaves values unrotated or one
        that takes no positions, where the kernel applies."""
        cfg = self._config
        proj = self.i_proj
        rotary = isinstance(proj, RoFormerQKVLinear)
        if (
            logit_biases is not None
            or query.shape[1] != 1
            or not cfg.causal
            or cfg.atten_logit_cap is not None
            or cfg.attention_implementation is not None
            or type(self.kv_cache) is not KVCache  # pylint: disable=unidiomatic-typecheck
            or self.scale_query.constant_scale is None
            or self.scale_key.constant_scale != 1.0
            or (rotary and proj.config.rotary_value)
            or not (rotary or isinstance(proj, _POSITIONLESS_PROJECTIONS))
        ):
            return None
        key_cache = cached_states["key"]
        if not key_cache.dtype == cached_states["value"].dtype == query.dtype:
            return None
        q_shape = (query.shape[0], cfg.num_heads, self._per_head_dim)
        return decode_step_mode(q_shape, key_cache)

    def _decode_in_one_kernel(
        self,
        cached_states: dict[str, Tensor],
        query: Tensor,
        time_step: Tensor,
        interpret: bool,
        norm_input: Optional[Tensor] = None,
        norm_eps: float = 0.0,
    ) -> tuple[dict[str, Tensor], Tensor]:
        """`norm_input` [B,D]: the input of an RMSNorm (epsilon `norm_eps`) the kernel is
        to finish."""
        sin_cos = None
        if isinstance(self.i_proj, RoFormerQKVLinear):
            sin_cos = self.i_proj.angles(time_step[:, None])[:, 0]
        qkv = self.i_proj.joined_unrotated(query)[:, 0]
        context, key, value = decode_step_attention(
            qkv, cached_states["key"], cached_states["value"], time_step, sin_cos, norm_input,
            num_heads=self._config.num_heads, query_scale=self.scale_query.constant_scale,
            norm_eps=norm_eps, interpret=interpret,
        )
        return dict(key=key, value=value), self._output(context[:, None])


class GroupedQueryAttention(MultiheadAttention):
    """Attention whose input_linear has fewer key/value heads than query heads (GQA/MQA)."""

    def _check_kv_heads(self, num_kv_heads: int) -> None:
        if self._config.num_heads % num_kv_heads:
            raise ConfigError(
                f"{self.path()}: num_heads {self._config.num_heads} is not a multiple of "
                f"the input_linear's num_kv_heads {num_kv_heads}"
            )


# ----- transformer sublayers -----

_STRUCTURES = ("prenorm", "postnorm", "hybridnorm")


def _check_structure(layer: BaseLayer, structure: str) -> None:
    if structure not in _STRUCTURES:
        raise ConfigError(f"{layer.path()}.structure: '{structure}' is not one of {_STRUCTURES}")


def _add_norms(layer: BaseLayer, structure: str, norm: BaseLayer.Config, dim: int) -> None:
    """prenorm/postnorm: child `norm`; hybridnorm: children `prenorm` and `postnorm`."""
    if structure == "hybridnorm":
        layer._add_child("prenorm", norm.clone(input_dim=dim))
        layer._add_child("postnorm", norm.clone(input_dim=dim))
    else:
        layer._add_child("norm", norm.clone(input_dim=dim))


class TransformerAttentionLayer(BaseLayer):
    """Attention with normalization, dropout, stochastic depth and a residual connection.

    structure: 'prenorm' (x + f(norm(x))), 'postnorm' (norm(x + f(x))) or 'hybridnorm'
    (x + postnorm(f(prenorm(x)))).
    """

    @config_class
    class Config(BaseLayer.Config):
        """Configures TransformerAttentionLayer."""

        target_dim: Required[int] = REQUIRED  # Dim of the queries and of the output.
        source_dim: Required[int] = REQUIRED  # Dim of keys/values (== target_dim for self).
        norm: BaseLayer.Config = LayerNorm.default_config()
        attention: MultiheadAttention.Config = MultiheadAttention.default_config()
        dropout: Dropout.Config = Dropout.default_config()  # On the attention output.
        stochastic_depth: StochasticDepth.Config = StochasticDepth.default_config()
        structure: str = "prenorm"

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        _check_structure(self, cfg.structure)
        _add_norms(self, cfg.structure, cfg.norm, cfg.target_dim)
        self._add_child(
            "attention",
            cfg.attention.clone(
                query_dim=cfg.target_dim,
                key_dim=cfg.source_dim,
                value_dim=cfg.source_dim,
                output_dim=cfg.target_dim,
            ),
        )
        self._add_child("dropout", cfg.dropout)
        self._add_child("stochastic_depth", cfg.stochastic_depth)

    def _residual(
        self,
        target: Tensor,
        attend: Callable[[Tensor], Tensor],
        residual_partition_spec: Optional[MeshAxes] = None,
    ) -> Tensor:
        structure = self._config.structure
        # Without the residual stream's partition spec, the norm keeps autodiff's backward
        # on a mesh of several devices (`BaseNormalizationLayer.residual_and_norm`).
        if structure == "prenorm":
            target, normed = self.norm.residual_and_norm(
                target, partition_spec=residual_partition_spec
            )
            y = attend(normed)
        elif structure == "hybridnorm":
            target, normed = self.prenorm.residual_and_norm(
                target, partition_spec=residual_partition_spec
            )
            y = self.postnorm(attend(normed))
        else:
            y = attend(target)
        y = residual_add(
            target, self.stochastic_depth(self.dropout(y)), is_training=self.is_training
        )
        return self.norm(y) if structure == "postnorm" else y

    def forward(
        self,
        target: Tensor,
        *,
        source: Optional[Tensor] = None,
        segment_ids: Optional[Tensor] = None,
        positions: Optional[Tensor] = None,
        residual_partition_spec: Optional[MeshAxes] = None,
        attention_logit_biases: Optional[Tensor] = None,
    ) -> Tensor:
        """target [B,T,target_dim]; source [B,S,source_dim] for cross-attention.
        `residual_partition_spec`: how target is split over the mesh, if known (lets a
        norm with a kernel run its backward per device). `attention_logit_biases`
        [B,1|N,T,S]: added to the attention logits."""
        biases = {} if attention_logit_biases is None else dict(
            attention_logit_biases=attention_logit_biases
        )
        return self._residual(
            target,
            lambda x: self.attention(
                x, key=source, value=source, segment_ids=segment_ids, positions=positions,
                **biases,
            ),
            residual_partition_spec,
        )

    def init_states(self, *, batch_size: int, max_len: int) -> dict[str, Tensor]:
        return self.attention.init_states(batch_size=batch_size, max_len=max_len)

    def extend_step(
        self,
        cached_states: dict[str, Tensor],
        target: Tensor,
        *,
        time_step: Tensor,
        attention_logit_biases: Optional[Tensor] = None,
    ) -> tuple[dict[str, Tensor], Tensor]:
        new_states = {}
        biases = {} if attention_logit_biases is None else dict(
            attention_logit_biases=attention_logit_biases
        )

        def attend(x: Tensor, **norm) -> Tensor:
            states, out = self.attention.extend_step(
                cached_states, x, time_step=time_step, **biases, **norm
            )
            new_states.update(states)
            return out

        # A prenorm RMSNorm's division by the RMS is left to the attention's kernel.
        unfinished = None
        if (
            self._config.structure == "prenorm"
            and isinstance(self.norm, RMSNorm)
            and self.attention.takes_unfinished_norm(cached_states, target, **biases)
        ):
            unfinished = self.norm.unfinished(target)
        if unfinished is None:
            return new_states, self._residual(target, attend)
        y = attend(unfinished, norm_input=target, norm_eps=self.norm.config.eps)
        y = self.stochastic_depth(self.dropout(y))
        return new_states, residual_add(target, y, is_training=self.is_training)


HiddenDim = Union[int, InstantiableConfig]


def _plain_linear(cfg: Linear.Config) -> bool:
    """Whether `cfg` configures a Linear that is its matmul alone (no bias, no FP8)."""
    return cfg.klass is Linear and not cfg.bias and cfg.fp8 is None


class TransformerFeedForwardLayer(BaseLayer):
    """x + linear2(act(linear1(norm(x)))) (prenorm), optionally gated.

    `activation` is one name (children linear1, linear2) or a pair of names for a gated
    unit act0(linear1_0(x)) * act1(linear1_1(x)) (children linear1_0, linear1_1, linear2).
    """

    @config_class
    class Config(BaseLayer.Config):
        """Configures TransformerFeedForwardLayer."""

        input_dim: Required[int] = REQUIRED  # Set by TransformerLayer.
        # An int, or a function config: either with an `input_dim` field (default None;
        # set here) that returns the size, or one returning a rule input_dim -> size
        # (layers.scaled_hidden_dim).
        hidden_dim: Required[HiddenDim] = REQUIRED
        activation: Union[str, Sequence[str]] = "nn.relu"
        linear1: Linear.Config = Linear.default_config()
        linear2: Linear.Config = Linear.default_config()
        norm: BaseLayer.Config = LayerNorm.default_config()
        dropout: Dropout.Config = Dropout.default_config()  # After act and after linear2.
        stochastic_depth: StochasticDepth.Config = StochasticDepth.default_config()
        structure: str = "prenorm"  # 'prenorm', 'postnorm' or 'hybridnorm'.
        residual_weight: float = 1.0  # Multiplies the branch before the residual add.
        # Summary 'dead_neurons/<linear1 or linear1_0>': the number of hidden units whose
        # activation is never positive over the batch.
        add_dead_neuron_summary: Optional[bool] = None
        # Summaries 'rms_norm/<name>' for names among 'inputs', 'linear1_outputs',
        # 'linear2_outputs'.
        add_value_rms_norm_summary: Optional[Sequence[str]] = None

    _RMS_NAMES = ("inputs", "linear1_outputs", "linear2_outputs")

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        _check_structure(self, cfg.structure)
        for name in cfg.add_value_rms_norm_summary or ():
            if name not in self._RMS_NAMES:
                raise ConfigError(
                    f"{self.path()}.add_value_rms_norm_summary: '{name}' is not one of "
                    f"{self._RMS_NAMES}"
                )
        hidden_dim = cfg.hidden_dim
        if isinstance(hidden_dim, InstantiableConfig):
            if "input_dim" in hidden_dim:  # A function of input_dim (and its other fields).
                hidden_dim = hidden_dim.clone(input_dim=cfg.input_dim).instantiate()
            else:  # A function that returns a rule input_dim -> hidden_dim.
                hidden_dim = maybe_instantiate(hidden_dim)(cfg.input_dim)
        if not isinstance(hidden_dim, int) or hidden_dim <= 0:
            raise ConfigError(
                f"{self.path()}.hidden_dim: expected a positive int, got {hidden_dim}"
            )
        self._hidden_dim = hidden_dim
        if isinstance(cfg.activation, str):
            self._activations = [(("linear1"), get_activation_fn(cfg.activation))]
        elif len(cfg.activation) == 2:
            self._activations = [
                (f"linear1_{i}", get_activation_fn(name)) for i, name in enumerate(cfg.activation)
            ]
        else:
            raise ConfigError(
                f"{self.path()}.activation: expected a name or a pair of names, "
                f"got {cfg.activation}"
            )
        _add_norms(self, cfg.structure, cfg.norm, cfg.input_dim)
        for name, _ in self._activations:
            self._add_child(name, cfg.linear1.clone(input_dim=cfg.input_dim, output_dim=hidden_dim))
        self._add_child(
            "linear2", cfg.linear2.clone(input_dim=hidden_dim, output_dim=cfg.input_dim)
        )
        self._add_child("dropout1", cfg.dropout)
        self._add_child("dropout2", cfg.dropout)
        self._add_child("stochastic_depth", cfg.stochastic_depth)

    @property
    def hidden_dim(self) -> int:
        return self._hidden_dim

    def _add_rms_summary(self, name: str, x: Tensor) -> None:
        if name in (self._config.add_value_rms_norm_summary or ()):
            self.add_summary(f"rms_norm/{name}", rms(x))

    def _hidden(self, xs: Sequence[Tensor], row_scale: Optional[Tensor] = None) -> Tensor:
        """The hidden units of inputs xs (one for each linear1), whose projections are
        multiplied by `row_scale` [..., 1] first if given (finishing an unfinished norm)."""
        pre = [getattr(self, name)(x) for (name, _), x in zip(self._activations, xs)]
        if row_scale is not None:
            pre = [(p.astype(jnp.float32) * row_scale).astype(p.dtype) for p in pre]
        (name, activation), a = self._activations[0], pre[0]
        # Only the activated branch can die; a gate's linear partner cannot.
        if self._config.add_dead_neuron_summary:
            h = activation(a)
            never_positive = jnp.max(h.reshape(-1, h.shape[-1]), axis=0) <= 0
            self.add_summary(f"dead_neurons/{name}", jnp.sum(never_positive).astype(jnp.float32))
        if len(pre) == 1:
            return activation(a)
        partition_spec = self._config.linear1.output_partition_spec
        return gated_product(activation, self._activations[1][1], a, pre[1], partition_spec)

    def residual_partition_spec(self) -> Optional[MeshAxes]:
        """How the residual stream this block adds to is split: like linear2's output."""
        return self._config.linear2.output_partition_spec

    def forward(self, inputs: Tensor) -> Tensor:
        """[B,T,input_dim] -> [B,T,input_dim]."""
        cfg = self._config
        self._add_rms_summary("inputs", inputs)
        residual_spec = self.residual_partition_spec()
        # The normalized inputs go to each input projection as a copy of its own, so
        # that the norm's backward can sum their gradients itself.
        consumers = len(self._activations)
        # Decoding: a prenorm RMSNorm's division by the RMS is left to the activations'
        # kernel, its statistic to the residual add's.
        unfinished, row_scale = None, None
        prenorm = cfg.structure == "prenorm"
        if prenorm and isinstance(self.norm, RMSNorm) and _plain_linear(cfg.linear1):
            unfinished = self.norm.unfinished(inputs)
        if unfinished is not None:
            row_scale = inverse_rms(inputs.astype(jnp.float32), self.norm.config.eps)
            xs = [unfinished] * consumers
        elif prenorm:
            inputs, *xs = self.norm.residual_and_norm(
                inputs, partition_spec=residual_spec, consumers=consumers
            )
        elif cfg.structure == "hybridnorm":
            inputs, *xs = self.prenorm.residual_and_norm(
                inputs, partition_spec=residual_spec, consumers=consumers
            )
        else:
            xs = [inputs] * consumers
        h = self._hidden(xs, row_scale)
        self._add_rms_summary("linear1_outputs", h)
        y = self.linear2(self.dropout1(h))
        self._add_rms_summary("linear2_outputs", y)
        if cfg.structure == "hybridnorm":
            y = self.postnorm(y)
        y = self.stochastic_depth(self.dropout2(y))
        if cfg.residual_weight != 1.0:
            y = y * cfg.residual_weight
        y = residual_add(inputs, y, is_training=self.is_training)
        return self.norm(y) if cfg.structure == "postnorm" else y


# ----- transformer layers and stacks -----


class TransformerLayer(BaseLayer):
    """Self-attention (children self_attention), optional cross_attention, feed_forward."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures TransformerLayer."""

        input_dim: Required[int] = REQUIRED  # Set by the stack / decoder.
        self_attention: TransformerAttentionLayer.Config = (
            TransformerAttentionLayer.default_config()
        )
        feed_forward: TransformerFeedForwardLayer.Config = (
            TransformerFeedForwardLayer.default_config()
        )
        # None: no cross-attention. Otherwise its source_dim must be set.
        cross_attention: Optional[TransformerAttentionLayer.Config] = None

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        self._add_child(
            "self_attention",
            cfg.self_attention.clone(target_dim=cfg.input_dim, source_dim=cfg.input_dim),
        )
        if cfg.cross_attention is not None:
            self._add_child("cross_attention", cfg.cross_attention.clone(target_dim=cfg.input_dim))
        self._add_child("feed_forward", cfg.feed_forward.clone(input_dim=cfg.input_dim))

    def _cross(self, data: Tensor, cross_attention_data: Optional[Tensor]) -> Tensor:
        if self._config.cross_attention is None:
            if cross_attention_data is not None:
                raise ValueError(
                    f"{self.path()}: cross_attention_data given without cross_attention"
                )
            return data
        if cross_attention_data is None:
            raise ValueError(f"{self.path()}: cross_attention needs cross_attention_data")
        return self.cross_attention(
            data,
            source=cross_attention_data,
            residual_partition_spec=self.feed_forward.residual_partition_spec(),
        )

    def forward(
        self,
        data: Tensor,
        *,
        segment_ids: Optional[Tensor] = None,
        positions: Optional[Tensor] = None,
        cross_attention_data: Optional[Tensor] = None,
        attention_logit_biases: Optional[Tensor] = None,
    ) -> Tensor:
        """data [B,T,D] -> [B,T,D]; attention_logit_biases [B,1|N,T,T] go to self-attention."""
        data = self.self_attention(
            data,
            segment_ids=segment_ids,
            positions=positions,
            residual_partition_spec=self.feed_forward.residual_partition_spec(),
            attention_logit_biases=attention_logit_biases,
        )
        data = self._cross(data, cross_attention_data)
        return self.feed_forward(data)

    def init_states(self, *, batch_size: int, max_len: int) -> dict[str, Any]:
        return dict(
            self_attention=self.self_attention.init_states(batch_size=batch_size, max_len=max_len)
        )

    def extend_step(
        self,
        cached_states: dict[str, Any],
        data: Tensor,
        *,
        time_step: Tensor,
        cross_attention_data: Optional[Tensor] = None,
        attention_logit_biases: Optional[Tensor] = None,
    ) -> tuple[dict[str, Any], Tensor]:
        """Decodes data [B,S,D] at positions time_step + arange(S); see the module doc.
        attention_logit_biases [B,1|N,S,max_len] go to self-attention."""
        states, data = self.self_attention.extend_step(
            cached_states["self_attention"], data, time_step=time_step,
            attention_logit_biases=attention_logit_biases,
        )
        data = self._cross(data, cross_attention_data)
        return dict(self_attention=states), self.feed_forward(data)


class BaseStackedTransformerLayer(BaseLayer):
    """num_layers copies of `layer`, applied in sequence; same methods as TransformerLayer."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures BaseStackedTransformerLayer."""

        input_dim: Required[int] = REQUIRED  # Set by the decoder.
        num_layers: Required[int] = REQUIRED
        layer: Required[BaseLayer.Config] = REQUIRED  # The layer config to stack.


class StackedTransformerLayer(BaseStackedTransformerLayer):
    """One child per layer: layer0 ... layer{num_layers-1}.

    `layer` is one config that every layer copies, or a list of num_layers configs, one
    per layer (as AXLearn's MoE configs alternate dense and mixture-of-experts layers).
    """

    @config_class
    class Config(BaseStackedTransformerLayer.Config):
        """Configures StackedTransformerLayer."""

        # One layer config for all layers, or a sequence of num_layers configs in order.
        layer: Required[Union[BaseLayer.Config, Sequence[BaseLayer.Config]]] = REQUIRED

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        for i, layer in enumerate(self._layer_configs()):
            self._add_child(f"layer{i}", layer.clone(input_dim=cfg.input_dim))

    def _layer_configs(self) -> list[BaseLayer.Config]:
        """The config of each layer, checked against num_layers."""
        cfg = self.config
        if not isinstance(cfg.layer, (list, tuple)):
            return [cfg.layer] * cfg.num_layers
        if len(cfg.layer) != cfg.num_layers:
            raise ConfigError(
                f"{self.path()}.layer: {len(cfg.layer)} layer configs for "
                f"num_layers={cfg.num_layers}; give one config or exactly num_layers"
            )
        for i, layer in enumerate(cfg.layer):
            if not isinstance(layer, BaseLayer.Config):
                raise ConfigError(
                    f"{self.path()}.layer[{i}]: expected a layer config, got {type(layer).__name__}"
                )
        return list(cfg.layer)

    def _layers(self) -> list[BaseLayer]:
        return [getattr(self, f"layer{i}") for i in range(self._config.num_layers)]

    def forward(self, data: Tensor, **kwargs) -> Tensor:
        """data [B,T,D] -> [B,T,D]; kwargs (segment_ids, positions, ...) go to every layer."""
        for layer in self._layers():
            data = layer(data, **kwargs)
        return data

    def init_states(self, *, batch_size: int, max_len: int) -> dict[str, Any]:
        return {
            layer.name: layer.init_states(batch_size=batch_size, max_len=max_len)
            for layer in self._layers()
        }

    def extend_step(
        self, cached_states: dict[str, Any], data: Tensor, *, time_step: Tensor, **kwargs
    ) -> tuple[dict[str, Any], Tensor]:
        new_states = {}
        for layer in self._layers():
            new_states[layer.name], data = layer.extend_step(
                cached_states[layer.name], data, time_step=time_step, **kwargs
            )
        return new_states, data


class _StackedDecoding(BaseLayer):
    """Decoding methods of a stack of `num_layers` copies of `layer` (a Repeat's layers, a
    Pipeline's stages) whose caches are stacked on a leading axis; `_scan_in_order(fn,
    carry, xs)` runs `(carry, y_n) = fn(carry, xs[n])` over the copies, one after another."""

    def init_states(self, *, batch_size: int, max_len: int) -> Any:
        """One copy's caches stacked on a leading axis."""
        one = self.layer.init_states(batch_size=batch_size, max_len=max_len)
        num_layers = self.config.num_layers
        return jax.tree_util.tree_map(
            lambda x: jnp.broadcast_to(x, (num_layers, *x.shape)), one
        )

    def extend_step(
        self, cached_states: Any, data: Tensor, *, time_step: Tensor, **kwargs
    ) -> tuple[Any, Tensor]:
        """Decodes data [B,S,D] at time_step through the copies in order."""

        def step(data, layer_states):
            layer_states, data = self.layer.extend_step(
                layer_states, data, time_step=time_step, **kwargs
            )
            return data, layer_states

        data, new_states = self._scan_in_order(step, data, cached_states)
        return new_states, data


class _TransformerRepeat(_StackedDecoding, Repeat):
    """Repeat with the transformer layer's decoding methods (caches stacked per layer)."""

    def _scan_in_order(self, fn, carry, xs):
        return self._run(fn, carry, xs)


class RepeatedTransformerLayer(BaseStackedTransformerLayer):
    """The layers as one scanned child `repeat` (parameters stacked on a leading axis)."""

    @config_class
    class Config(BaseStackedTransformerLayer.Config):
        """Configures RepeatedTransformerLayer."""

        repeat: Repeat.Config = _TransformerRepeat.default_config()

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        if isinstance(cfg.layer, (list, tuple)):
            raise ConfigError(
                f"{self.path()}.layer: repeated layers share one config; to alternate layer "
                "kinds, repeat a StackedTransformerLayer whose `layer` lists them"
            )
        self._add_child(
            "repeat",
            cfg.repeat.clone(
                layer=cfg.layer.clone(input_dim=cfg.input_dim), num_layers=cfg.num_layers
            ),
        )

    def forward(self, data: Tensor, **kwargs) -> Tensor:
        """data [B,T,D] -> [B,T,D]; kwargs (segment_ids, positions, ...) go to every layer."""
        return self.repeat(data, **kwargs)

    def init_states(self, *, batch_size: int, max_len: int) -> Any:
        """The per-layer caches stacked on a leading num_layers axis."""
        return self.repeat.init_states(batch_size=batch_size, max_len=max_len)

    def extend_step(
        self, cached_states: Any, data: Tensor, *, time_step: Tensor, **kwargs
    ) -> tuple[Any, Tensor]:
        return self.repeat.extend_step(cached_states, data, time_step=time_step, **kwargs)


# ----- rematerialization -----


# Primitive names of the forward kernel of jax.nn.dot_product_attention(implementation=
# "cudnn") in jax 0.10 (should a later jax rename them, the kernel is just recomputed).
# Its outputs are the context and the softmax statistics [B,N,T].
_CUDNN_ATTENTION_FORWARD = frozenset(
    {"dot_product_attention_fwd_wrapper", "dot_product_attention_fwd"}
)


@register_configurable
def _save_and_offload_only_these_names_regex(
    names_which_can_be_saved: Optional[str],
    names_which_can_be_offloaded: Optional[str],
    offload_src: str,
    offload_dst: str,
) -> Callable:
    """A remat policy: save names matching one regex, offload the other, recompute the rest.

    When the saved names include the attention context, the cuDNN attention kernel's
    outputs are saved too: its backward needs the softmax statistics next to the
    context, and without them the whole attention forward would run again.
    """
    by_name = utils.save_and_offload_only_these_names_regex(
        names_which_can_be_saved=names_which_can_be_saved,
        names_which_can_be_offloaded=names_which_can_be_offloaded,
        offload_src=offload_src,
        offload_dst=offload_dst,
    )
    saves_context = names_which_can_be_saved is not None and any(
        re.fullmatch(names_which_can_be_saved, f"{klass.__name__}.context")
        for klass in (MultiheadAttention, GroupedQueryAttention)
    )
    if not saves_context:
        return by_name

    def policy(prim, *args, **params):
        if getattr(prim, "name", None) in _CUDNN_ATTENTION_FORWARD:
            return True
        return by_name(prim, *args, **params)

    return policy


def build_remat_spec(
    *,
    names_which_can_be_saved: Optional[str] = ".*([qkvo]_proj|context)",
    names_which_can_be_offloaded: Optional[str] = None,
    offload_src: str = "device",
    offload_dst: str = "pinned_host",
    prevent_cse: bool = False,
) -> dict[str, Any]:
    """A TransformerLayer `remat_spec`: by default save the attention projections and the
    context, recompute everything else (the feed-forward hidden layer)."""
    policy = config_for_function(_save_and_offload_only_these_names_regex).set(
        names_which_can_be_saved=names_which_can_be_saved,
        names_which_can_be_offloaded=names_which_can_be_offloaded,
        offload_src=offload_src,
        offload_dst=offload_dst,
    )
    return {"prevent_cse": prevent_cse, "policy": policy}


def build_save_matmuls_remat_spec(*, prevent_cse: bool = False) -> dict[str, Any]:
    """A TransformerLayer `remat_spec` that saves every matmul's output (each product of
    activations and a weight: the attention projections and the MLP's two inputs), the
    attention context and cuDNN's softmax statistics, and recomputes only the elementwise
    work between them (norms, rotary embedding, the gated activation, residual sums).

    About half the activation memory of no remat for a few percent of the step's time:
    the recomputation costs no matmul and no attention."""
    policy = config_for_function(utils.combine_remat_policies).set(
        policy_1=build_remat_spec()["policy"],
        policy_2=jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    )
    return {"prevent_cse": prevent_cse, "policy": policy}


# ----- pipeline parallelism -----


class _TransformerPipeline(_StackedDecoding, Pipeline):
    """Pipeline whose stage is a transformer stack: data [B,T,D] -> [B,T,D].

    The per-row keyword arguments (segment_ids, positions, ...) travel with their
    microbatch through the stages; the others (None, flags) go to every stage as given.
    """

    def forward(self, data: Tensor, **kwargs) -> Tensor:
        rows = {k: v for k, v in kwargs.items() if isinstance(v, (jax.Array, np.ndarray))}
        fixed = {k: v for k, v in kwargs.items() if k not in rows}

        def stage(carry: dict[str, Tensor]) -> dict[str, Tensor]:
            per_row = {k: carry[k] for k in rows}
            return dict(carry, data=self.layer(carry["data"], **per_row, **fixed))

        return self._run(stage, dict(rows, data=data))["data"]

    def _scan_in_order(self, fn, carry, xs):
        # Decoding runs the stages one after another: a step has nothing to pipeline.
        return self._run_in_sequence(fn, carry, xs)


class PipelinedTransformerLayer(BaseStackedTransformerLayer):
    """The layers split into `num_stages` equal stages, run as a pipeline over the
    'pipeline' mesh axis (axlearn.common.pipeline): stage n holds layers
    n * L/N .. (n + 1) * L/N - 1, its parameters stacked on a leading stage axis."""

    @config_class
    class Config(BaseStackedTransformerLayer.Config):
        """Configures PipelinedTransformerLayer."""

        num_stages: Required[int] = REQUIRED  # Pipeline stages; must divide num_layers.
        num_microbatches: Required[int] = REQUIRED  # Must divide the batch size.
        # One stage: a stack of num_layers / num_stages layers (input_dim, layer and
        # num_layers are filled in).
        stage: BaseLayer.Config = StackedTransformerLayer.default_config().set(layer=None)
        # The pipeline (its schedule: pipeline.schedule); layer, num_layers and
        # num_microbatches are filled in.
        pipeline: Pipeline.Config = _TransformerPipeline.default_config()

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        cfg = self.config
        if not isinstance(cfg.num_stages, int) or cfg.num_stages < 1:
            raise ConfigError(
                f"{self.path()}.num_stages: expected a positive int, got {cfg.num_stages!r}"
            )
        if cfg.num_layers % cfg.num_stages:
            raise ConfigError(
                f"{self.path()}.num_stages={cfg.num_stages} does not divide "
                f"num_layers={cfg.num_layers}"
            )
        if isinstance(cfg.layer, (list, tuple)):
            raise ConfigError(
                f"{self.path()}.layer: the stages share one layer config; to alternate layer "
                "kinds within a stage, set `stage`'s layers"
            )
        stage = cfg.stage.clone(
            input_dim=cfg.input_dim,
            layer=cfg.layer.clone(input_dim=cfg.input_dim),
            num_layers=cfg.num_layers // cfg.num_stages,
        )
        self._add_child(
            "pipeline",
            cfg.pipeline.clone(
                layer=stage, num_layers=cfg.num_stages, num_microbatches=cfg.num_microbatches
            ),
        )

    def forward(self, data: Tensor, **kwargs) -> Tensor:
        """data [B,T,D] -> [B,T,D]; kwargs (segment_ids, positions, ...) go to every layer."""
        return self.pipeline(data, **kwargs)

    def init_states(self, *, batch_size: int, max_len: int) -> Any:
        """The stages' caches, stacked on a leading stage axis."""
        return self.pipeline.init_states(batch_size=batch_size, max_len=max_len)

    def extend_step(
        self, cached_states: Any, data: Tensor, *, time_step: Tensor, **kwargs
    ) -> tuple[Any, Tensor]:
        """Decodes data [B,S,D] at time_step through the stages in order (not pipelined)."""
        return self.pipeline.extend_step(cached_states, data, time_step=time_step, **kwargs)


# ----- attention logit biases (AXLearn's `Decoder.attention_mask` layers) -----


class AttentionLogitBiasLayer(BaseLayer):
    """Base of the layers a Decoder's `attention_mask` names: (segment_ids [B,T],
    positions [B,T]) -> logit biases [B,1|N,T,T] that every self-attention adds to its
    logits (0 where a query may attend, a large negative number where it may not).

    `biases` gives the same for queries and keys at different positions (decoding: the
    new tokens against the whole cache)."""

    def forward(self, *, segment_ids: Tensor, positions: Tensor) -> Tensor:
        same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
        return self.biases(
            query_positions=positions, key_positions=positions, same_segment=same_segment
        )

    def biases(
        self,
        *,
        query_positions: Tensor,
        key_positions: Tensor,
        same_segment: Optional[Tensor] = None,
    ) -> Tensor:
        """query_positions [B,T], key_positions [B,S], same_segment [B,T,S] (None: one
        segment) -> float32 biases [B,1|N,T,S]."""
        raise NotImplementedError(type(self))


class CausalAttentionLogitBiasLayer(AttentionLogitBiasLayer):
    """Each token attends to tokens of its own segment at positions not after its own."""

    def _values(self, query_positions: Tensor, key_positions: Tensor) -> Tensor:
        """[B,1|N,T,S] float32: the biases where attending is allowed."""
        return jnp.zeros((query_positions.shape[0], 1, query_positions.shape[1], 1), jnp.float32)

    def biases(
        self,
        *,
        query_positions: Tensor,
        key_positions: Tensor,
        same_segment: Optional[Tensor] = None,
    ) -> Tensor:
        allowed = query_positions[:, :, None] >= key_positions[:, None, :]
        if same_segment is not None:
            allowed = jnp.logical_and(allowed, same_segment)
        values = self._values(query_positions, key_positions)
        return jnp.where(allowed[:, None], values, _NEG_INF).astype(jnp.float32)


class SlidingWindowAttentionLogitBiasLayer(CausalAttentionLogitBiasLayer):
    """Causal attention within a window: a token attends to tokens of its own segment at
    most `sliding_window_size` positions before its own (itself and that many before, as
    AXLearn's sliding_window_causal_mask; Hugging Face's `sliding_window` counts itself
    too, so it is sliding_window_size + 1)."""

    @config_class
    class Config(CausalAttentionLogitBiasLayer.Config):
        """Configures SlidingWindowAttentionLogitBiasLayer."""

        sliding_window_size: Required[int] = REQUIRED  # Positions before a token it sees.

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        size = cfg.sliding_window_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ConfigError(
                f"{self.path()}.sliding_window_size must be an int >= 0, not {size!r}"
            )

    def biases(
        self,
        *,
        query_positions: Tensor,
        key_positions: Tensor,
        same_segment: Optional[Tensor] = None,
    ) -> Tensor:
        distance = query_positions[:, :, None] - key_positions[:, None, :]
        within = distance <= self.config.sliding_window_size
        same_segment = within if same_segment is None else jnp.logical_and(same_segment, within)
        return super().biases(
            query_positions=query_positions, key_positions=key_positions,
            same_segment=same_segment,
        )


def alibi_get_slopes(num_heads: int) -> list[float]:
    """ALiBi's per-head slopes (https://arxiv.org/abs/2108.12409): for n heads, a power of
    two, the geometric sequence 2^(-8/n), 2^(-16/n), ...; otherwise those of the largest
    power of two below n, then every other slope of twice that power."""

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if num_heads & (num_heads - 1) == 0:
        return power_of_two_slopes(num_heads)
    lower = 1 << (num_heads.bit_length() - 1)
    return power_of_two_slopes(lower) + alibi_get_slopes(2 * lower)[0::2][: num_heads - lower]


class ALiBiAttentionLogitBiasLayer(CausalAttentionLogitBiasLayer):
    """Causal biases plus ALiBi's linear position penalty: head n adds
    slope[n] * (position[key] - position[query]) (<= 0 where allowed) to its logits, in
    place of position embeddings (https://arxiv.org/abs/2108.12409)."""

    @config_class
    class Config(CausalAttentionLogitBiasLayer.Config):
        """Configures ALiBiAttentionLogitBiasLayer."""

        num_heads: Required[int] = REQUIRED  # The attention's query heads, one slope each.

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        if not isinstance(cfg.num_heads, int) or cfg.num_heads < 1:
            raise ConfigError(
                f"{self.path()}.num_heads must be a positive int, not {cfg.num_heads!r}"
            )

    def _values(self, query_positions: Tensor, key_positions: Tensor) -> Tensor:
        slopes = jnp.asarray(alibi_get_slopes(self.config.num_heads), jnp.float32)
        distance = (  # [B,T,S]: key position - query position.
            key_positions[:, None, :].astype(jnp.float32)
            - query_positions[:, :, None].astype(jnp.float32)
        )
        return slopes[None, :, None, None] * distance[:, None]


# ----- sigmoid attention -----


class SigmoidAttention(MultiheadAttention):
    """Attention whose probabilities are sigmoid(logits - log(seq_len)) per key instead of a
    softmax over keys (https://arxiv.org/abs/2409.04431). The -log(seq_len) bias starts each
    query's total weight near softmax's 1 when logits are small; masked keys get 0.

    Always computed on XLA (cuDNN's kernel is softmax-only); decoding works as for
    MultiheadAttention. The input_linear may have fewer key/value heads (grouped queries).
    """

    @config_class
    class Config(MultiheadAttention.Config):
        """Configures SigmoidAttention."""

        seq_len: Required[int] = REQUIRED  # The training sequence length (sets the bias).
        # Whether to subtract log(seq_len) from the logits; False: plain sigmoid(logits).
        subtract_seq_len_bias: bool = True

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        cfg = self.config
        if not isinstance(cfg.seq_len, int) or cfg.seq_len < 1:
            raise ConfigError(
                f"{self.path()}.seq_len must be a positive int, not {cfg.seq_len!r}"
            )
        if cfg.attention_implementation == "cudnn":
            raise ConfigError(
                f"{self.path()}.attention_implementation: 'cudnn' computes a softmax; sigmoid "
                "attention runs on 'xla' (or None)"
            )

    def _check_kv_heads(self, num_kv_heads: int) -> None:
        GroupedQueryAttention._check_kv_heads(self, num_kv_heads)

    def _use_cudnn(self, q: Tensor, k: Tensor, *, decoding: bool = False) -> bool:
        return False

    def _probs(self, logits: Tensor) -> Tensor:
        cfg = self.config
        if cfg.subtract_seq_len_bias:
            logits = logits - math.log(cfg.seq_len)
        return jax.nn.sigmoid(logits)
