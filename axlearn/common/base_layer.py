"""BaseLayer: a module with parameters.

A layer declares its own parameters in `_create_layer_parameter_specs()`; the tree of
specs (`create_parameter_specs_recursively()`) gives every parameter's shape, dtype,
partition spec over logical mesh axes, initializer, fan axes and weight-decay scale,
without allocating anything. `initialize_parameters_recursively(prng_key)` creates the
arrays, one PRNG key per parameter folded in from its path, so a parameter's initial
value does not depend on what else the model holds.

A layer multiplies by a weight (a parameter with fan axes) through `weight_einsum` and
looks up its rows through `weight_take`, not through jnp directly: in a train step that
sums microbatches on one device the trainer hands such weights over as `WeightWithCopy`
(the float32 weight and its bf16 copy), which only these two helpers take. Decoding with
int8 weights (`generate --quantize=int8`) hands them over as `QuantizedWeight`s.
"""

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from axlearn.common.config import (
    ConfigError,
    InstantiableConfig,
    config_class,
    import_name,
    maybe_instantiate,
)
from axlearn.common.module import Module, Tensor, child_prng_key
from axlearn.common.param_init import DefaultInitializer, FanAxes, Initializer
from axlearn.common.sharding import gathered_for_matmul
from axlearn.common.utils import cast_floats, flatten_with_paths, unflatten_paths

# A partition spec as configs write it: one entry per tensor dim, each None, a mesh axis
# name, or a tuple of names.
MeshAxes = Sequence[Optional[Union[str, Sequence[str]]]]


