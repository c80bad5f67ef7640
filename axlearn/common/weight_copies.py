"""Carried and split weights: how a trainer's weights travel from one step to the next.

A trainer with a `train_dtype` casts its float32 weights to that dtype for every forward
and backward. Two options of `SpmdTrainer.Config` change what a step carries instead:

- `carry_train_dtype_weights`: each weight (a parameter of a matrix product or an
  embedding: one with fan axes) also travels as its train_dtype copy, written by the
  update that writes the weight; the next step reads the copy instead of casting again.
- `split_carried_weights`: each such weight travels only as its bfloat16 copy and the 16
  bits below it (`split_float`), 4 bytes instead of 6; the float32 weight is joined from
  the halves where it is needed (the update, evaluation, checkpoints).

`WeightCopies` holds the parameter specs and those options, and does the few things the
trainer needs: make the carried parts from float32 parameters (`carry`), join them back
(`join`), and give the model its train_dtype parameters (`train_dtype_params`).
Checkpoints always hold the float32 parameters: copies are derived, never saved.
"""

from typing import Any, Optional

import jax
import jax.numpy as jnp

from axlearn.common.base_layer import ParameterSpec, cast_floats_with_copies, is_parameter_spec
from axlearn.common.config import ConfigError
from axlearn.common.split_float import join_float32, split_float32
from axlearn.common.utils import cast_floats, flatten_with_paths


def uses_float32_weight_grads(num_microbatches: int, num_devices: int) -> bool:
    """Whether a step gives its weights their gradients in float32 out of the matmuls.

    Only where it pays: a step that sums several microbatches' gradients, on one device.
    The learner's float32 sum then folds into each weight-gradient matmul instead of
    taking a pass of its own. On several devices each microbatch's weight gradients are
    reduced across them, and in float32 that moves twice the bytes of bf16.
    """
    return num_microbatches > 1 and num_devices == 1


class WeightCopies:
    """The carried train_dtype copies (and split halves) of a model's weights."""

    def __init__(
        self,
        param_specs: Any,
        *,
        train_dtype: Any,
        carry: Optional[bool],
        split: Optional[bool],
        path: str,
    ):
        """`param_specs`: the model's ParameterSpec tree; `carry`, `split`: the trainer's
        carry_train_dtype_weights and split_carried_weights; `path`: the trainer's config
        path, for errors."""
        self.check_options(path, train_dtype=train_dtype, carry=carry, split=split)
        self._specs = param_specs
        self._train_dtype = train_dtype
        self._carry = bool(carry)
        self._split = bool(split)
        if self._split:
            for param_path, spec in flatten_with_paths(param_specs, is_leaf=is_parameter_spec):
                if self.has_copy(spec) and spec.dtype != jnp.float32:
                    raise ConfigError(
                        f"{path}.split_carried_weights splits float32 weights only; model "
                        f"parameter {param_path} is {jnp.dtype(spec.dtype).name}"
                    )

    @staticmethod
    def check_options(
        path: str, *, train_dtype: Any, carry: Optional[bool], split: Optional[bool]
    ) -> None:
        """ConfigError naming `path`'s field when the trainer's options do not go together."""
        if carry and train_dtype is None:
            raise ConfigError(f"{path}.carry_train_dtype_weights needs a train_dtype")
        if split and not (carry and train_dtype == jnp.bfloat16):
            raise ConfigError(
                f"{path}.split_carried_weights needs carry_train_dtype_weights and "
                f"train_dtype bfloat16 (got {carry!r} and {train_dtype!r})"
            )

    def has_copy(self, spec: ParameterSpec) -> bool:
        """Whether the parameter of `spec` is a weight with a train_dtype copy: the
        weights of matrix products and embeddings (the parameters with fan axes), not norm
        scales or biases, whose casts XLA fuses into their users."""
        return (
            spec.fan_axes is not None
            and jnp.issubdtype(spec.dtype, jnp.floating)
            and spec.dtype != self._train_dtype
        )

    def _select(self, tree: Any, *, weights: bool) -> Any:
        """`tree` (shaped like the parameters) with None in place of every parameter that is
        not a weight (`weights`) or that is one (not `weights`)."""
        return jax.tree.map(
            lambda spec, x: x if self.has_copy(spec) == weights else None,
            self._specs,
            tree,
            is_leaf=is_parameter_spec,
        )

    def _cast(self, weights: Any) -> Any:
        """Each leaf of `weights` (None leaves are empty subtrees: skipped) in train_dtype."""
        return jax.tree.map(lambda p: p.astype(self._train_dtype), weights)

    def carry(self, params: Any, *, cast: bool = True) -> tuple[Any, Any, Any]:
        """(model, weight_copies, weight_low_bits) that a step carries for float32 `params`.

        Without carried copies: (params, None, None). With them: (params, the weights'
        train_dtype copies, None). With split weights: (params less the weights, their
        `split_float32` high halves, their low halves). `cast=False` maps a tree shaped
        like the parameters (their shardings) to the same places without converting.
        """
        if not self._carry:
            return params, None, None
        weights = self._select(params, weights=True)
        if not self._split:
            return params, self._cast(weights) if cast else weights, None
        kept = self._select(params, weights=False)
        if not cast:
            return kept, weights, weights
        # Split each weight once; `weights` marks where its (high, low) pairs stand.
        halves = jax.tree.map(split_float32, weights)
        high = jax.tree.map(lambda _, pair: pair[0], weights, halves)
        low = jax.tree.map(lambda _, pair: pair[1], weights, halves)
        return kept, high, low

    def join(self, model: Any, weight_copies: Any, weight_low_bits: Any) -> Any:
        """The float32 parameters of what `carry` made: split weights joined again."""
        if weight_low_bits is None:
            return model
        return jax.tree.map(
            lambda spec, x, high, low: x if low is None else join_float32(high, low),
            self._specs,
            model,
            weight_copies,
            weight_low_bits,
            is_leaf=is_parameter_spec,
        )

    def train_dtype_params(
        self, params: Any, weight_copies: Any, *, float32_weight_grads: bool
    ) -> Any:
        """The parameters as the model gets them in a train step: `params` (float32) cast
        to train_dtype, the carried copies (if any) standing for the casts of their weights.

        With float32_weight_grads, each weight that has a copy (carried, or cast here) goes
        to its layer as a `WeightWithCopy` instead, so that its gradient leaves the matmul
        in the weight's float32 (`uses_float32_weight_grads`)."""
        if float32_weight_grads and weight_copies is None:
            # The casts that carried copies would be, made here.
            weight_copies = self._cast(self._select(params, weights=True))
        if weight_copies is None:
            return cast_floats(params, self._train_dtype)
        return cast_floats_with_copies(
            params, weight_copies, self._train_dtype, as_pairs=float32_weight_grads
        )
