"""FP8 matrix products: e4m3 operands in the forward pass, e5m2 gradients in the backward.

A product x @ w through `Fp8Matmul.einsum` casts x and w to float8_e4m3fn (3 mantissa
bits, |values| up to 448) after dividing each by a scale, and the backward pass casts the
output's gradient dy to float8_e5m2 (2 mantissa bits, up to 57344) the same way. Each
operand is turned back into the train dtype and multiplied by its scale right before its
dot: XLA's GPU compiler rewrites `dot(convert(f8) * scale, convert(f8) * scale)` into one
cuBLASLt FP8 GEMM that applies the scales itself (H100/H200 tensor cores, twice the bf16
peak). Elsewhere (a CPU) the same program runs the dot in the train dtype, on the values
FP8 can hold. The float32 master weights, the optimizer and everything outside the
products are unchanged.

Scales are powers of two, the smallest that bring a tensor's largest magnitude (its
amax) within the format's range: scaling is then exact in any float format and only the
cast to FP8 rounds. Where a scale comes from:

- delayed scaling (`amax_history_length` > 0): from the largest amax among the last
  `amax_history_length` steps, kept per tensor as state (`*_amax_history`, most recent
  first). A cast then depends on nothing computed in the same step, so XLA fuses it into
  the op that produces the tensor; the step's own amax is reduced beside it and pushed
  onto the history. The histories are parameters of the layer that no optimizer touches:
  the backward pass returns each new history as its "gradient", and
  `fp8_learner.Fp8Learner` writes it. A fresh history (all zeros) scales by 1, so the first
  step's small gradients mostly round to zero in e5m2.
- current scaling (`amax_history_length` == 0): from the tensor itself, reduced right
  before its cast. No state; each cast waits for its reduction.

An amax is that of the whole tensor, over every device of the mesh (XLA reduces the
shards' maxima), so a sharded run casts as a run on one device does.

A checkpoint saved without delayed scaling (a bf16 run) holds no histories: a run that
switches to FP8 resumes from it with the saved weights and fresh (zero) histories
(`restore_with_fresh_scaling_state`), as a fresh FP8 run starts.
"""

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp

from axlearn.common.base_layer import BaseLayer, MeshAxes, ParameterSpec, WeightWithCopy
from axlearn.common.config import ConfigError, config_class
from axlearn.common.module import Module, Tensor
from axlearn.common.param_init import constant_initializer
from axlearn.common.sharding import gathered_for_matmul
from axlearn.common.utils import flatten_with_paths, tree_paths

# The forward pass's operands: more precision. The gradients: more range.
FORWARD_DTYPE = jnp.float8_e4m3fn
GRADIENT_DTYPE = jnp.float8_e5m2

# The history length of delayed scaling, the default scaling, unless a config says otherwise.
DEFAULT_AMAX_HISTORY_LENGTH = 128

# Scales stay within 2**-100 .. 2**100: their reciprocals then exist in bf16 too, and a
# tensor whose amax lies outside is zero or broken anyway.
_MAX_SCALE_EXPONENT = 100

# The parameter names of the delayed-scaling state, and a regex of their paths.
AMAX_HISTORY_NAMES = ("input_amax_history", "weight_amax_history", "output_grad_amax_history")
STATE_REGEX = ".*/(" + "|".join(AMAX_HISTORY_NAMES) + ")"


# ----- scaling -----


def amax(x: Tensor) -> Tensor:
    """The largest magnitude of `x`, as a float32 scalar."""
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def scale_for_amax(tensor_amax: Tensor, dtype: jnp.dtype) -> Tensor:
    """The smallest power of two s with tensor_amax / s <= the largest value of `dtype`
    (float32 scalar); 1 where the amax is zero or not finite."""
    ratio = tensor_amax.astype(jnp.float32) / float(jnp.finfo(dtype).max)
    mantissa, exponent = jnp.frexp(ratio)  # ratio = mantissa * 2**exponent, mantissa in [0.5, 1).
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)  # ratio is a power of two.
    exponent = jnp.clip(exponent, -_MAX_SCALE_EXPONENT, _MAX_SCALE_EXPONENT)
    scale = jnp.ldexp(jnp.float32(1.0), exponent)
    usable = (tensor_amax > 0) & jnp.isfinite(tensor_amax)
    return jnp.where(usable, scale, jnp.float32(1.0))


def scale_for_history(history: Tensor, dtype: jnp.dtype) -> Tensor:
    """The delayed-scaling scale: `scale_for_amax` of the largest amax in `history`."""
    return scale_for_amax(jnp.max(history).astype(jnp.float32), dtype)


def push_amax(history: Tensor, tensor_amax: Tensor) -> Tensor:
    """`history` with `tensor_amax` in front and its oldest entry dropped."""
    return jnp.concatenate([tensor_amax.astype(history.dtype)[None], history[:-1]])


