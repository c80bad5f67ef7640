"""Basic layers: linear maps, embeddings, normalization, dropout and activations.

Every layer here works on the last axis of its input and leaves leading axes (batch,
time, ...) alone, so the same config serves 2-D and 3-D inputs. Parameter names are
part of the interface: optimizers and initializers select parameters by path regexes
such as `.*feed_forward/linear2/weight`.
"""

import functools
import math
from collections.abc import Callable, Sequence
from typing import Optional, Union

import jax
import jax.numpy as jnp

from axlearn.common.base_layer import (
    BaseLayer,
    MeshAxes,
    ParameterSpec,
    QuantizedWeight,
    WeightWithCopy,
    weight_einsum,
    weight_take,
)
from axlearn.common.config import REQUIRED, ConfigError, Required, config_class
from axlearn.common.fp8 import Fp8Matmul
from axlearn.common.kernels.dispatch import interpret_flag, kernel_mode, several_devices
from axlearn.common.kernels.gated_product import (
    gated_product_supported,
    sharded_gated_product_backward,
)
from axlearn.common.kernels.rms_norm import (
    rms_norm_forward,
    rms_norm_forward_supported,
    rms_norm_supported,
    sharded_rms_norm_backward,
)
from axlearn.common.module import Tensor
from axlearn.common.param_init import FanAxes, constant_initializer
from axlearn.common.sharding import maybe_shard

# ----- activations -----


def _squared_relu(x: Tensor) -> Tensor:
    return jnp.square(jax.nn.relu(x))


def _quick_gelu(x: Tensor) -> Tensor:
    # The sigmoid approximation of GELU used by CLIP.
    return x * jax.nn.sigmoid(1.702 * x)


_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "linear": lambda x: x,
    "nn.relu": jax.nn.relu,
    "nn.silu": jax.nn.silu,
    "nn.gelu": lambda x: jax.nn.gelu(x, approximate=True),
    "exact_gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "quick_gelu": _quick_gelu,
    "squared_relu": _squared_relu,
    "nn.tanh": jnp.tanh,
    "nn.sigmoid": jax.nn.sigmoid,
}


# The activations whose derivatives the Triton kernel computes (erf does not lower).
_KERNEL_ACTIVATIONS = frozenset(
    _ACTIVATIONS[name]
    for name in ("linear", "nn.relu", "nn.silu", "nn.gelu", "quick_gelu", "squared_relu", "nn.sigmoid")
)