@dataclasses.dataclass
class ParameterSpec:
    """Everything about one parameter except its value."""

    shape: Sequence[int]
    dtype: Optional[jnp.dtype] = None  # None: the layer's dtype.
    mesh_axes: Optional[MeshAxes] = None  # None: replicated.
    initializer: Optional[Initializer] = None  # None: the layer's param_init.
    fan_axes: Optional[FanAxes] = None
    weight_decay_scale: Optional[float] = None  # None: 1.
    # For factored optimizers (Adafactor): which axes to factor, or None.
    factorization: Optional[Sequence[Optional[str]]] = None

    @property
    def partition_spec(self) -> PartitionSpec:
        axes = self.mesh_axes if self.mesh_axes is not None else (None,) * len(self.shape)
        return PartitionSpec(*[tuple(a) if isinstance(a, list) else a for a in axes])

    def shape_dtype_struct(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(tuple(self.shape), self.dtype)


def is_parameter_spec(x: Any) -> bool:
    return isinstance(x, ParameterSpec)


def stacked_parameter_spec(spec: ParameterSpec, size: int) -> ParameterSpec:
    """`spec` with a new leading axis of `size` slices (stacked layers, fused projections),
    replicated over the mesh, a batch axis for the fans and not factored."""
    mesh_axes = spec.mesh_axes if spec.mesh_axes is not None else (None,) * len(spec.shape)
    return dataclasses.replace(
        spec,
        shape=(size, *spec.shape),
        mesh_axes=(None, *mesh_axes),
        fan_axes=spec.fan_axes.prepend_axis() if spec.fan_axes is not None else None,
        factorization=(None, *spec.factorization) if spec.factorization is not None else None,
    )


def cast_floats_with_copies(
    tree: Any, copies: Any, dtype: Optional[jnp.dtype], *, as_pairs: bool = False
) -> Any:
    """cast_floats(tree, dtype), taking the cast of each leaf that has a copy in `copies`
    (a tree like `tree` with None for leaves without one) from that copy.

    Each copy must equal its leaf cast to `dtype` (the trainer writes them together).
    Gradients flow to `tree` as through the cast, and the leaf itself is not read, so
    a step that carries the copies skips the cast's read of the wider leaves. With
    `as_pairs`, each leaf with a copy becomes `WeightWithCopy(leaf, copy)` instead, whose
    gradient leaves its matmul in the leaf's own dtype (`weight_einsum`).
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    copy_leaves = treedef.flatten_up_to(copies)
    with_copy = WeightWithCopy if as_pairs else _precast
    return treedef.unflatten(
        [
            cast_floats(x, dtype) if copy is None else with_copy(x, copy)
            for x, copy in zip(leaves, copy_leaves)
        ]
    )


@jax.custom_vjp
def _precast(x: Tensor, x_cast: Tensor) -> Tensor:
    """x_cast, standing for x.astype(x_cast.dtype): the value comes from x_cast, the
    gradient goes to x."""
    del x
    return x_cast


def _precast_fwd(x, x_cast):
    # The cotangent's dtype for x, as a zero-size array (residuals must be arrays).
    return x_cast, jnp.zeros((0,), x.dtype)


def _precast_bwd(residual, g):
    return g.astype(residual.dtype), None


_precast.defvjp(_precast_fwd, _precast_bwd)


class WeightWithCopy(NamedTuple):
    """A weight beside its train-dtype copy: how layers get their matmul and embedding
    weights in a step that sums gradients over microbatches (`SpmdTrainer` builds them).

    `weight_einsum` multiplies by the copy, as the layer would by a cast weight, and
    computes the weight's gradient in the weight's own dtype (float32) straight out of its
    matmul. Through a cast that gradient would come out of the matmul in bf16 and be
    converted and added to the float32 sum in a pass of its own; in float32, XLA folds the
    sum into the matmul (cuBLAS beta=1), and each microbatch's share is not rounded to
    bf16 first. `weight_take` reads rows from the copy and sums their gradients in the
    weight's dtype too.
    """

    weight: Tensor
    copy: Tensor


@jax.tree_util.register_pytree_node_class
class QuantizedWeight:
    """An int8 weight and its per-row scales: what the weight stands for is
    values * scale, in `dtype` (`axlearn.common.quantization` makes them).

    `scale` has the weight's rank, 1 along the axes each scale covers (those a matmul
    contracts). `weight_einsum` multiplies by the int8 values converted and scales the
    product; `weight_take` scales the rows it reads. With `rows_last`, `values` holds
    those contracted axes last (`rows_last_layout`): each row is contiguous, so a decoding
    step's matmul (`_multiply_reduce`) sums along memory instead of across it.
    """

    def __init__(self, values: Tensor, scale: Tensor, dtype: Any, rows_last: bool = False):
        self.values, self.scale, self.dtype = values, scale, jnp.dtype(dtype)
        self.rows_last = rows_last

    def tree_flatten(self):
        return (self.values, self.scale), (self.dtype.name, self.rows_last)

    @classmethod
    def tree_unflatten(cls, aux, children):
        dtype, rows_last = aux
        return cls(*children, dtype=dtype, rows_last=rows_last)

    @classmethod
    def rows_last_layout(cls, values: Tensor, scale: Tensor, dtype: Any) -> "QuantizedWeight":
        """The weight of `values` (in the weight's own layout) and `scale`, its values
        moved to hold the contracted axes (where `scale` is 1) last."""
        return cls(jnp.transpose(values, _rows_last_order(scale.shape)), scale, dtype, True)

    def weight_layout_values(self) -> Tensor:
        """`values` in the weight's own layout (moved back where `rows_last`)."""
        if not self.rows_last:
            return self.values
        return jnp.transpose(self.values, np.argsort(_rows_last_order(self.scale.shape)))

    def dequantized(self) -> Tensor:
        """The weight it stands for, in `dtype` (in the weight's own layout)."""
        values = self.weight_layout_values().astype(jnp.float32)
        return (values * self.scale.astype(jnp.float32)).astype(self.dtype)


def _rows_last_order(scale_shape: Sequence[int]) -> list[int]:
    """The weight's axes with the contracted ones (scale 1) after the others."""
    kept = [i for i, n in enumerate(scale_shape) if n != 1]
    return kept + [i for i, n in enumerate(scale_shape) if n == 1]


# Up to this many rows of x (a decoding step's batch), an int8 matmul is written as a
# multiply and a sum, which XLA emits as one reduction reading the int8 values: cuBLAS
# takes no int8 x bf16 matmul, and its convert would write a bf16 copy of the weight.
MULTIPLY_REDUCE_MAX_ROWS = 4


def _einsum_axes(spec: str, x: Tensor) -> tuple[str, str, str, int]:
    """(x's, the weight's and the output's named axes, x's leading axes under '...')."""
    inputs, out_axes = spec.split("->")
    x_axes, weight_axes = inputs.split(",")
    x_axes, out_axes = x_axes.replace("...", ""), out_axes.replace("...", "")
    return x_axes, weight_axes, out_axes, x.ndim - len(x_axes)


def _rows_of(spec: str, x: Tensor) -> int:
    """How many vectors of x the matmul multiplies (all but x's contracted axes)."""
    x_axes, weight_axes, _, leading = _einsum_axes(spec, x)
    kept = [n for axis, n in zip(x_axes, x.shape[leading:]) if axis not in weight_axes]
    return math.prod(x.shape[:leading]) * math.prod(kept)


def _multiply_reduce(spec: str, x: Tensor, values: Tensor) -> Tensor:
    """jnp.einsum(spec, x, values) in float32 as a broadcast multiply and a sum."""
    x_axes, weight_axes, out_axes, leading = _einsum_axes(spec, x)
    # Every named axis once, the summed ones last: the sum then runs along the minor axes.
    named = list(dict.fromkeys(x_axes + weight_axes))
    kept = [a for a in named if a in out_axes]
    axes = kept + [a for a in named if a not in out_axes]

    def spread(t: Tensor, t_axes: str, offset: int) -> Tensor:
        # t's axes in the order of `axes`, with a 1 for each axis t lacks.
        order = [axis for axis in axes if axis in t_axes]
        t = jnp.transpose(t, [*range(offset), *(offset + t_axes.index(a) for a in order)])
        sizes = [t.shape[offset + order.index(a)] if a in t_axes else 1 for a in axes]
        return t.reshape(*t.shape[:offset], *sizes)

    product = spread(x, x_axes, leading).astype(jnp.float32) * spread(
        values, weight_axes, 0
    ).astype(jnp.float32)
    y = jnp.sum(product, axis=tuple(range(leading + len(kept), leading + len(axes))))
    # y's axes: x's leading ones, then `kept`; the output's order puts '...' where it says.
    order = []
    for axis in spec.split("->")[1].replace("...", "."):
        order.extend(range(leading) if axis == "." else [leading + kept.index(axis)])
    return jnp.transpose(y, order)


def _quantized_einsum(
    spec: str, x: Tensor, weight: QuantizedWeight, partition_spec: Optional[MeshAxes]
) -> Tensor:
    """jnp.einsum(spec, x, weight.dequantized()), with the scales applied to the product
    where they lie along the output's axes (else to the weight first)."""
    inputs, out_axes = spec.split("->")
    x_axes, weight_axes = inputs.split(",")
    kept = [(axis, n) for axis, n in zip(weight_axes, weight.scale.shape) if axis in out_axes]
    contracted = [n for axis, n in zip(weight_axes, weight.scale.shape) if axis not in out_axes]
    if any(n != 1 for n in contracted):
        dequantized = QuantizedWeight(
            weight.values, weight.scale, x.dtype, weight.rows_last
        ).dequantized()
        return jnp.einsum(spec, x, gathered_for_matmul(dequantized, partition_spec))
    if weight.rows_last:  # The spec of the values as they lie (decoding: one device).
        values = weight.values
        stored_axes = "".join(weight_axes[i] for i in _rows_last_order(weight.scale.shape))
        spec = f"{x_axes},{stored_axes}->{out_axes}"
    else:
        values = gathered_for_matmul(weight.values, partition_spec)
    if _rows_of(spec, x) <= MULTIPLY_REDUCE_MAX_ROWS:
        y = _multiply_reduce(spec, x, values)
    else:
        y = jnp.einsum(spec, x, values.astype(x.dtype), preferred_element_type=jnp.float32)
    scale = weight.scale.astype(jnp.float32).reshape([n for _, n in kept])
    scale_axes = "".join(axis for axis, _ in kept)
    return jnp.einsum(f"{out_axes},{scale_axes}->{out_axes}", y, scale).astype(x.dtype)


def weight_einsum(
    spec: str,
    x: Tensor,
    weight: Union[Tensor, WeightWithCopy, QuantizedWeight],
    *,
    partition_spec: Optional[MeshAxes] = None,
) -> Tensor:
    """jnp.einsum(spec, x, weight) for a layer's weight, an array or a `WeightWithCopy`.

    spec reads 'x_axes,weight_axes->output_axes'; '...' may stand for leading axes of x
    and of the output, not of the weight. `partition_spec` is the weight's (its layer's
    param_partition_spec): on some meshes the weight is gathered to its 'model' entries
    first (`sharding.gathered_for_matmul` says which and why).
    """
    if isinstance(weight, QuantizedWeight):
        return _quantized_einsum(spec, x, weight, partition_spec)
    if not isinstance(weight, WeightWithCopy):
        return jnp.einsum(spec, x, gathered_for_matmul(weight, partition_spec))
    copy = gathered_for_matmul(weight.copy, partition_spec)
    return _einsum_with_weight_grad(spec, x, weight.weight, copy)


def weight_take(weight: Union[Tensor, WeightWithCopy, QuantizedWeight], ids: Tensor) -> Tensor:
    """The rows `ids` of a lookup table, an array or a `WeightWithCopy`.

    A `WeightWithCopy`'s rows are read from the copy, and the weight's gradient is summed
    in the weight's own dtype: through a cast, the rows' cotangents would be scatter-added
    into a bf16 table, where a frequent token's hundreds of rows lose ~2% of their sum.
    """
    if isinstance(weight, QuantizedWeight):
        # A table's rows are already last: rows_last leaves it in its layout.
        rows = jnp.take(weight.weight_layout_values(), ids, axis=0).astype(jnp.float32)
        return (rows * jnp.take(weight.scale, ids, axis=0).astype(jnp.float32)).astype(weight.dtype)
    if not isinstance(weight, WeightWithCopy):
        return jnp.take(weight, ids, axis=0)
    return _take_with_weight_grad(ids, weight.weight, weight.copy)


@jax.custom_vjp
def _take_with_weight_grad(ids: Tensor, weight: Tensor, copy: Tensor) -> Tensor:
    del weight
    return jnp.take(copy, ids, axis=0)


def _take_with_weight_grad_fwd(ids, weight, copy):
    # The copy stands for the weight's shape; the weight's dtype as a zero-size array.
    return jnp.take(copy, ids, axis=0), (ids, copy, jnp.zeros((0,), weight.dtype))


def _take_with_weight_grad_bwd(residuals, dy):
    ids, copy, weight_dtype = residuals
    rows = dy.reshape((-1,) + copy.shape[1:]).astype(weight_dtype.dtype)
    # Out-of-range ids get no gradient, as jnp.take's own transpose drops them.
    dw = jnp.zeros(copy.shape, weight_dtype.dtype).at[ids.reshape(-1)].add(rows, mode="drop")
    return None, dw, None


_take_with_weight_grad.defvjp(_take_with_weight_grad_fwd, _take_with_weight_grad_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum_with_weight_grad(spec: str, x: Tensor, weight: Tensor, copy: Tensor) -> Tensor:
    del weight
    return jnp.einsum(spec, x, copy)


def _einsum_with_weight_grad_fwd(spec, x, weight, copy):
    # The weight's dtype, as a zero-size array (residuals must be arrays).
    return jnp.einsum(spec, x, copy), (x, copy, jnp.zeros((0,), weight.dtype))


def _einsum_with_weight_grad_bwd(spec, residuals, dy):
    x, copy, weight_dtype = residuals
    inputs, out_axes = spec.split("->")
    x_axes, weight_axes = inputs.split(",")
    dx = jnp.einsum(f"{out_axes},{weight_axes}->{x_axes}", dy, copy).astype(x.dtype)
    dw = jnp.einsum(
        f"{x_axes},{out_axes}->{weight_axes}", x, dy, preferred_element_type=weight_dtype.dtype
    )
    return dx, dw, None


_einsum_with_weight_grad.defvjp(_einsum_with_weight_grad_fwd, _einsum_with_weight_grad_bwd)


def _remat_policy(policy: Any) -> Optional[Callable]:
    if policy is None or callable(policy) and not isinstance(policy, InstantiableConfig):
        return policy
    if isinstance(policy, str) and "." in policy:  # A qualified name, as AXLearn dumps them.
        return _remat_policy(import_name(policy, where="remat_spec['policy']: "))
    if isinstance(policy, str):
        found = getattr(jax.checkpoint_policies, policy, None)
        if found is None:
            raise ConfigError(f"remat_spec['policy']: '{policy}' is not in jax.checkpoint_policies")
        return found
    return maybe_instantiate(policy)


class BaseLayer(Module):
    """A module with parameters, a dtype, an initializer, partition specs and remat."""

    @config_class
    class Config(Module.Config):
        """Configures BaseLayer."""

        dtype: Optional[jnp.dtype] = None  # Parameter dtype; None: the parent's (float32 at the root).
        param_init: Optional[DefaultInitializer.Config] = None  # None: the parent's.
        param_partition_spec: Optional[Any] = None  # Partition spec of the layer's main weight.
        # None: no remat. Otherwise {'prevent_cse': bool, 'policy': a checkpoint policy,
        # a config of one, or a name in jax.checkpoint_policies}.
        remat_spec: Optional[dict[str, Any]] = None

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        self._param_init = (
            cfg.param_init.instantiate() if cfg.param_init is not None else None
        )

    @property
    def dtype(self) -> jnp.dtype:
        return self.config_dtype

    @property
    def config_dtype(self) -> jnp.dtype:
        return self._config.dtype if self._config.dtype is not None else jnp.float32

    def _add_child(self, name: str, child_config: Module.Config, **kwargs) -> Module:
        child_config = child_config.clone()
        if isinstance(child_config, BaseLayer.Config):
            if child_config.dtype is None:
                child_config.dtype = self._config.dtype
            if child_config.param_init is None:
                child_config.param_init = self._config.param_init
        return super()._add_child(name, child_config, **kwargs)

    # ----- parameters -----

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        """This layer's own parameters (children's are added by the recursion)."""
        return {}

    def create_parameter_specs_recursively(self) -> dict[str, Any]:
        specs: dict[str, Any] = {}
        for name, spec in self._create_layer_parameter_specs().items():
            specs[name] = dataclasses.replace(spec, dtype=spec.dtype or self.config_dtype)
        for name, child in self._children.items():
            if isinstance(child, BaseLayer):
                child_specs = child.create_parameter_specs_recursively()
                if child_specs:
                    specs[name] = child_specs
        return specs

    def _initializer_for(self, path: str, spec: ParameterSpec) -> Initializer:
        if spec.initializer is not None:
            return spec.initializer
        if self._param_init is None:
            raise ConfigError(f"Parameter '{path}' has no initializer and no param_init is set")
        return self._param_init

    def initialize_parameters_recursively(
        self, prng_key: Tensor, *, prefix: str = ""
    ) -> dict[str, Any]:
        """Creates every parameter; each gets a key folded in from its path below this layer."""
        specs = self.create_parameter_specs_recursively()
        owners = self._owners_of_specs()
        params = {}
        for path, spec in flatten_with_paths(specs, is_leaf=is_parameter_spec):
            owner = owners[path]
            full = f"{prefix}{path}"
            params[path] = owner._initializer_for(full, spec).initialize(
                full,
                prng_key=child_prng_key(prng_key, path),
                shape=tuple(spec.shape),
                dtype=spec.dtype,
                axes=spec.fan_axes,
            )
        return unflatten_paths(params)

    def parameter_initializers(
        self, *, prefix: str = ""
    ) -> list[tuple[str, Initializer, ParameterSpec]]:
        """(path, initializer, spec) per parameter, in the order AXLearn initializes, for
        the `_init` golden lines (`golden_text.init_lines`).

        A layer's own parameters come as `_create_layer_parameter_specs` lists them, then
        its children in the order they were added. Each parameter is described as its own
        layer declares it: a layer that stacks its children's parameters (`Repeat`,
        `FusedQKVLinear`) initializes them one slice at a time, so the stacked axis is not
        in the spec.
        """
        entries = []
        for name, spec in self._create_layer_parameter_specs().items():
            path = f"{prefix}{name}"
            entries.append((path, self._initializer_for(path, spec), spec))
        for child_name, child in self._children.items():
            if isinstance(child, BaseLayer):
                entries += child.parameter_initializers(prefix=f"{prefix}{child_name}/")
        return entries

    def _owners_of_specs(self) -> dict[str, "BaseLayer"]:
        """Parameter path (below this layer) -> the layer whose initializer applies."""
        owners = {}
        for name in self._create_layer_parameter_specs():
            owners[name] = self
        for child_name, child in self._children.items():
            if isinstance(child, BaseLayer):
                for path, owner in child._owners_of_specs().items():
                    owners[f"{child_name}/{path}"] = owner
        return owners

    # ----- calls -----

    def _remat_name(self, x: Tensor, name: str) -> Tensor:
        """Tags `x` so remat policies can save it by name ('ClassName.name')."""
        return checkpoint_name(x, f"{type(self).__name__}.{name}")

    def _functional_call(self, method, state, prng_key, is_training, args, kwargs):
        remat_spec = self._config.remat_spec
        if remat_spec is None or method.__name__ != "forward":
            return super()._functional_call(method, state, prng_key, is_training, args, kwargs)
        base = super()._functional_call
        # jax.checkpoint traces only arrays; other leaves (flags, None) are closed over.
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        is_array = [isinstance(x, (jax.Array, jnp.ndarray)) for x in leaves]

        def call(state, prng_key, array_leaves):
            it = iter(array_leaves)
            merged = [next(it) if a else x for a, x in zip(is_array, leaves)]
            call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, merged)
            return base(method, state, prng_key, is_training, call_args, call_kwargs)

        rematted = jax.checkpoint(
            call,
            prevent_cse=remat_spec.get("prevent_cse", True),
            policy=_remat_policy(remat_spec.get("policy")),
        )
        return rematted(state, prng_key, [x for a, x in zip(is_array, leaves) if a])