def quantize(x: Tensor, scale: Tensor, dtype: jnp.dtype) -> Tensor:
    """x / scale in FP8 `dtype`, saturated at the format's largest value (e4m3 has no
    infinity: beyond it a cast gives NaN)."""
    largest = float(jnp.finfo(dtype).max)
    scaled = x * (1.0 / scale).astype(x.dtype)  # Exact: the scale is a power of two.
    return jnp.clip(scaled, -largest, largest).astype(dtype)


def dequantize(q: Tensor, scale: Tensor, dtype: jnp.dtype) -> Tensor:
    """q * scale in `dtype`: the form XLA folds into an FP8 GEMM as the operand's scale."""
    return q.astype(dtype) * scale.astype(dtype)


# ----- the product -----


class AmaxHistories(NamedTuple):
    """The delayed-scaling state of one product: an amax history per cast tensor."""

    input: Tensor  # x's, in the forward pass.
    weight: Tensor  # w's, in the forward pass.
    output_grad: Tensor  # dy's, in the backward pass.


def _split_spec(spec: str) -> tuple[str, str, str]:
    """'x_axes,w_axes->out_axes' -> (x_axes, w_axes, out_axes)."""
    inputs, out_axes = spec.split("->")
    x_axes, w_axes = inputs.split(",")
    return x_axes, w_axes, out_axes


def _forward_scales(x: Tensor, w: Tensor, histories: Optional[AmaxHistories]):
    """(x's scale, w's scale) for the forward casts."""
    if histories is None:
        return scale_for_amax(amax(x), FORWARD_DTYPE), scale_for_amax(amax(w), FORWARD_DTYPE)
    return (
        scale_for_history(histories.input, FORWARD_DTYPE),
        scale_for_history(histories.weight, FORWARD_DTYPE),
    )


def _forward(spec, partition_spec, x, weight_value, histories):
    """y and the cast operands with their scales."""
    x_scale, w_scale = _forward_scales(x, weight_value, histories)
    xq = quantize(x, x_scale, FORWARD_DTYPE)
    # On meshes that need the weight gathered first, the 1-byte copy is what moves.
    wq = gathered_for_matmul(quantize(weight_value, w_scale, FORWARD_DTYPE), partition_spec)
    y = jnp.einsum(spec, dequantize(xq, x_scale, x.dtype), dequantize(wq, w_scale, x.dtype))
    return y, (xq, wq, x_scale, w_scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fp8_einsum(
    spec: str,
    partition_spec: Optional[MeshAxes],
    x: Tensor,
    weight: Tensor,
    weight_value: Tensor,
    histories: Optional[AmaxHistories],
) -> Tensor:
    """einsum(spec, x, weight_value) in FP8; `weight` receives the weight's gradient in
    its own dtype (it is `weight_value` itself, or the float32 weight beside its copy);
    each history in `histories` receives its new value as its gradient."""
    del weight
    return _forward(spec, partition_spec, x, weight_value, histories)[0]


def _fp8_einsum_fwd(spec, partition_spec, x, weight, weight_value, histories):
    y, (xq, wq, x_scale, w_scale) = _forward(spec, partition_spec, x, weight_value, histories)
    new_histories = None
    if histories is not None:
        new_histories = (
            push_amax(histories.input, amax(x)),
            push_amax(histories.weight, amax(weight_value)),
            histories.output_grad,  # Pushed in the backward pass, once dy is known.
        )
    # Dtypes as zero-size arrays (residuals must be arrays).
    dtypes = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), weight.dtype))
    return y, (xq, wq, x_scale, w_scale, new_histories, dtypes)


def _fp8_einsum_bwd(spec, partition_spec, residuals, dy):
    del partition_spec
    xq, wq, x_scale, w_scale, new_histories, (x_dtype, weight_dtype) = residuals
    x_axes, w_axes, out_axes = _split_spec(spec)
    if new_histories is None:
        dy_scale = scale_for_amax(amax(dy), GRADIENT_DTYPE)
        history_grads = None
    else:
        input_history, weight_history, dy_history = new_histories
        dy_scale = scale_for_history(dy_history, GRADIENT_DTYPE)
        history_grads = AmaxHistories(
            input_history, weight_history, push_amax(dy_history, amax(dy))
        )
    dyd = dequantize(quantize(dy, dy_scale, GRADIENT_DTYPE), dy_scale, dy.dtype)
    dx = jnp.einsum(f"{out_axes},{w_axes}->{x_axes}", dyd, dequantize(wq, w_scale, dy.dtype))
    dw = jnp.einsum(
        f"{x_axes},{out_axes}->{w_axes}",
        dequantize(xq, x_scale, dy.dtype),
        dyd,
        preferred_element_type=weight_dtype.dtype,
    )
    return dx.astype(x_dtype.dtype), dw, None, history_grads