def get_activation_fn(name: str) -> Callable[[Tensor], Tensor]:
    """The elementwise activation called `name` (e.g. 'nn.silu', 'linear')."""
    if name not in _ACTIVATIONS:
        raise ConfigError(f"Unknown activation '{name}'; expected one of {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 4))
def gated_product(
    act0: Callable, act1: Callable, a: Tensor, b: Tensor, partition_spec: Optional[MeshAxes] = None
) -> Tensor:
    """act0(a) * act1(b) for elementwise activations (a gated MLP's hidden units).

    Its backward pass is one expression for both cotangents; autodiff leaves two that
    each re-read the [tokens, hidden] inputs. On GPU, with activations the Triton kernel
    can differentiate, it is `kernels.gated_product.gated_product_backward`, one pass over
    a, b and the cotangent (inside a train step XLA would split the expression into two
    kernels). `partition_spec`, how a and b are split over the mesh, lets the kernel run
    per device on a mesh of several.
    """
    return act0(a) * act1(b)


def _gated_product_fwd(act0, act1, a, b, partition_spec):
    del partition_spec
    return act0(a) * act1(b), (a, b)


def _gated_product_bwd(act0, act1, partition_spec, residuals, dh):
    a, b = residuals
    interpret = None
    if {act0, act1} <= _KERNEL_ACTIVATIONS and a.shape == b.shape == dh.shape:
        interpret = kernel_mode(a, partition_spec, fits=gated_product_supported)
    if interpret is not None:
        return sharded_gated_product_backward(
            functools.partial(gated_product_cotangents, act0, act1), a, b, dh,
            partition_spec=partition_spec, interpret=interpret,
        )
    da, db = gated_product_cotangents(act0, act1, a, b, dh)
    return da.astype(a.dtype), db.astype(b.dtype)


def gated_product_cotangents(
    act0: Callable, act1: Callable, a: Tensor, b: Tensor, dh: Tensor
) -> tuple[Tensor, Tensor]:
    """(da, db) of act0(a) * act1(b) for the cotangent dh, as one elementwise expression."""
    # Elementwise activations: the JVP with a tangent of ones is the derivative.
    h0, d0 = jax.jvp(act0, (a,), (jnp.ones_like(a),))
    h1, d1 = jax.jvp(act1, (b,), (jnp.ones_like(b),))
    return dh * h1 * d0, dh * h0 * d1


gated_product.defvjp(_gated_product_fwd, _gated_product_bwd)


def residual_add(x: Tensor, branch: Tensor, *, is_training: bool) -> Tensor:
    """x + branch; in training, with the branch kept out of its producer's matmul.

    Left alone, XLA folds the add into the cuBLAS call that computes the branch (C = x,
    beta = 1) and writes the sum over x's buffer; x is still needed for the backward
    pass, so it first copies x: one extra read and write of the residual stream per
    residual. Without a backward pass (decoding) the add may join the branch's last
    kernel, one launch fewer a residual.
    """
    return x + (jax.lax.optimization_barrier(branch) if is_training else branch)


# ----- linear maps -----


class Linear(BaseLayer):
    """y = x @ weight + bias over the last axis; weight is [input_dim, output_dim]."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures Linear."""

        input_dim: Required[int] = REQUIRED
        output_dim: Required[int] = REQUIRED
        bias: bool = True
        # Sharding constraint on the output (one entry per output dim), e.g.
        # (('data', 'fsdp'), 'seq', 'model'); None: leave it to the partitioner.
        output_partition_spec: Optional[MeshAxes] = None
        # The product in FP8 (child `fp8`, with its scaling state); None: in the input's dtype.
        fp8: Optional[Fp8Matmul.Config] = None

    def __init__(self, cfg: Config, *, parent):
        super().__init__(cfg, parent=parent)
        if cfg.fp8 is not None:
            self._add_child("fp8", cfg.fp8)

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self.config
        specs = dict(
            weight=ParameterSpec(
                shape=(cfg.input_dim, cfg.output_dim),
                mesh_axes=cfg.param_partition_spec,
                fan_axes=FanAxes(in_axis=-2, out_axis=-1),
            )
        )
        if cfg.bias:
            out_axis = cfg.param_partition_spec[-1] if cfg.param_partition_spec else None
            specs["bias"] = ParameterSpec(
                shape=[cfg.output_dim],
                mesh_axes=(out_axis,),
                initializer=constant_initializer(0.0),
            )
        return specs

    def forward(self, x: Tensor) -> Tensor:
        cfg = self.config
        matmul = self.fp8.einsum if cfg.fp8 is not None else weight_einsum
        y = matmul(
            "...i,io->...o", x, self.parameters["weight"], partition_spec=cfg.param_partition_spec
        )
        if cfg.bias:
            y = y + self.parameters["bias"]
        return maybe_shard(y, cfg.output_partition_spec)


class Embedding(BaseLayer):
    """A lookup table [num_embeddings, dim]; `attend` maps back to logits (tied heads)."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures Embedding."""

        num_embeddings: Required[int] = REQUIRED  # Vocabulary size.
        dim: Required[int] = REQUIRED
        # Sharding constraints, as AXLearn's (None: none): on the ids, on the table as the
        # lookup reads it (e.g. vocab-parallel), and on the looked-up vectors.
        input_partition_spec: Optional[MeshAxes] = None
        embedding_partition_spec: Optional[MeshAxes] = None
        output_partition_spec: Optional[MeshAxes] = None

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self.config
        return dict(
            weight=ParameterSpec(
                shape=[cfg.num_embeddings, cfg.dim],
                mesh_axes=cfg.param_partition_spec,
                # A row is one token's vector: fan_out = dim gives unit-variance logits
                # when the table is reused as the output layer.
                fan_axes=FanAxes(in_axis=-2, out_axis=-1),
            )
        )

    def forward(self, ids: Tensor) -> Tensor:
        """[...] int ids -> [..., dim]."""
        cfg = self.config
        ids = maybe_shard(ids, cfg.input_partition_spec)
        weight = self.parameters["weight"]
        if cfg.embedding_partition_spec is not None:
            weight = jax.tree_util.tree_map(
                lambda w: maybe_shard(w, cfg.embedding_partition_spec), weight
            )
        return maybe_shard(self._rows(weight, ids), cfg.output_partition_spec)

    def _rows(self, weight: Union[Tensor, WeightWithCopy], ids: Tensor) -> Tensor:
        """The rows `ids` of the table `weight`."""
        return weight_take(weight, ids)

    def attend(self, x: Tensor) -> Tensor:
        """[..., dim] -> [..., num_embeddings] = x @ weight.T."""
        return weight_einsum(
            "...d,vd->...v", x, self.parameters["weight"],
            partition_spec=self.config.param_partition_spec,
        )


class OneHotGradEmbedding(Embedding):
    """An Embedding whose table gradient is a matmul, one_hot(ids)^T @ dy, in place of a
    scatter-add. On a GPU the scatter's atomic adds serialize on frequent tokens, which
    real text has and random tokens lack; with a small vocabulary the matmul costs little
    (2 * vocab * dim flops a token). The forward pass is the same row lookup."""

    def _rows(self, weight: Union[Tensor, WeightWithCopy], ids: Tensor) -> Tensor:
        if isinstance(weight, QuantizedWeight):  # Decoding: no gradient to shape.
            return weight_take(weight, ids)
        if isinstance(weight, WeightWithCopy):
            return _take_with_one_hot_grad(ids, weight.weight, weight.copy)
        return _take_with_one_hot_grad(ids, weight, weight)


@jax.custom_vjp
def _take_with_one_hot_grad(ids: Tensor, weight: Tensor, table: Tensor) -> Tensor:
    """Rows `ids` of `table`; the gradient goes to `weight` (the table's master copy, or
    the table itself), summed in its dtype."""
    del weight
    return jnp.take(table, ids, axis=0)


def _take_with_one_hot_grad_fwd(ids, weight, table):
    # The weight's dtype as a zero-size array: the residuals hold no second table.
    return jnp.take(table, ids, axis=0), (ids, table.shape, jnp.zeros((0,), weight.dtype))


def _take_with_one_hot_grad_bwd(residuals, dy):
    ids, shape, weight_dtype = residuals
    rows = dy.reshape(-1, shape[1])
    # Ids outside the table have an all-zero row: no gradient, as jnp.take's transpose.
    one_hot = jax.nn.one_hot(ids.reshape(-1), shape[0], dtype=rows.dtype)
    dw = jnp.einsum("nv,nd->vd", one_hot, rows, preferred_element_type=weight_dtype.dtype)
    return None, dw, None


_take_with_one_hot_grad.defvjp(_take_with_one_hot_grad_fwd, _take_with_one_hot_grad_bwd)


# ----- normalization -----


class BaseNormalizationLayer(BaseLayer):
    """Normalizes over the last axis, of size `input_dim`."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures BaseNormalizationLayer."""

        input_dim: Required[int] = REQUIRED  # Size of the normalized (last) axis.
        eps: float = 1e-8  # Added to the variance before rsqrt.
        # Dtype of the statistics; None: the input's dtype.
        forward_dtype: Optional[jnp.dtype] = jnp.float32
        # Sharding constraints on the input and the normalized output, as AXLearn's (e.g.
        # sequence-parallel inputs, gathered outputs); None: none.
        input_partition_spec: Optional[MeshAxes] = None
        output_partition_spec: Optional[MeshAxes] = None

    def _shard_input(self, x: Tensor) -> Tensor:
        return maybe_shard(x, self.config.input_partition_spec)

    def _shard_output(self, y: Tensor) -> Tensor:
        return maybe_shard(y, self.config.output_partition_spec)

    def _scale_spec(self, value: float) -> ParameterSpec:
        return ParameterSpec(
            shape=[self.config.input_dim],
            mesh_axes=(None,),
            initializer=constant_initializer(value),
        )

    def residual_and_norm(
        self, x: Tensor, *, partition_spec: Optional[MeshAxes] = None, consumers: int = 1
    ) -> tuple[Tensor, ...]:
        """(x, self(x), ...) for a pre-norm block x + f(self(x)): x, then the normalized x
        once for each of f's `consumers` (layers that read it). The block must take its
        residual from the first output and give each consumer its own copy.
        `partition_spec`: how x is split over the mesh, if known.

        Some norms (`RMSNorm` on GPU) then take the residual's and the consumers'
        gradients into their own backward pass, where autodiff would sum them in others.
        """
        del partition_spec
        return (x,) + (self.forward(x),) * consumers


def inverse_rms(x: Tensor, eps: float) -> Tensor:
    """rsqrt(mean(x^2) + eps) over x's last axis, in x's dtype, kept as an axis of 1."""
    return jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def _rms_norm(x: Tensor, scale: Tensor, eps: float, forward_dtype: Optional[jnp.dtype]) -> Tensor:
    y = x.astype(forward_dtype or x.dtype)
    y = y * inverse_rms(y, eps)
    return (y * scale).astype(x.dtype)


def _residual_and_rms_norm(
    x: Tensor, scale: Tensor, eps: float, forward_dtype: Optional[jnp.dtype], consumers: int
) -> tuple[Tensor, ...]:
    """(x, RMSNorm(x), ...): x, then the normalized x once for each of `consumers`."""
    return (x,) + (_rms_norm(x, scale, eps, forward_dtype),) * consumers


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def rms_norm_with_residual(
    x: Tensor,
    scale: Tensor,
    eps: float,
    forward_dtype: Optional[jnp.dtype],
    consumers: int,
    partition_spec: Optional[MeshAxes],
    interpret: bool,
) -> tuple[Tensor, ...]:
    """(x, RMSNorm(x), ...) as `BaseNormalizationLayer.residual_and_norm`, whose backward
    pass is `kernels.rms_norm.rms_norm_backward`: the cotangents of every output are summed
    in the pass that computes the norm's gradient, which reads each of them and x once
    (`interpret` as `kernels.dispatch.kernel_mode` returns it)."""
    del partition_spec, interpret
    return _residual_and_rms_norm(x, scale, eps, forward_dtype, consumers)


def _rms_norm_with_residual_fwd(x, scale, eps, forward_dtype, consumers, partition_spec, interpret):
    del partition_spec, interpret
    return _residual_and_rms_norm(x, scale, eps, forward_dtype, consumers), (x, scale)


def _rms_norm_with_residual_bwd(
    eps, forward_dtype, consumers, partition_spec, interpret, residuals, cotangents
):
    del forward_dtype, consumers  # The kernel works in float32 whatever the forward's dtype.
    x, scale = residuals
    dresidual, *dys = (t.astype(x.dtype) for t in cotangents)
    return sharded_rms_norm_backward(
        x, scale, dys, dresidual, eps=eps, partition_spec=partition_spec, interpret=interpret
    )


rms_norm_with_residual.defvjp(_rms_norm_with_residual_fwd, _rms_norm_with_residual_bwd)


class RMSNorm(BaseNormalizationLayer):
    """Root-mean-square normalization: x / sqrt(mean(x^2) + eps) * scale."""

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        return dict(scale=self._scale_spec(1.0))

    def forward(self, x: Tensor) -> Tensor:
        cfg = self.config
        x = self._shard_input(x)
        interpret = self._forward_kernel_mode(x)
        if interpret is not None:
            y = rms_norm_forward(x, self.parameters["scale"], eps=cfg.eps, interpret=interpret)
        else:
            y = _rms_norm(x, self.parameters["scale"], cfg.eps, cfg.forward_dtype)
        return self._shard_output(y)

    def unfinished(self, x: Tensor) -> Optional[Tensor]:
        """x * scale, the norm short of its division by x's RMS, where a decoding step may
        finish it after a linear map W: RMSNorm(x) @ W = (x * scale) @ W * inverse_rms(x) (in
        float32), the statistic then computed in a kernel the step runs anyway (the residual
        add's, the attention's) rather than in one of its own. None where `forward` would not
        take its kernel (training, many rows, several devices)."""
        if self._forward_kernel_mode(x) is None:
            return None
        return (x.astype(jnp.float32) * self.parameters["scale"].astype(jnp.float32)).astype(
            x.dtype
        )

    def _forward_kernel_mode(self, x: Tensor) -> Optional[bool]:
        """The `interpret` flag of `rms_norm_forward` where a forward pass takes it (outside
        training, a decoding step's few rows in float32 on one device), else None."""
        if (
            self.is_training
            or jnp.dtype(self.config.forward_dtype or x.dtype) != jnp.float32
            or several_devices()
            or not rms_norm_forward_supported(x.shape)
        ):
            return None
        return interpret_flag()

    def residual_and_norm(
        self, x: Tensor, *, partition_spec: Optional[MeshAxes] = None, consumers: int = 1
    ) -> tuple[Tensor, ...]:
        """See `BaseNormalizationLayer.residual_and_norm`; on GPU the backward is one kernel."""
        cfg = self.config

        def whole_rows(block: Sequence[int]) -> bool:
            # Each device must hold whole rows: the norm sums over the last axis.
            return block[-1] == x.shape[-1] and rms_norm_supported(block)

        x = self._shard_input(x)
        if self._forward_kernel_mode(x) is not None:  # Decoding: nothing to differentiate.
            return (x,) + (self.forward(x),) * consumers
        interpret = kernel_mode(x, partition_spec, fits=whole_rows)
        scale = self.parameters["scale"]
        if interpret is None:
            outputs = _residual_and_rms_norm(x, scale, cfg.eps, cfg.forward_dtype, consumers)
        else:
            outputs = rms_norm_with_residual(
                x, scale, cfg.eps, cfg.forward_dtype, consumers, partition_spec, interpret
            )
        return (outputs[0],) + tuple(self._shard_output(y) for y in outputs[1:])


class LayerNorm(BaseNormalizationLayer):
    """(x - mean) / sqrt(var + eps) * scale + bias."""

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        return dict(scale=self._scale_spec(1.0), bias=self._scale_spec(0.0))

    def forward(self, x: Tensor) -> Tensor:
        cfg = self.config
        x = self._shard_input(x)
        y = x.astype(cfg.forward_dtype or x.dtype)
        y = y - jnp.mean(y, axis=-1, keepdims=True)
        y = y * jax.lax.rsqrt(jnp.mean(jnp.square(y), axis=-1, keepdims=True) + cfg.eps)
        y = (y * self.parameters["scale"] + self.parameters["bias"]).astype(x.dtype)
        return self._shard_output(y)


# ----- regularization -----


def _check_rate(layer: BaseLayer, rate: Optional[float]) -> None:
    if rate is not None and not 0.0 <= rate < 1.0:
        raise ConfigError(f"{layer.path()}.rate: {rate} is not in [0, 1)")


class Dropout(BaseLayer):
    """Zeroes each element with probability `rate` while training (scaling the rest)."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures Dropout."""

        rate: Optional[float] = None  # None or 0: no dropout.

    def __init__(self, cfg: Config, *, parent):
        super().__init__(cfg, parent=parent)
        _check_rate(self, cfg.rate)

    def forward(self, x: Tensor) -> Tensor:
        rate = self.config.rate
        if not self.is_training or not rate:
            return x
        keep = jax.random.bernoulli(self.prng_key, 1.0 - rate, x.shape)
        return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


class StochasticDepth(BaseLayer):
    """Drops a whole residual branch with probability `rate` while training.

    mode 'row' draws one decision per example (leading axis), 'batch' one for the batch.
    """

    @config_class
    class Config(BaseLayer.Config):
        """Configures StochasticDepth."""

        rate: Optional[float] = None  # None or 0: never drop.
        mode: str = "row"  # 'row' or 'batch'.

    def __init__(self, cfg: Config, *, parent):
        super().__init__(cfg, parent=parent)
        _check_rate(self, cfg.rate)
        if cfg.mode not in ("row", "batch"):
            raise ConfigError(f"{self.path()}.mode: '{cfg.mode}' is not 'row' or 'batch'")

    def forward(self, x: Tensor) -> Tensor:
        cfg = self.config
        if not self.is_training or not cfg.rate:
            return x
        if cfg.mode == "row":
            shape = (x.shape[0],) + (1,) * (x.ndim - 1)
        else:
            shape = (1,) * x.ndim
        keep_prob = 1.0 - cfg.rate
        keep = jax.random.bernoulli(self.prng_key, keep_prob, shape)
        return jnp.where(keep, x / keep_prob, jnp.zeros_like(x))


def rms(x: Tensor) -> Tensor:
    """sqrt(mean(x^2)) over all elements, in float32 (for summaries)."""
    x = x.astype(jnp.float32)
    return jnp.sqrt(jnp.mean(jnp.square(x)))


def scaled_hidden_dim(scale: float, round_up_to_multiples_of: int = 1) -> Callable[[int], int]:
    """A hidden_dim rule: `input_dim * scale`, rounded up to a multiple (feed-forward sizes)."""

    def fn(input_dim: int) -> int:
        size = math.ceil(input_dim * scale)
        return -(-size // round_up_to_multiples_of) * round_up_to_multiples_of

    return fn