_fp8_einsum.defvjp(_fp8_einsum_fwd, _fp8_einsum_bwd)


def fp8_einsum(
    spec: str,
    x: Tensor,
    weight: Union[Tensor, WeightWithCopy],
    *,
    histories: Optional[AmaxHistories] = None,
    partition_spec: Optional[MeshAxes] = None,
) -> Tensor:
    """jnp.einsum(spec, x, weight) with FP8 operands and gradients, in x's dtype.

    spec reads 'x_axes,weight_axes->output_axes' as for `base_layer.weight_einsum`, whose
    other arguments this takes too: `weight` may be a `WeightWithCopy` (the copy is cast,
    the weight gets its gradient in its own dtype), and `partition_spec` is the weight's.
    `histories`: delayed scaling's state; None: current scaling.
    """
    if isinstance(weight, WeightWithCopy):
        weight, value = weight.weight, weight.copy
    else:
        value = weight
    return _fp8_einsum(spec, partition_spec, x, weight, value, histories)


# ----- the layer -----


class Fp8Matmul(BaseLayer):
    """The FP8 product of a matmul layer (its child `fp8`), with its scaling state.

    `layers.Linear` and the attention projections call `einsum` in place of
    `base_layer.weight_einsum` when their `fp8` field is set
    (`trainer_config_modifier.FP8ConfigModifier` sets it).
    """

    @config_class
    class Config(BaseLayer.Config):
        """Configures Fp8Matmul."""

        # > 0: delayed scaling, each tensor's scale from its amaxes of this many past steps
        # (state: three histories of this length, written by `fp8_learner.Fp8Learner`).
        # 0: current scaling, each scale from the tensor itself (no state).
        amax_history_length: int = DEFAULT_AMAX_HISTORY_LENGTH

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        length = cfg.amax_history_length
        if not isinstance(length, int) or isinstance(length, bool) or length < 0:
            raise ConfigError(
                f"{self.path()}.amax_history_length must be an int >= 0 (0: current "
                f"scaling), got {length!r}"
            )

    @property
    def delayed(self) -> bool:
        """Whether scales come from amax histories (delayed scaling)."""
        return self.config.amax_history_length > 0

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        if not self.delayed:
            return {}
        spec = ParameterSpec(
            shape=[self.config.amax_history_length],
            dtype=jnp.float32,
            mesh_axes=(None,),
            initializer=constant_initializer(0.0),
            weight_decay_scale=0.0,
        )
        return {name: spec for name in AMAX_HISTORY_NAMES}

    def einsum(
        self,
        spec: str,
        x: Tensor,
        weight: Union[Tensor, WeightWithCopy],
        *,
        partition_spec: Optional[MeshAxes] = None,
    ) -> Tensor:
        """`fp8_einsum` with this layer's scaling (see there for the arguments)."""
        histories = None
        if self.delayed:
            histories = AmaxHistories(*(self.parameters[name] for name in AMAX_HISTORY_NAMES))
        return fp8_einsum(spec, x, weight, histories=histories, partition_spec=partition_spec)


# ----- resuming from a checkpoint without scaling state -----


def is_scaling_state(path: str) -> bool:
    """Whether the '/'-joined state path `path` is delayed-scaling state (a history, or
    anything a learner keeps for one)."""
    return re.fullmatch(STATE_REGEX, path) is not None


def restore_with_fresh_scaling_state(
    restore: Callable[[Any], tuple[Optional[int], Any, Any]],
    template: Any,
    fresh: Callable[[Sequence[str]], dict[str, Any]],
) -> tuple[Optional[int], Any, Any]:
    """`restore(template)` -> (step, state, extra), the checkpointer's restore into a state
    template; where that fails because the checkpoint holds none of the template's scaling
    state (it was saved without FP8 delayed scaling) but everything else, the rest is
    restored and the scaling state is `fresh(paths)`: {path: value} for the template's
    scaling-state paths (their initial values). Any other mismatch raises the full
    restore's error.
    """
    try:
        return restore(template)
    except ValueError as error:
        paths = [path for path, _ in flatten_with_paths(template) if is_scaling_state(path)]
        if not paths:
            raise
        stateless = jax.tree.map(
            lambda path, leaf: None if is_scaling_state(path) else leaf,
            tree_paths(template),
            template,
        )
        try:
            step, restored, extra = restore(stateless)
        except ValueError:
            raise error from None
    values = {**dict(flatten_with_paths(restored)), **fresh(paths)}
    state = jax.tree.map(lambda path, _: values[path], tree_paths(template), template)
    return step, state, extra

