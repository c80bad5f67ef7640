"""Optimizers as partitioned gradient transformations.

Every optimizer function returns a `PartitionedGradientTransformation`: optax's
`init(params)` / `update(updates, state, params) -> (updates, state)` pair, plus
`partition(param_specs)`, which gives the state's `ParameterSpec`s (shape, dtype,
mesh axes) so that the trainer shards optimizer state exactly like the parameters it
belongs to (Adam moments of an fsdp-sharded weight are fsdp-sharded; counters are
replicated scalars), and `learning_rate_at(state)`, the learning rate the next update
will use (for summaries).

Parameter trees are nested dicts. Their leaves may be plain arrays (optax style) or
`OptParam`s, which carry what the parameter's `ParameterSpec` says about optimization:
its weight-decay scale, its Adafactor factorization and its fan axes (how Muon sees a
3-D attention weight or a stack of layers as matrices). `with_param_specs` builds them;
`Learner` does it for you. A leaf may also be None: the parameter is not optimized
(frozen by the learner's update rules) and gets no state.

`optax_optimizer` turns any optax transformation (a config of one, e.g. of optax.adamw)
into such an optimizer. AdamW, Lion and SGD compute their moments through optax's
building blocks; Adastar, Adafactor and Muon, which optax does not express, are ours.

Update conventions: `update` returns the change to add to the parameters (negative
learning rate already applied). Schedules are evaluated as AXLearn's optimizers evaluate
them, at step = updates applied so far + 1 (`schedule.for_update_count`; runs resumed
from checkpoints written before that rule keep theirs, see `schedule`), so the first
update uses `schedule(1)`; `optax_optimizer` leaves its transformation's schedules to
optax, which counts from 0. Weight decay is
`weight_decay * scale * param`, where scale is the spec's `weight_decay_scale` (None: 1)
times the optional `weight_decay_per_param_scale(params)`.
"""

import dataclasses
import functools
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from axlearn.common.base_layer import ParameterSpec
from axlearn.common.config import (
    REQUIRED,
    ConfigError,
    ConfigOr,
    InstantiableConfig,
    maybe_instantiate,
    register_configurable,
)
from axlearn.common.param_init import FanAxes
from axlearn.common.schedule import (
    ScheduleLike,
    adafactor_decay_rate,
    as_schedule_fn,
    for_update_count,
)
from axlearn.common.utils import flatten_with_paths

Tensor = jax.Array
Nested = Any  # A nested dict (or other pytree) of leaves.
# A function from a parameter tree (arrays, OptParams or ParameterSpecs) to a tree of the
# same structure with one float per parameter; or a config of one.
PerParamFn = Callable[[Nested], Nested]


# ----- parameters as optimizers see them -----


@dataclasses.dataclass
class OptParam:
    """A parameter value with the parts of its spec that optimizers use."""

    value: Tensor
    weight_decay_scale: Optional[float] = None  # None: 1.
    # Per axis 'row', 'col' or None: the axes Adafactor factors its second moment over.
    factorization: Optional[tuple[Optional[str], ...]] = None
    fan_axes: Optional[FanAxes] = None  # How Muon views the parameter as matrices.


jax.tree_util.register_dataclass(
    OptParam,
    data_fields=["value"],
    meta_fields=["weight_decay_scale", "factorization", "fan_axes"],
)


def is_param_leaf(x: Any) -> bool:
    """Whether `x` is one parameter's leaf in a tree (an OptParam or a ParameterSpec)."""
    return isinstance(x, (OptParam, ParameterSpec))


def with_param_specs(params: Nested, param_specs: Nested) -> Nested:
    """Wraps every array of `params` in an OptParam carrying its spec's optimizer metadata.

    `param_specs` has the structure of `params` with ParameterSpec leaves (None where
    `params` has None).
    """

    def wrap(value, spec):
        if not isinstance(spec, ParameterSpec):
            raise ValueError(f"Expected a ParameterSpec for a parameter, got {spec!r}")
        return OptParam(
            value=value,
            weight_decay_scale=spec.weight_decay_scale,
            factorization=None if spec.factorization is None else tuple(spec.factorization),
            fan_axes=spec.fan_axes,
        )

    return jax.tree.map(wrap, params, param_specs)


def param_values(params: Nested) -> Nested:
    """The arrays of a tree whose leaves may be OptParams."""
    return jax.tree.map(
        lambda p: p.value if isinstance(p, OptParam) else p, params, is_leaf=is_param_leaf
    )


@dataclasses.dataclass(frozen=True)
class _ParamInfo:
    """What one parameter looks like, from an array, an OptParam or a ParameterSpec."""

    path: str
    shape: tuple[int, ...]
    dtype: Any
    weight_decay_scale: float
    factorization: Optional[tuple[Optional[str], ...]]
    fan_axes: Optional[FanAxes]
    mesh_axes: Optional[Sequence[Any]]


def _param_infos(tree: Nested) -> list[_ParamInfo]:
    """One _ParamInfo per parameter, in the leaf order of the matching array tree."""
    infos = []
    for path, leaf in flatten_with_paths(tree, is_leaf=is_param_leaf):
        if isinstance(leaf, ParameterSpec):
            shape, dtype, mesh_axes = tuple(leaf.shape), leaf.dtype or jnp.float32, leaf.mesh_axes
        else:
            value = leaf.value if isinstance(leaf, OptParam) else leaf
            shape, dtype, mesh_axes = tuple(jnp.shape(value)), jnp.result_type(value), None
        # Plain arrays carry no metadata: scale 1, no factorization, no fan axes.
        wd = getattr(leaf, "weight_decay_scale", None)
        factorization = getattr(leaf, "factorization", None)
        infos.append(
            _ParamInfo(
                path=path,
                shape=shape,
                dtype=dtype,
                weight_decay_scale=1.0 if wd is None else float(wd),
                factorization=None if factorization is None else tuple(factorization),
                fan_axes=getattr(leaf, "fan_axes", None),
                mesh_axes=mesh_axes,
            )
        )
    return infos


def _flatten_params(tree: Nested) -> tuple[list[Any], Any]:
    """(leaves, treedef) with OptParams and ParameterSpecs as leaves (None leaves dropped)."""
    return jax.tree_util.tree_flatten(tree, is_leaf=is_param_leaf)


def _values_list(params: Nested) -> list[Tensor]:
    leaves, _ = _flatten_params(params)
    return [p.value if isinstance(p, OptParam) else p for p in leaves]


# ----- state partitioning -----


def _state_spec(info: _ParamInfo, *, dtype: Any = None, drop_axes=()) -> ParameterSpec:
    """The spec of one parameter's state tensor: the parameter's shape and mesh axes
    without `drop_axes` (factored statistics), in `dtype` (None: the parameter's)."""
    dropped = {a % len(info.shape) for a in drop_axes}
    keep = [i for i in range(len(info.shape)) if i not in dropped]
    mesh_axes = None if info.mesh_axes is None else tuple(info.mesh_axes[i] for i in keep)
    return ParameterSpec(
        shape=[info.shape[i] for i in keep],
        dtype=dtype if dtype is not None else info.dtype,
        mesh_axes=mesh_axes,
    )


def _scalar_spec(dtype=jnp.int32) -> ParameterSpec:
    """A replicated scalar (step counters)."""
    return ParameterSpec(shape=[], dtype=dtype, mesh_axes=())


def _like_params(specs: Nested, dtype: Any = None) -> Nested:
    """Specs of a state tree shaped and sharded like the parameters."""
    _, treedef = _flatten_params(specs)
    return treedef.unflatten([_state_spec(info, dtype=dtype) for info in _param_infos(specs)])


def _nothing_like(tree: Nested) -> Nested:
    """A tree with the structure of `tree` and None for every parameter: no state."""
    _, treedef = _flatten_params(tree)
    return treedef.unflatten([None] * treedef.num_leaves)


# ----- the transformation type -----


class PartitionedGradientTransformation(NamedTuple):
    """An optax-compatible gradient transformation that can also partition its state."""

    init: Callable[[Nested], Any]
    # (updates, state, params) -> (updates, state).
    update: Callable[..., tuple[Nested, Any]]
    # Parameter specs -> a tree of the state's structure with ParameterSpec leaves.
    partition: Callable[[Nested], Any]
    # state -> the learning rate of the next update; None where the transformation has none.
    learning_rate_at: Optional[Callable[[Any], Tensor]] = None


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


def _count_init() -> Tensor:
    return jnp.zeros([], jnp.int32)


def global_norm(tree: Nested) -> Tensor:
    """The L2 norm of all leaves together, computed in float32."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros([], jnp.float32)
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def _rms(x: Tensor) -> Tensor:
    return jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32))))


def _trust_ratio_scaled(update: Tensor, param: Tensor, eps: float) -> Tensor:
    """LAMB's layer-wise adaptation (https://arxiv.org/abs/1904.00962): update times
    ||param|| / (||update|| + eps), or unchanged where either norm is 0."""
    param_norm = jnp.linalg.norm(param.astype(jnp.float32).ravel())
    update_norm = jnp.linalg.norm(update.astype(jnp.float32).ravel())
    ratio = jnp.where(
        (param_norm == 0) | (update_norm == 0), 1.0, param_norm / (update_norm + eps)
    )
    return (update * ratio).astype(update.dtype)


def _require_params(params: Optional[Nested], what: str) -> Nested:
    if params is None:
        raise ValueError(f"{what} needs the parameters: call update(updates, state, params)")
    return params


def _weight_decay_scales(params: Nested, per_param_scale: Optional[ConfigOr[PerParamFn]]):
    """One float per parameter: spec scale times `per_param_scale(params)`."""
    infos = _param_infos(params)
    scales = [info.weight_decay_scale for info in infos]
    fn = maybe_instantiate(per_param_scale)
    if fn is not None:
        extra = jax.tree.leaves(fn(params))
        if len(extra) != len(scales):
            raise ValueError(
                f"weight_decay_per_param_scale returned {len(extra)} scales for "
                f"{len(scales)} parameters"
            )
        scales = [s * float(e) for s, e in zip(scales, extra)]
    return scales


def _weight_decay_terms(
    params: Optional[Nested],
    grads: Nested,
    *,
    weight_decay: float,
    weight_decay_per_param_scale: Optional[ConfigOr[PerParamFn]],
    what: str,
) -> list[Optional[Tensor]]:
    """weight_decay * scale * p for each leaf of `grads` (None where it is zero)."""
    num_leaves = len(jax.tree.leaves(grads))
    if not weight_decay:
        return [None] * num_leaves
    params = _require_params(params, what)
    scales = _weight_decay_scales(params, weight_decay_per_param_scale)
    return [
        None if scale == 0.0 else (weight_decay * scale) * p
        for p, scale in zip(_values_list(params), scales)
    ]


def _final_updates(
    direction: Nested,
    grads: Nested,
    decay_terms: list[Optional[Tensor]],
    *,
    lr: Union[float, Tensor],
    wd_multiplier: Union[float, Tensor],
) -> Nested:
    """-(lr * d + wd_multiplier * decay_term) per leaf, in the gradient's dtype."""
    d_leaves, treedef = jax.tree_util.tree_flatten(direction)
    g_leaves = treedef.flatten_up_to(grads)
    out = []
    for d, g, decay in zip(d_leaves, g_leaves, decay_terms):
        step = lr * d if decay is None else lr * d + wd_multiplier * decay
        out.append((-step).astype(g.dtype))
    return treedef.unflatten(out)


def _decayed_update(
    direction: Nested,
    grads: Nested,
    params: Optional[Nested],
    *,
    weight_decay: float,
    weight_decay_per_param_scale: Optional[ConfigOr[PerParamFn]],
    lr: Union[float, Tensor],
    wd_multiplier: Union[float, Tensor],
    what: str,
    extra: Optional[PartitionedGradientTransformation] = None,
    extra_state: Any = None,
) -> tuple[Nested, Any]:
    """The updates of a direction with decoupled weight decay:
    -(lr * d + wd_multiplier * weight_decay * scale * p) per leaf, where d is `direction`
    after `extra` (an adam_update_transformation, if given). Returns the updates and
    extra's new state (`extra_state` without `extra`)."""
    if extra is not None:
        direction, extra_state = extra.update(direction, extra_state, params)
    decay = _weight_decay_terms(
        params,
        grads,
        weight_decay=weight_decay,
        weight_decay_per_param_scale=weight_decay_per_param_scale,
        what=what,
    )
    updates = _final_updates(direction, grads, decay, lr=lr, wd_multiplier=wd_multiplier)
    return updates, extra_state


# ----- composition -----


@register_configurable
def chain(
    *args: ConfigOr[PartitionedGradientTransformation],
    transformations: Optional[Sequence[ConfigOr[PartitionedGradientTransformation]]] = None,
) -> PartitionedGradientTransformation:
    """Applies transformations in order; the state is a tuple of their states.

    Give them positionally, in a config as `args` (`config_for_function(chain).set(args=
    [...])`, as AXLearn's configs do), or as `transformations`.
    """
    if args and transformations:
        raise ValueError("chain: give transformations positionally or as `transformations`")
    parts = [maybe_instantiate(t) for t in (list(args) or list(transformations or []))]

    def init(params):
        return tuple(t.init(params) for t in parts)

    def update(updates, state, params=None):
        new_state = []
        for t, s in zip(parts, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    def partition(param_specs):
        return tuple(t.partition(param_specs) for t in parts)

    def learning_rate_at(state):
        for t, s in zip(parts, state):
            if t.learning_rate_at is not None:
                return t.learning_rate_at(s)
        return None

    has_lr = any(t.learning_rate_at is not None for t in parts)
    return PartitionedGradientTransformation(
        init, update, partition, learning_rate_at if has_lr else None
    )


def _stateless(update_fn: Callable) -> PartitionedGradientTransformation:
    return PartitionedGradientTransformation(
        init=lambda params: EmptyState(),
        update=lambda updates, state, params=None: (update_fn(updates, params), state),
        partition=lambda param_specs: EmptyState(),
    )


def _clip(updates: Nested, norm: Tensor, max_norm: float, eps: float) -> Nested:
    scale = jnp.minimum(1.0, max_norm / (norm + eps))
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), updates)


@register_configurable
def clip_by_global_norm(max_norm: float, eps: float = 1e-8) -> PartitionedGradientTransformation:
    """Scales the updates by min(1, max_norm / (global norm + eps))."""
    return _stateless(lambda updates, params: _clip(updates, global_norm(updates), max_norm, eps))


class SkipClipState(NamedTuple):
    nonvalid_count: Tensor  # Updates skipped so far (non-finite or too large gradient norm).
    inner_state: Any


@register_configurable
def skip_and_clip_by_global_norm(
    inner: ConfigOr[PartitionedGradientTransformation],
    *,
    drop_norm: Optional[float] = None,
    max_norm: Optional[float] = None,
    eps: float = 1e-8,
) -> PartitionedGradientTransformation:
    """Skips a whole step when the gradient norm is not finite or exceeds `drop_norm`;
    otherwise clips the gradients to `max_norm` and applies `inner`.

    A skipped step returns zero updates and leaves `inner`'s state untouched (its step
    count does not advance); `SkipClipState.nonvalid_count` counts the skipped steps.
    `drop_norm` / `max_norm` None: never skip on size / never clip.
    """
    inner = maybe_instantiate(inner)

    def init(params):
        return SkipClipState(nonvalid_count=_count_init(), inner_state=inner.init(params))

    def update(updates, state, params=None):
        norm = global_norm(updates)
        valid = jnp.isfinite(norm)
        if drop_norm is not None:
            valid = jnp.logical_and(valid, norm <= drop_norm)
        if max_norm is not None:
            updates = _clip(updates, norm, max_norm, eps)
        new_updates, new_inner = inner.update(updates, state.inner_state, params)
        # jnp.where (not lax.cond) keeps every branch SPMD-friendly; a NaN computed on an
        # invalid step is discarded by the selection.
        new_updates = jax.tree.map(lambda u: jnp.where(valid, u, jnp.zeros_like(u)), new_updates)
        new_inner = jax.tree.map(lambda n, o: jnp.where(valid, n, o), new_inner, state.inner_state)
        count = state.nonvalid_count + jnp.where(valid, 0, 1).astype(jnp.int32)
        return new_updates, SkipClipState(nonvalid_count=count, inner_state=new_inner)

    def partition(param_specs):
        return SkipClipState(
            nonvalid_count=_scalar_spec(), inner_state=inner.partition(param_specs)
        )

    learning_rate_at = None
    if inner.learning_rate_at is not None:
        learning_rate_at = lambda state: inner.learning_rate_at(state.inner_state)  # noqa: E731
    return PartitionedGradientTransformation(init, update, partition, learning_rate_at)


def is_state_tensor(shape: Sequence[int], dtype: Any) -> bool:
    """Whether a state leaf is a floating-point tensor (moments, EMAs), not a scalar
    (step counts, skip counts) or an integer."""
    return len(shape) > 0 and jnp.issubdtype(dtype, jnp.floating)


def _state_tensor_paths(state: Nested) -> list[str]:
    """The '/'-joined path of each state tensor of `state` (as checkpoints name them)."""
    return [path for path, x in flatten_with_paths(state) if is_state_tensor(x.shape, x.dtype)]


def _map_state_tensors(
    fn: Callable[[Any], Any], state: Nested, selected: Optional[re.Pattern] = None
) -> Nested:
    """`state` with each state tensor x (an array, or the ParameterSpec of one) replaced by
    fn(x); scalars, integers and, given `selected`, the tensors whose path it does not
    search-match as they are."""
    leaves, treedef = jax.tree_util.tree_flatten(state)
    paths = [path for path, _ in flatten_with_paths(state)]  # In the same order.
    return treedef.unflatten(
        [
            fn(x)
            if is_state_tensor(x.shape, x.dtype) and (selected is None or selected.search(path))
            else x
            for path, x in zip(paths, leaves)
        ]
    )


def _cast_state_tensors(state: Nested, dtype: Any, selected: Optional[re.Pattern]) -> Nested:
    return _map_state_tensors(lambda x: x.astype(dtype), state, selected)


def _is_floating_dtype(dtype: Any) -> bool:
    try:
        return jnp.issubdtype(dtype, jnp.floating)
    except TypeError:  # Not a dtype at all, e.g. a misspelt name.
        return False


@register_configurable
def cast_optimizer_state(
    inner: ConfigOr[PartitionedGradientTransformation],
    *,
    dtype: Any,
    state_paths: Optional[str] = None,
) -> PartitionedGradientTransformation:
    """Keeps `inner`'s floating-point state tensors in `dtype` between steps, e.g. Adam's
    or Adastar's moments in bfloat16: half their memory, and fewer bytes read and written
    by every update, which is bandwidth-bound.

    `inner` computes each update in float32: its state is cast up before `inner.update`
    and the new state cast down (to nearest) after, so a step uses its unrounded new
    statistics and only what is carried to the next step is rounded. Scalars and integer
    leaves keep their dtype, and the state keeps `inner`'s structure, so `find_states` and
    checkpoints see the same tree.

    `state_paths`: a regex; only the state tensors whose path in `inner`'s state it
    matches (`re.search`; paths are '/'-joined as checkpoints name them, e.g.
    '0/update_ema/decoder/emb/token_emb/weight' for Adastar) are kept in `dtype`, the
    others as `inner` keeps them. None: all of them. E.g. 'update_ema' for Adastar's update
    EMA alone, as optax's `mu_dtype` does for Adam's first moment.
    """
    if not _is_floating_dtype(dtype):
        raise ConfigError(
            f"cast_optimizer_state: dtype must be a floating-point dtype, got {dtype!r}"
        )
    selected = None
    if state_paths is not None:
        try:
            selected = re.compile(state_paths)
        except re.error as e:
            raise ConfigError(f"cast_optimizer_state: state_paths={state_paths!r}: {e}") from e
    inner = maybe_instantiate(inner)

    def init(params):
        inner_state = inner.init(params)
        if selected is not None and not any(
            selected.search(path) for path in _state_tensor_paths(inner_state)
        ):
            raise ConfigError(
                f"cast_optimizer_state: state_paths={state_paths!r} matches none of the "
                f"state tensors' paths, e.g. {_state_tensor_paths(inner_state)[:3]}"
            )
        return _cast_state_tensors(inner_state, dtype, selected)

    def update(updates, state, params=None):
        in_float32 = _cast_state_tensors(state, jnp.float32, selected)
        updates, new_state = inner.update(updates, in_float32, params)
        return updates, _cast_state_tensors(new_state, dtype, selected)

    def partition(param_specs):
        return _map_state_tensors(
            lambda spec: dataclasses.replace(spec, dtype=dtype),
            inner.partition(param_specs),
            selected,
        )

    return PartitionedGradientTransformation(init, update, partition, inner.learning_rate_at)


@register_configurable
def per_param_scale_by_path(
    *,
    description: str,
    scale_by_path: Sequence[tuple[str, float]],
    default_scale: float = 1.0,
) -> PerParamFn:
    """A per-parameter scale chosen by the first regex of `scale_by_path` that fully
    matches the parameter's '/'-joined path; `default_scale` where none does.

    `description` names the rule set in the log lines: a count per scale at INFO, each parameter's scale at DEBUG.
    """
    rules = []
    for i, (pattern, scale) in enumerate(scale_by_path):
        try:
            rules.append((re.compile(pattern), float(scale)))
        except re.error as e:
            raise ConfigError(f"{description}: scale_by_path[{i}][0]={pattern!r}: {e}") from e

    def scale_for(path: str) -> float:
        for regex, scale in rules:
            if regex.fullmatch(path):
                return scale
        return float(default_scale)

    def fn(tree: Nested) -> Nested:
        _, treedef = _flatten_params(tree)
        paths = [info.path for info in _param_infos(tree)]
        scales = [scale_for(path) for path in paths]
        counts = {scale: scales.count(scale) for scale in sorted(set(scales))}
        logging.info(
            "%s: %s", description, ", ".join(f"{n} parameters at {s}" for s, n in counts.items())
        )
        logging.debug("%s: %s", description, ", ".join(f"{p}={s}" for p, s in zip(paths, scales)))
        return treedef.unflatten(scales)

    return fn


@register_configurable
def scale_update_per_param(
    per_param_scale: ConfigOr[PerParamFn],
) -> PartitionedGradientTransformation:
    """Multiplies each parameter's update by `per_param_scale(params)` (e.g. muP scales)."""
    fn = maybe_instantiate(per_param_scale)

    def scale_updates(updates, params):
        scales = jax.tree.leaves(fn(params if params is not None else updates))
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        return treedef.unflatten([(u * s).astype(u.dtype) for u, s in zip(leaves, scales)])

    return _stateless(scale_updates)


class ParamEmaState(NamedTuple):
    count: Tensor
    ema: Nested  # The debiased exponential moving average of the updated parameters.


@register_configurable
def param_ema(decay: Optional[float] = None) -> PartitionedGradientTransformation:
    """An exponential moving average of the parameters (None: keeps none).

    `update(updates, state, params)` folds in `params + updates`, the new parameters; the
    returned updates are unchanged. The average is debiased: after t updates it is
    sum_i w_i * params_i with weights proportional to decay**(t - i) that sum to one, so
    it is a usable set of weights from the first step on (at init it equals the params).
    """
    if decay is None:
        return _stateless(lambda updates, params: updates)
    if not 0.0 <= decay < 1.0:
        raise ConfigError(f"param_ema: decay must lie in [0, 1), got {decay}")

    def init(params):
        return ParamEmaState(count=_count_init(), ema=jax.tree.map(jnp.array, param_values(params)))

    def update(updates, state, params=None):
        params = param_values(_require_params(params, "param_ema"))
        count = state.count + 1
        # Debiased running average: ema_t = (decay * c_{t-1} * ema_{t-1} + (1 - decay) p_t) / c_t,
        # with c_t = 1 - decay**t the total weight of the biased (zero-initialized) average.
        c_prev = 1.0 - decay ** state.count.astype(jnp.float32)
        c_now = 1.0 - decay ** count.astype(jnp.float32)

        def step(ema, p, u):
            new_p = (p + u).astype(jnp.float32)
            new = (decay * c_prev * ema.astype(jnp.float32) + (1.0 - decay) * new_p) / c_now
            return new.astype(ema.dtype)

        ema = jax.tree.map(step, state.ema, params, updates)
        return updates, ParamEmaState(count=count, ema=ema)

    def partition(param_specs):
        return ParamEmaState(count=_scalar_spec(), ema=_like_params(param_specs))

    return PartitionedGradientTransformation(init, update, partition)


# ----- optax transformations -----


def _optax_state_specs(init: Callable[[Nested], Any], param_specs: Nested) -> Any:
    """The specs of the state that an optax `init` builds for parameters of `param_specs`.

    The state's shapes come from `jax.eval_shape(init, ...)`. A subtree with the structure
    of the parameter tree mirrors the parameters (moments, traces): each of its tensors
    with its parameter's shape gets that parameter's mesh axes. Every other tensor (step
    counters, statistics of another shape) is replicated.
    """
    _, treedef = _flatten_params(param_specs)
    infos = _param_infos(param_specs)
    shapes = treedef.unflatten([jax.ShapeDtypeStruct(i.shape, i.dtype) for i in infos])
    params_structure = jax.tree.structure(shapes)

    def replicated(x: jax.ShapeDtypeStruct) -> ParameterSpec:
        return ParameterSpec(shape=list(x.shape), dtype=x.dtype, mesh_axes=(None,) * x.ndim)

    def mirrored(x: jax.ShapeDtypeStruct, info: _ParamInfo) -> ParameterSpec:
        if tuple(x.shape) != info.shape:
            return replicated(x)
        return ParameterSpec(shape=list(x.shape), dtype=x.dtype, mesh_axes=info.mesh_axes)

    def specs_of(node: Any) -> Any:
        if not jax.tree.leaves(node):  # None, EmptyState(), {}: no tensors.
            return node
        if jax.tree.structure(node) == params_structure:
            return params_structure.unflatten(
                [mirrored(x, info) for x, info in zip(jax.tree.leaves(node), infos)]
            )
        if isinstance(node, jax.ShapeDtypeStruct):
            return replicated(node)
        children, structure = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
        return structure.unflatten([specs_of(child) for child in children])

    return specs_of(jax.eval_shape(init, shapes))


def _from_optax(transformation: optax.GradientTransformation) -> PartitionedGradientTransformation:
    """An optax transformation as a PartitionedGradientTransformation. It sees plain arrays
    (OptParams unwrapped), its state keeps the dtypes `init` gave it (optax would promote a
    bfloat16 moment updated by float32 gradients; the specs promise init's dtypes), and
    `partition` gives `_optax_state_specs`."""

    def init(params):
        return transformation.init(param_values(params))

    def update(updates, state, params=None):
        values = None if params is None else param_values(params)
        updates, new_state = transformation.update(updates, state, values)
        new_state = jax.tree.map(
            lambda new, old: jnp.asarray(new, jnp.result_type(old)), new_state, state
        )
        return updates, new_state

    def partition(param_specs):
        return _optax_state_specs(transformation.init, param_specs)

    return PartitionedGradientTransformation(init, update, partition)


def _instantiate_nested(value: Any, path: str) -> Any:
    """`value` with every config in it, at any depth, instantiated, innermost first (an
    optax call's arguments are objects: a schedule, a mask, an inner transformation)."""
    if isinstance(value, InstantiableConfig):
        built = value.clone()
        for name, field in value.items():
            if name not in ("fn", "klass"):
                setattr(built, name, _instantiate_nested(field, f"{path}.{name}"))
        return built.instantiate(config_path=path)
    if type(value) in (list, tuple):
        return type(value)(_instantiate_nested(v, f"{path}[{i}]") for i, v in enumerate(value))
    if type(value) is dict:
        return {k: _instantiate_nested(v, f"{path}[{k!r}]") for k, v in value.items()}
    return value


def _is_chain(transformation: Any) -> bool:
    """Whether `optax_optimizer`'s argument is a sequence of transformations to chain."""
    return isinstance(transformation, (list, tuple)) and not isinstance(
        transformation, optax.GradientTransformation
    )


def _build_optax(value: Any, path: str) -> optax.GradientTransformation:
    """The optax transformation that `value` (a transformation, a config or a callable
    returning one) describes."""
    if isinstance(value, InstantiableConfig):
        value = _instantiate_nested(value, path)
    elif callable(value) and not isinstance(value, optax.GradientTransformation):
        value = value()
    if not isinstance(value, optax.GradientTransformation):
        raise ConfigError(
            f"optax_optimizer: {path} gave {type(value).__name__}, expected an "
            "optax.GradientTransformation"
        )
    return value


# An optax transformation, a config of a function returning one, or a callable returning one.
OptaxLike = Union[
    optax.GradientTransformation,
    InstantiableConfig,
    Callable[[], optax.GradientTransformation],
]


class OptaxState(NamedTuple):
    count: Tensor  # Updates applied so far: the step of the reported learning rate.
    inner: Any  # The optax transformation's state.


@register_configurable
def optax_optimizer(
    transformation: Union[OptaxLike, Sequence[OptaxLike]],
) -> PartitionedGradientTransformation:
    """Any optax transformation as an optimizer of this library, e.g. in a learner config:

        config_for_function(optax_optimizer).set(
            transformation=config_for_function(optax.adamw).set(
                learning_rate=config_for_function(cosine_with_linear_warmup).set(...),
                weight_decay=0.1,
            )
        )

    `transformation`: an optax.GradientTransformation, a config of a function returning
    one (configs in its fields, such as a schedule config as `learning_rate`, are
    instantiated first: optax takes a schedule as a callable of the update count, which
    is what our schedule configs instantiate to), a callable returning one, or a sequence
    of these, chained in order as optax.chain does (a config cannot hold optax.chain's
    positional arguments).

    The updates are optax's, learning rate and sign applied. The state is an OptaxState:
    its tensors shaped like their parameters are sharded like them, the rest replicated.
    `learning_rate_at` reports the `learning_rate` field of the first config that sets
    one (none: no learning rate is reported).
    """
    chained = _is_chain(transformation)
    parts = list(transformation) if chained else [transformation]
    built = [
        _build_optax(part, f"transformation[{i}]" if chained else "transformation")
        for i, part in enumerate(parts)
    ]
    inner = _from_optax(optax.chain(*built) if chained else built[0])
    learning_rates = [
        part.learning_rate
        for part in parts
        if isinstance(part, InstantiableConfig)
        and "learning_rate" in part
        and part.learning_rate not in (None, REQUIRED)
    ]
    lr = as_schedule_fn(learning_rates[0]) if learning_rates else None

    def init(params):
        return OptaxState(count=_count_init(), inner=inner.init(params))

    def update(updates, state, params=None):
        updates, inner_state = inner.update(updates, state.inner, params)
        return updates, OptaxState(count=state.count + 1, inner=inner_state)

    def partition(param_specs):
        return OptaxState(count=_scalar_spec(), inner=inner.partition(param_specs))

    learning_rate_at = None if lr is None else (lambda state: lr(state.count))
    return PartitionedGradientTransformation(init, update, partition, learning_rate_at)


def _add_decayed_weights(
    weight_decay: float,
    weight_decay_per_param_scale: Optional[ConfigOr[PerParamFn]],
    what: str,
) -> PartitionedGradientTransformation:
    """updates + weight_decay * scale * p. Ours, not optax.add_decayed_weights: that one
    takes one rate for every parameter (a boolean mask at most), ours a scale for each."""

    def add(updates, params):
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        decay = _weight_decay_terms(
            params,
            updates,
            weight_decay=weight_decay,
            weight_decay_per_param_scale=weight_decay_per_param_scale,
            what=what,
        )
        return treedef.unflatten([u if w is None else u + w for u, w in zip(leaves, decay)])

    return _stateless(add)


# ----- Adam family -----


def _adam_transformation(
    *,
    b1: float,
    b2: float,
    eps: float,
    mu_dtype: Any,
    lr_fn: Callable[[Tensor], Tensor],
    weight_decay: float,
    wd_multiplier_fn: Callable[[Tensor], Tensor],
    weight_decay_per_param_scale: Optional[ConfigOr[PerParamFn]],
    adam_update_transformation: Optional[ConfigOr[PartitionedGradientTransformation]],
    what: str,
) -> PartitionedGradientTransformation:
    """Adam directions d (optax.scale_by_adam), optionally transformed, then
    -(lr_fn(t) * d + weight_decay * wd_multiplier_fn(t) * scale * p).

    The state is (optax's ScaleByAdamState, adam_update_transformation's state). Weight
    decay and learning rate are ours: the decay has a scale per parameter, and the
    decoupled variant scales it by a schedule of its own (see _add_decayed_weights).
    """
    adam = _from_optax(optax.scale_by_adam(b1=b1, b2=b2, eps=eps, mu_dtype=mu_dtype))
    extra = maybe_instantiate(adam_update_transformation)

    def init(params):
        return adam.init(params), (extra.init(params) if extra is not None else EmptyState())

    def update(grads, state, params=None):
        adam_state, extra_state = state
        direction, new_adam_state = adam.update(grads, adam_state, params)
        step, extra_state = _decayed_update(
            direction,
            grads,
            params,
            weight_decay=weight_decay,
            weight_decay_per_param_scale=weight_decay_per_param_scale,
            lr=lr_fn(adam_state.count),
            wd_multiplier=wd_multiplier_fn(adam_state.count),
            what=what,
            extra=extra,
            extra_state=extra_state,
        )
        return step, (new_adam_state, extra_state)

    def partition(param_specs):
        extra_specs = extra.partition(param_specs) if extra is not None else EmptyState()
        return adam.partition(param_specs), extra_specs

    return PartitionedGradientTransformation(
        init, update, partition, lambda state: lr_fn(state[0].count)
    )


@register_configurable
def adamw_optimizer(
    learning_rate: ScheduleLike,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_per_param_scale: Optional[ConfigOr[PerParamFn]] = None,
    mu_dtype: Any = None,
    adam_update_transformation: Optional[ConfigOr[PartitionedGradientTransformation]] = None,
) -> PartitionedGradientTransformation:
    """AdamW (Loshchilov & Hutter) as optax.adamw computes it, with a weight-decay scale
    per parameter: p -= lr_t * (adam_direction + weight_decay * scale * p), i.e. weight
    decay scaled by the learning rate. `adam_update_transformation` (e.g.
    scale_update_per_param) transforms the Adam direction before weight decay is added.
    `mu_dtype`: first-moment dtype (None: the parameter's)."""
    lr = for_update_count(learning_rate)
    return _adam_transformation(
        b1=b1,
        b2=b2,
        eps=eps,
        mu_dtype=mu_dtype,
        lr_fn=lr,
        weight_decay=weight_decay,
        wd_multiplier_fn=lr,
        weight_decay_per_param_scale=weight_decay_per_param_scale,
        adam_update_transformation=adam_update_transformation,
        what="adamw_optimizer",
    )


@register_configurable
def adamw_decoupled_optimizer(
    learning_rate: ScheduleLike,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    update_schedule: ScheduleLike = 1.0,
    weight_decay: float = 0.0,
    weight_decay_per_param_scale: Optional[ConfigOr[PerParamFn]] = None,
    mu_dtype: Any = None,
    adam_update_transformation: Optional[ConfigOr[PartitionedGradientTransformation]] = None,
) -> PartitionedGradientTransformation:
    """AdamW with weight decay independent of the learning rate:
    p -= s_t * (learning_rate * adam_direction + weight_decay * scale * p), where
    s_t = update_schedule(t) scales both (so `weight_decay` is a per-step decay rate at
    s_t = 1, whatever the learning rate)."""
    lr = for_update_count(learning_rate)
    schedule = for_update_count(update_schedule)
    return _adam_transformation(
        b1=b1,
        b2=b2,
        eps=eps,
        mu_dtype=mu_dtype,
        lr_fn=lambda count: lr(count) * schedule(count),
        weight_decay=weight_decay,
        wd_multiplier_fn=schedule,
        weight_decay_per_param_scale=weight_decay_per_param_scale,
        adam_update_transformation=adam_update_transformation,
        what="adamw_decoupled_optimizer",
    )


def _debias(x: Tensor, decay: float, count: Tensor) -> Tensor:
    return x / (1.0 - decay ** count.astype(jnp.float32))


class AdastarState(NamedTuple):
    count: Tensor
    gradient_ema: Nested  # None leaves when gradient_ema_decay is None.
    gradient_square_ema: Nested
    update_ema: Nested  # None leaves when update_ema_decay is None.


def _ema(old: Tensor, x: Tensor, decay: float, debias: bool, count: Tensor):
    """(new EMA state, its value after optional debiasing) of e = decay * e + (1 - decay) * x."""
    new = (decay * old + (1 - decay) * x).astype(old.dtype)
    return new, (_debias(new, decay, count) if debias else new)


@dataclasses.dataclass(frozen=True)
class _AdastarRule:
    """The per-parameter part of adastar_optimizer (its arguments of the same names)."""

    gradient_ema_decay: Optional[float]
    gradient_ema_debias: Optional[bool]
    gradient_square_ema_decay: float
    gradient_square_ema_debias: bool
    eps: float
    eps_square: float
    raw_update_clipping_threshold: Optional[float]
    update_ema_decay: Optional[float]
    update_ema_debias: bool

    def check(self) -> None:
        """ConfigError where a debias flag of a set decay is not a bool."""
        for decay, debias, name in (
            (self.gradient_ema_decay, self.gradient_ema_debias, "gradient_ema"),
            (self.update_ema_decay, self.update_ema_debias, "update_ema"),
        ):
            if decay is not None and not isinstance(debias, bool):
                raise ConfigError(
                    f"adastar_optimizer: {name}_debias must be True or False when "
                    f"{name}_decay is set, got {debias!r}"
                )

    def state(self, count: Any, like: Nested, nothing: Nested) -> AdastarState:
        """The state (or its specs) from `like` trees for the EMAs kept, `nothing` else."""
        return AdastarState(
            count=count,
            gradient_ema=like if self.gradient_ema_decay is not None else nothing,
            gradient_square_ema=like,
            update_ema=like if self.update_ema_decay is not None else nothing,
        )

    def update_one(self, g: Tensor, m: Any, v: Tensor, u: Any, count: Tensor):
        """New (m, v, u) state of one parameter, its raw update, its smoothed update and
        whether the raw update was clipped (None without clipping)."""
        g = g.astype(jnp.float32)
        m_hat = g
        if self.gradient_ema_decay is not None:
            m, m_hat = _ema(m, g, self.gradient_ema_decay, self.gradient_ema_debias, count)
        v, v_hat = _ema(
            v,
            g * g + self.eps_square,
            self.gradient_square_ema_decay,
            self.gradient_square_ema_debias,
            count,
        )
        raw = m_hat / (jnp.sqrt(v_hat) + self.eps)
        clipped = None
        threshold = self.raw_update_clipping_threshold
        if threshold is not None:
            raw_rms = _rms(raw)
            clipped = raw_rms > threshold
            raw = raw / jnp.maximum(1.0, raw_rms / threshold)
        u_hat = raw
        if self.update_ema_decay is not None:
            u, u_hat = _ema(u, raw, self.update_ema_decay, self.update_ema_debias, count)
        return m, v, u, raw, u_hat, clipped

    def update_all(self, grads: Nested, state: AdastarState, count: Tensor):
        """(new AdastarState, raw updates, smoothed updates as a tree like `grads`, clipped
        flags) of every parameter."""
        g_leaves, treedef = jax.tree_util.tree_flatten(grads)
        per_param = zip(
            g_leaves,
            treedef.flatten_up_to(state.gradient_ema),  # None leaves without a gradient EMA.
            treedef.flatten_up_to(state.gradient_square_ema),
            treedef.flatten_up_to(state.update_ema),  # None leaves without an update EMA.
        )
        results = [self.update_one(g, m, v, u, count) for g, m, v, u in per_param]
        m, v, u, raws, smoothed, clipped = (
            (list(x) for x in zip(*results)) if results else ([],) * 6
        )
        new_state = AdastarState(count, *(treedef.unflatten(x) for x in (m, v, u)))
        return new_state, raws, treedef.unflatten(smoothed), clipped

    def print_statistics(self, count: Tensor, raws: list, clipped: list, verbosity: int) -> None:
        """adastar_optimizer's `verbosity` output of one step."""
        if verbosity >= 1:
            raw_rms = global_norm(raws) / jnp.sqrt(sum(r.size for r in raws))
            jax.debug.print("adastar step {} raw update rms {}", count, raw_rms)
        if verbosity >= 2 and self.raw_update_clipping_threshold is not None and raws:
            sizes = jnp.array([r.size for r in raws], jnp.float32)
            was_clipped = jnp.stack(clipped)
            jax.debug.print(
                "adastar step {} clipped raw updates: {} of {} weights, {} of the parameters",
                count,
                was_clipped.sum(),
                len(raws),
                (sizes * was_clipped).sum() / sizes.sum(),
            )


@register_configurable
def adastar_optimizer(
    learning_rate: ScheduleLike,
    *,
    gradient_ema_decay: Optional[float],
    gradient_ema_debias: Optional[bool],
    gradient_square_ema_decay: float,
    gradient_square_ema_debias: bool,
    eps: float,
    eps_square: float,
    raw_update_clipping_threshold: Optional[float],
    update_ema_decay: Optional[float],
    update_ema_debias: bool,
    weight_decay: float = 0.0,
    weight_decay_per_param_scale: Optional[ConfigOr[PerParamFn]] = None,
    update_schedule: ScheduleLike,
    adam_update_transformation: Optional[ConfigOr[PartitionedGradientTransformation]] = None,
    verbosity: int = 0,
) -> PartitionedGradientTransformation:
    """A generalization of Adam and Adafactor. Per step t (0 for the first update) and
    parameter p with gradient g:

        m = EMA(g; gradient_ema_decay, gradient_ema_debias)      (g itself if decay is None)
        v = EMA(g**2 + eps_square; gradient_square_ema_decay, gradient_square_ema_debias)
        r = m / (sqrt(v) + eps)                                   raw update
        r = r / max(1, rms(r) / raw_update_clipping_threshold)    (per parameter, if set)
        u = EMA(r; update_ema_decay, update_ema_debias)           (r itself if decay is None)
        u = adam_update_transformation(u)                         (if set, e.g. muP scales)
        p -= s_t * (learning_rate * u + weight_decay * scale * p),  s_t = update_schedule(t)

    EMA(x; d, debias) is e = d * e + (1 - d) * x from e = 0, divided by 1 - d**(t+1) when
    debias. Weight decay is decoupled from `learning_rate` and follows the schedule.
    `verbosity` >= 1 prints the step and the global RMS of the raw updates each step; >= 2
    also how many weights' raw updates were clipped and their share of the parameters.
    """
    rule = _AdastarRule(
        gradient_ema_decay=gradient_ema_decay,
        gradient_ema_debias=gradient_ema_debias,
        gradient_square_ema_decay=gradient_square_ema_decay,
        gradient_square_ema_debias=gradient_square_ema_debias,
        eps=eps,
        eps_square=eps_square,
        raw_update_clipping_threshold=raw_update_clipping_threshold,
        update_ema_decay=update_ema_decay,
        update_ema_debias=update_ema_debias,
    )
    rule.check()
    lr = for_update_count(learning_rate)
    schedule = for_update_count(update_schedule)
    extra = maybe_instantiate(adam_update_transformation)

    def init(params):
        values = param_values(params)
        zeros = jax.tree.map(jnp.zeros_like, values)
        state = rule.state(_count_init(), zeros, _nothing_like(values))
        return state, (extra.init(params) if extra is not None else EmptyState())

    def update(grads, state, params=None):
        opt, extra_state = state
        count = opt.count + 1
        new_state, raws, smoothed, clipped = rule.update_all(grads, opt, count)
        rule.print_statistics(count, raws, clipped, verbosity)
        s_t = schedule(opt.count)
        step, extra_state = _decayed_update(
            smoothed,
            grads,
            params,
            weight_decay=weight_decay,
            weight_decay_per_param_scale=weight_decay_per_param_scale,
            lr=lr(opt.count) * s_t,
            wd_multiplier=s_t,
            what="adastar_optimizer",
            extra=extra,
            extra_state=extra_state,
        )
        return step, (new_state, extra_state)

    def partition(param_specs):
        state = rule.state(_scalar_spec(), _like_params(param_specs), _nothing_like(param_specs))
        return state, (extra.partition(param_specs) if extra is not None else EmptyState())

    return PartitionedGradientTransformation(
        init, update, partition, lambda state: lr(state[0].count) * schedule(state[0].count)
    )


# ----- other optimizers -----


@register_configurable
def lion_optimizer(
    learning_rate: ScheduleLike,
    *,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 0.0,
    weight_decay_per_param_scale: Optional[ConfigOr[PerParamFn]] = None,
    mu_dtype: Any = None,
) -> PartitionedGradientTransformation:
    """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms") as
    optax.lion computes it, with a weight-decay scale per parameter:

        p -= lr_t * (sign(b1 * m + (1 - b1) * g) + weight_decay * scale * p)
        m = b2 * m + (1 - b2) * g

    The state is optax.scale_by_lion's (count and m).
    """
    lr = for_update_count(learning_rate)
    lion = _from_optax(optax.scale_by_lion(b1=b1, b2=b2, mu_dtype=mu_dtype))

    def update(grads, state, params=None):
        direction, new_state = lion.update(grads, state, params)
        lr_t = lr(state.count)
        step, _ = _decayed_update(
            direction,
            grads,
            params,
            weight_decay=weight_decay,
            weight_decay_per_param_scale=weight_decay_per_param_scale,
            lr=lr_t,
            wd_multiplier=lr_t,
            what="lion_optimizer",
        )
        return step, new_state

    return PartitionedGradientTransformation(
        lion.init, update, lion.partition, lambda state: lr(state.count)
    )


@register_configurable
def sgd_optimizer(
    learning_rate: ScheduleLike,
    *,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    weight_decay_per_param_scale: Optional[ConfigOr[PerParamFn]] = None,
) -> PartitionedGradientTransformation:
    """SGD with optional (Nesterov) momentum and L2 weight decay, as torch.optim.SGD:

        d = g + weight_decay * scale * p
        m = momentum * m + d;  d = d + momentum * m if nesterov else m   (if momentum > 0)
        p -= lr_t * d

    That is optax.sgd (optax.trace, then optax.scale_by_learning_rate) after our
    per-parameter L2 term; the state is a tuple of the three states (no trace without
    momentum).
    """
    lr = for_update_count(learning_rate)
    # The L2 term joins the gradient before the momentum.
    parts = [_add_decayed_weights(weight_decay, weight_decay_per_param_scale, "sgd_optimizer")]
    if momentum:
        parts.append(_from_optax(optax.trace(decay=momentum, nesterov=nesterov)))
    parts.append(_from_optax(optax.scale_by_learning_rate(lr)))
    return chain(*parts)._replace(learning_rate_at=lambda state: lr(state[-1].count))


class AdafactorState(NamedTuple):
    count: Tensor
    v_row: Nested  # Factored parameters: second moment averaged over the 'col' axis.
    v_col: Nested  # Factored parameters: second moment averaged over the 'row' axis.
    v: Nested  # Unfactored parameters: the full second moment.
    momentum: Nested  # None leaves when b1 is None.


def _factored_axes(
    info: _ParamInfo, *, factored: bool, min_dim_size_to_factor: int
) -> Optional[tuple[int, int]]:
    """(row axis, col axis) when Adafactor factors this parameter, else None."""
    if not factored or len(info.shape) < 2:
        return None
    if info.factorization is not None:
        if len(info.factorization) != len(info.shape):
            raise ValueError(
                f"{info.path}: factorization {info.factorization} does not match shape "
                f"{info.shape}"
            )
        if "row" in info.factorization and "col" in info.factorization:
            return info.factorization.index("row"), info.factorization.index("col")
        return None
    row, col = len(info.shape) - 2, len(info.shape) - 1
    if min(info.shape[row], info.shape[col]) < min_dim_size_to_factor:
        return None
    return row, col


@register_configurable
def adafactor_optimizer(
    learning_rate: ScheduleLike,
    *,
    b1: Optional[float] = None,
    b2: Optional[ScheduleLike] = None,
    eps: float = 1e-30,
    clipping_threshold: Optional[float] = 1.0,
    multiply_by_parameter_scale: bool = True,
    eps_scale: Optional[float] = 1e-3,
    factored: bool = True,
    min_dim_size_to_factor: Optional[int] = 128,
    dtype_momentum: Any = jnp.float32,
    weight_decay: Optional[float] = None,
    weight_decay_scale_by_learning_rate_exponent: Optional[float] = None,
    weight_decay_per_param_scale: Optional[ConfigOr[PerParamFn]] = None,
    apply_scale_by_trust_ratio: bool = False,
) -> PartitionedGradientTransformation:
    """Adafactor (Shazeer & Stern, 2018). Per step t and parameter p with gradient g:

        b2_t = b2(t) (None: 1 - (t + 1) ** -0.8, the paper's increasing decay)
        factored (a matrix, or a stack of them):
            R = b2_t * R + (1 - b2_t) * mean_col(g**2 + eps)
            C = b2_t * C + (1 - b2_t) * mean_row(g**2 + eps)
            v = R C / mean_row(R)
        otherwise: v = b2_t * v + (1 - b2_t) * (g**2 + eps)
        u = g / sqrt(v);  u = u / max(1, rms(u) / clipping_threshold)
        a_t = lr_t * max(eps_scale, rms(p)) if multiply_by_parameter_scale else lr_t
        u = a_t * u
        if b1: m = b1 * m + (1 - b1) * u;  u = m   (m kept in dtype_momentum)
        p -= u + lr_t ** e * weight_decay * scale * p
        (apply_scale_by_trust_ratio, LAMB: that step is first rescaled to the norm of p,
        x ||p|| / (||step|| + eps), unless either norm is 0)

    As AXLearn's (and optax's) order has it, the momentum averages steps (learning rate
    and parameter scale included), so a schedule weighs each gradient by its own step's
    rate. e is `weight_decay_scale_by_learning_rate_exponent` (1: decay scaled by
    the learning rate, as Lingvo and Praxis do; 0: not scaled), which a `weight_decay`
    (None: no decay) requires; `dtype_momentum` (float32 or bfloat16; None: the
    parameter's) stores m.

    Which axes are 'row' and 'col' comes from the spec's `factorization`; without one, the
    last two axes of a parameter whose last two dims are both >= min_dim_size_to_factor
    (leading axes, e.g. stacked layers, keep separate statistics). `factored=False`
    keeps full second moments everywhere. `eps_scale` and `min_dim_size_to_factor` are
    ours: AXLearn fixes them at 1e-3 and 128 and its dumps leave them out, so None (what
    a field read from such a dump holds) means those values.

    Ours, not optax.adafactor: optax factors a parameter's two largest axes and takes b2
    only as the exponent of its power-law decay.
    """
    exponent = weight_decay_scale_by_learning_rate_exponent
    dtype_momentum = _adafactor_momentum_dtype(dtype_momentum, weight_decay, exponent)
    eps_scale = 1e-3 if eps_scale is None else eps_scale
    min_dim_size_to_factor = 128 if min_dim_size_to_factor is None else min_dim_size_to_factor

    def momentum_dtype(shape, param_dtype):  # Scalars keep their own dtype, as AXLearn's.
        return dtype_momentum if dtype_momentum is not None and len(shape) else param_dtype

    lr = for_update_count(learning_rate)
    decay = for_update_count(
        b2 if b2 is not None else adafactor_decay_rate(), learning_rate=False
    )
    axes_of = functools.partial(
        _factored_axes, factored=factored, min_dim_size_to_factor=min_dim_size_to_factor
    )

    def init(params):
        v_row, v_col, v = _adafactor_layout(
            params,
            axes_of,
            lambda info: jnp.zeros(info.shape, info.dtype),
            lambda info, axis: jnp.zeros(info.shape[:axis] + info.shape[axis + 1 :], info.dtype),
        )
        values = param_values(params)
        momentum = (
            jax.tree.map(lambda x: jnp.zeros(x.shape, momentum_dtype(x.shape, x.dtype)), values)
            if b1 is not None
            else _nothing_like(values)
        )
        return AdafactorState(_count_init(), v_row, v_col, v, momentum)

    def update(grads, state, params=None):
        params = _require_params(params, "adafactor_optimizer")
        g_leaves, treedef = jax.tree_util.tree_flatten(grads)
        beta, lr_t = decay(state.count), lr(state.count)
        old_states = (state.v_row, state.v_col, state.v, state.momentum)
        per_param = zip(
            _param_infos(params),
            _values_list(params),
            g_leaves,
            *(treedef.flatten_up_to(x) for x in old_states),
        )
        new_r, new_c, new_v, new_m, directions = [], [], [], [], []
        for info, p, g, r, c, v, m in per_param:
            g = g.astype(jnp.float32)
            r, c, v, v_hat = _adafactor_second_moment(
                axes_of(info), jnp.square(g) + eps, r, c, v, beta
            )
            step_size = (
                lr_t * jnp.maximum(eps_scale, _rms(p)) if multiply_by_parameter_scale else lr_t
            )
            u, m = _adafactor_direction(
                g, v_hat, m, step_size=step_size, clipping_threshold=clipping_threshold, b1=b1
            )
            directions.append(u)
            for states, x in ((new_r, r), (new_c, c), (new_v, v), (new_m, m)):
                states.append(x)
        # The step size is already in `directions` (it may depend on the parameter).
        step, _ = _decayed_update(
            treedef.unflatten(directions),
            grads,
            params,
            weight_decay=weight_decay or 0.0,
            weight_decay_per_param_scale=weight_decay_per_param_scale,
            lr=1.0,
            wd_multiplier=lr_t**exponent if weight_decay else 0.0,
            what="adafactor_optimizer",
        )
        if apply_scale_by_trust_ratio:
            step = _trust_ratio_steps(step, params, eps, treedef)
        new_state = AdafactorState(
            state.count + 1, *(treedef.unflatten(x) for x in (new_r, new_c, new_v, new_m))
        )
        return step, new_state

    def partition(param_specs):
        v_row, v_col, v = _adafactor_layout(
            param_specs,
            axes_of,
            lambda info: _state_spec(info),
            lambda info, axis: _state_spec(info, drop_axes=(axis,)),
        )
        _, treedef = _flatten_params(param_specs)
        momentum = (
            treedef.unflatten(
                [_state_spec(info, dtype=momentum_dtype(info.shape, info.dtype))
                 for info in _param_infos(param_specs)]
            )
            if b1 is not None
            else _nothing_like(param_specs)
        )
        return AdafactorState(_scalar_spec(), v_row, v_col, v, momentum)

    return PartitionedGradientTransformation(
        init, update, partition, lambda state: lr(state.count)
    )


def _adafactor_momentum_dtype(
    dtype_momentum: Any, weight_decay: Optional[float], exponent: Optional[float]
) -> Any:
    """adafactor_optimizer's `dtype_momentum` as a dtype (None stays None), once its
    options are checked: a `weight_decay` needs its learning-rate exponent; the momentum is
    float32 or bfloat16."""
    if weight_decay is not None and exponent is None:
        raise ConfigError(
            "adafactor_optimizer.weight_decay_scale_by_learning_rate_exponent must be set when "
            f"weight_decay is (weight_decay={weight_decay!r}; 1: decay scaled by the learning "
            "rate, 0: not scaled)"
        )
    if dtype_momentum is None:
        return None
    dtype_momentum = jnp.dtype(dtype_momentum)
    if dtype_momentum not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ConfigError(
            f"adafactor_optimizer.dtype_momentum={dtype_momentum.name}: float32, bfloat16 "
            "or None (the parameter's); AXLearn's quantized int8/int16 momentum is not "
            "supported"
        )
    return dtype_momentum


def _trust_ratio_steps(steps: Nested, params: Nested, eps: float, treedef: Any) -> Nested:
    """Each parameter's step (of the gradients' `treedef`) rescaled to the parameter's
    norm (`_trust_ratio_scaled`)."""
    return treedef.unflatten(
        [
            _trust_ratio_scaled(s, p, eps)
            for s, p in zip(treedef.flatten_up_to(steps), _values_list(params))
        ]
    )


def _adafactor_layout(
    tree: Nested, axes_of: Callable, make_full: Callable, make_reduced: Callable
) -> tuple[Nested, Nested, Nested]:
    """Adafactor's second-moment state trees (v_row, v_col, v) for the parameters (or
    specs) `tree`: `make_reduced(info, axis)` (the statistics without `axis`) of factored
    parameters, `make_full(info)` of the others, None elsewhere."""
    infos = _param_infos(tree)
    _, treedef = _flatten_params(tree)
    v_row, v_col, v = [], [], []
    for info in infos:
        axes = axes_of(info)
        row, col = axes if axes is not None else (None, None)
        v_row.append(None if axes is None else make_reduced(info, col))
        v_col.append(None if axes is None else make_reduced(info, row))
        v.append(make_full(info) if axes is None else None)
    return tuple(treedef.unflatten(x) for x in (v_row, v_col, v))


def _adafactor_second_moment(
    axes: Optional[tuple[int, int]], g2: Tensor, r: Any, c: Any, v: Any, beta: Tensor
):
    """New (r, c, v) state of one parameter and its second-moment estimate, from its
    squared gradient `g2`; `axes`: its (row, col) axes if factored, else None."""
    if axes is None:
        v = (beta * v + (1 - beta) * g2).astype(v.dtype)
        return r, c, v, v
    row, col = axes
    r = (beta * r + (1 - beta) * jnp.mean(g2, axis=col)).astype(r.dtype)
    c = (beta * c + (1 - beta) * jnp.mean(g2, axis=row)).astype(c.dtype)
    # r lacks the col axis and c the row axis: put them back to broadcast.
    r_mean = jnp.mean(r, axis=row if row < col else row - 1)
    estimate = (
        jnp.expand_dims(r, col)
        * jnp.expand_dims(c, row)
        / jnp.expand_dims(r_mean, sorted((row, col)))
    )
    return r, c, v, estimate


def _adafactor_direction(
    g: Tensor,
    v_hat: Tensor,
    m: Any,
    *,
    step_size: Tensor,
    clipping_threshold: Optional[float],
    b1: Optional[float],
):
    """(step before weight decay, new momentum state) of one parameter: g / sqrt(v_hat),
    clipped to RMS `clipping_threshold`, times `step_size`, then averaged into the
    momentum if `b1` is set."""
    u = g / jnp.sqrt(v_hat)
    if clipping_threshold is not None:
        u = u / jnp.maximum(1.0, _rms(u) / clipping_threshold)
    u = step_size * u
    if b1 is not None:  # The float32 average steps; m stores it in its dtype.
        u = b1 * m.astype(jnp.float32) + (1 - b1) * u
        m = u.astype(m.dtype)
    return u, m


# ----- Muon -----

# Default routing of muon_optimizer: embeddings and an untied LM head go to AdamW, other
# weights ("weight" is the name of every matrix in this library) to Muon, and the rest
# (norm scales, biases) to AdamW. Parameters that are not matrices always go to AdamW.
DEFAULT_MUON_RULES = (
    (".*emb.*", "adamw"),
    (".*lm_head.*", "adamw"),
    (".*weight", "muon"),
    (".*", "adamw"),
)
# Coefficients of the quintic Newton-Schulz iteration of the public Muon write-ups.
_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def _normalize_axes(axes: Union[int, Sequence[int]], ndim: int) -> tuple[int, ...]:
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    return tuple(a % ndim for a in axes)


def _matrix_layout(info: _ParamInfo) -> Optional[tuple[tuple[int, ...], int, int, int]]:
    """(permutation, batch, fan_in, fan_out) that views the parameter as a batch of
    [fan_in, fan_out] matrices; None if it is not a matrix (fewer than two dims).

    With fan axes from the spec, 'in' and 'out' axes are flattened (a [D, N, H] attention
    weight becomes [D, N*H]) and every other axis is a batch axis (stacked layers). Without
    them, the last two axes are the matrix and leading axes are batch axes.
    """
    ndim = len(info.shape)
    if ndim < 2:
        return None
    if info.fan_axes is not None:
        in_axes = _normalize_axes(info.fan_axes.in_axis, ndim)
        out_axes = _normalize_axes(info.fan_axes.out_axis, ndim)
    else:
        in_axes, out_axes = (ndim - 2,), (ndim - 1,)
    batch_axes = tuple(a for a in range(ndim) if a not in in_axes + out_axes)
    size = lambda axes: int(np.prod([info.shape[a] for a in axes]))  # noqa: E731
    return batch_axes + in_axes + out_axes, size(batch_axes), size(in_axes), size(out_axes)


def newton_schulz_orthogonalize(x: Tensor, *, steps: int = 5, dtype: Any = jnp.bfloat16):
    """Approximately U V^T of each matrix x = U S V^T over the last two axes, by the
    quintic Newton-Schulz iteration X <- aX + (bA + cA^2)X with A = X X^T, from X
    normalized to Frobenius norm <= 1. Runs in `dtype` (bf16 is safe: the iteration
    only needs singular values roughly in (0, 1]); returns float32."""
    a, b, c = _NS_COEFFICIENTS
    x32 = x.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(jnp.square(x32), axis=(-2, -1), keepdims=True))
    transpose = x.shape[-2] > x.shape[-1]  # Iterate on the wide side: A is the smaller Gram.
    y = x32 / (norm + 1e-7)
    if transpose:
        y = jnp.swapaxes(y, -1, -2)
    y = y.astype(dtype)
    for _ in range(steps):
        gram = y @ jnp.swapaxes(y, -1, -2)
        poly = b * gram + c * (gram @ gram)
        y = a * y + poly @ y
    if transpose:
        y = jnp.swapaxes(y, -1, -2)
    return y.astype(jnp.float32)


class MuonState(NamedTuple):
    count: Tensor
    momentum: Nested  # Muon parameters; None elsewhere.
    mu: Nested  # AdamW parameters: first moment; None elsewhere.
    nu: Nested  # AdamW parameters: second moment; None elsewhere.


@register_configurable
def muon_optimizer(
    learning_rate: ScheduleLike,
    *,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_dtype: Any = jnp.bfloat16,
    matched_adamw_rms: Optional[float] = None,
    weight_decay: float = 0.0,
    weight_decay_per_param_scale: Optional[ConfigOr[PerParamFn]] = None,
    adamw_learning_rate: Optional[ScheduleLike] = None,
    adamw_b1: float = 0.9,
    adamw_b2: float = 0.95,
    adamw_eps: float = 1e-8,
    muon_rules: Optional[Sequence[tuple[str, str]]] = None,
) -> PartitionedGradientTransformation:
    """Muon (MomentUm Orthogonalized by Newton-Schulz) for weight matrices, AdamW elsewhere.

    For a Muon parameter, viewed as [batch, fan_in, fan_out] matrices (see _matrix_layout):

        m = momentum * m + (1 - momentum) * g
        d = (1 - momentum) * g + momentum * m if nesterov else m
        o = NewtonSchulz(d) (per matrix, `ns_steps` quintic steps in `ns_dtype`)
        o *= sqrt(max(1, fan_out / fan_in))                 (matched_adamw_rms None)
          or matched_adamw_rms * sqrt(max(fan_in, fan_out))  (update RMS like AdamW's)
        p -= lr_t * (o + weight_decay * scale * p)

    Other parameters use AdamW (b1, b2, eps from `adamw_*`, learning rate
    `adamw_learning_rate`, None: `learning_rate`) with the same decoupled-by-lr weight decay.
    `muon_rules`: (regex, 'muon' | 'adamw') pairs, the first that fully matches a
    parameter's path decides (None: DEFAULT_MUON_RULES; no match: 'adamw').
    """
    lr = for_update_count(learning_rate)
    adam_lr = for_update_count(adamw_learning_rate) if adamw_learning_rate is not None else lr
    rules = _muon_rules(muon_rules if muon_rules is not None else DEFAULT_MUON_RULES)

    def init(params):
        zeros = lambda info: jnp.zeros(info.shape, info.dtype)  # noqa: E731
        return MuonState(_count_init(), *_muon_layout(params, rules, zeros, zeros))

    def update(grads, state, params=None):
        params = _require_params(params, "muon_optimizer")
        g_leaves, treedef = jax.tree_util.tree_flatten(grads)
        decay = _weight_decay_terms(
            params,
            grads,
            weight_decay=weight_decay,
            weight_decay_per_param_scale=weight_decay_per_param_scale,
            what="muon_optimizer",
        )
        count = state.count + 1
        muon_lr, adamw_lr = lr(state.count), adam_lr(state.count)
        per_param = zip(
            _param_infos(params),
            g_leaves,
            decay,
            *(treedef.flatten_up_to(x) for x in (state.momentum, state.mu, state.nu)),
        )
        new_buf, new_mu, new_nu, steps = [], [], [], []
        for info, g, w, buf, mu, nu in per_param:
            g32 = g.astype(jnp.float32)
            if _uses_muon(info, rules):
                d, buf = _muon_momentum(g32, buf, momentum=momentum, nesterov=nesterov)
                lr_t = muon_lr
                d = _muon_orthogonalized(
                    info, d, ns_steps=ns_steps, ns_dtype=ns_dtype,
                    matched_adamw_rms=matched_adamw_rms,
                )
            else:
                d, mu, nu = _muon_adamw_direction(
                    g32, mu, nu, b1=adamw_b1, b2=adamw_b2, eps=adamw_eps, count=count
                )
                lr_t = adamw_lr
            # Weight decay is scaled by the learning rate of the parameter's group.
            step = lr_t * (d if w is None else d + w)
            steps.append((-step).astype(g.dtype))
            for states, x in ((new_buf, buf), (new_mu, mu), (new_nu, nu)):
                states.append(x)
        new_state = MuonState(count, *(treedef.unflatten(x) for x in (new_buf, new_mu, new_nu)))
        return treedef.unflatten(steps), new_state

    def partition(param_specs):
        specs = _muon_layout(param_specs, rules, _state_spec, _state_spec)
        return MuonState(_scalar_spec(), *specs)

    return PartitionedGradientTransformation(
        init, update, partition, lambda state: lr(state.count)
    )


def _muon_rules(muon_rules: Sequence[tuple[str, str]]) -> list[tuple[re.Pattern, str]]:
    """muon_optimizer's `muon_rules`, compiled; a target other than 'muon' or 'adamw' is
    a ConfigError naming the rule."""
    rules = []
    for i, (pattern, target) in enumerate(muon_rules):
        if target not in ("muon", "adamw"):
            raise ConfigError(f"muon_rules[{i}]: target must be 'muon' or 'adamw', got {target!r}")
        rules.append((re.compile(pattern), target))
    return rules


def _uses_muon(info: _ParamInfo, rules: list[tuple[re.Pattern, str]]) -> bool:
    """Whether Muon updates this parameter: a matrix whose path the first fully matching
    rule sends to 'muon' (no rule matching: AdamW)."""
    if _matrix_layout(info) is None:
        return False
    for regex, target in rules:
        if regex.fullmatch(info.path):
            return target == "muon"
    return False


def _muon_layout(
    tree: Nested, rules: list[tuple[re.Pattern, str]], muon_fn: Callable, adam_fn: Callable
) -> tuple[Nested, Nested, Nested]:
    """Muon's three state trees (momentum, mu, nu) for the parameters (or specs) `tree`:
    `muon_fn(info)` in momentum for Muon parameters, `adam_fn(info)` in mu and nu for the
    others, None elsewhere."""
    _, treedef = _flatten_params(tree)
    momentum, mu, nu = [], [], []
    for info in _param_infos(tree):
        muon = _uses_muon(info, rules)
        momentum.append(muon_fn(info) if muon else None)
        mu.append(None if muon else adam_fn(info))
        nu.append(None if muon else adam_fn(info))
    return tuple(treedef.unflatten(x) for x in (momentum, mu, nu))


def _muon_momentum(g32: Tensor, buf: Tensor, *, momentum: float, nesterov: bool):
    """(direction before orthogonalization, new momentum state) of one Muon parameter."""
    buf32 = momentum * buf + (1 - momentum) * g32
    d = (1 - momentum) * g32 + momentum * buf32 if nesterov else buf32
    return d, buf32.astype(buf.dtype)


def _muon_orthogonalized(
    info: _ParamInfo,
    d: Tensor,
    *,
    ns_steps: int,
    ns_dtype: Any,
    matched_adamw_rms: Optional[float],
) -> Tensor:
    """`d` orthogonalized per [fan_in, fan_out] matrix (`_matrix_layout`) and scaled: by
    sqrt(max(1, fan_out / fan_in)), or to AdamW's update RMS with `matched_adamw_rms`."""
    perm, batch, fan_in, fan_out = _matrix_layout(info)
    matrices = jnp.transpose(d, perm).reshape(batch, fan_in, fan_out)
    o = newton_schulz_orthogonalize(matrices, steps=ns_steps, dtype=ns_dtype)
    if matched_adamw_rms is None:
        o = o * np.sqrt(max(1.0, fan_out / fan_in))
    else:
        o = o * (matched_adamw_rms * np.sqrt(max(fan_in, fan_out)))
    permuted_shape = tuple(info.shape[a] for a in perm)
    return jnp.transpose(o.reshape(permuted_shape), np.argsort(perm))


def _muon_adamw_direction(
    g32: Tensor, mu: Tensor, nu: Tensor, *, b1: float, b2: float, eps: float, count: Tensor
):
    """(direction, new mu, new nu) of a parameter muon_optimizer leaves to AdamW: the
    debiased first moment over the root of the debiased second moment plus eps."""
    mu = (b1 * mu + (1 - b1) * g32).astype(mu.dtype)
    nu = (b2 * nu + (1 - b2) * g32 * g32).astype(nu.dtype)
    v_hat = _debias(nu, b2, count)
    return _debias(mu, b1, count) / (jnp.sqrt(v_hat) + eps), mu, nu


def learning_rate_at(
    transformation: PartitionedGradientTransformation, state: Any
) -> Optional[Tensor]:
    """The learning rate `transformation` will use for its next update (None if unknown)."""
    if transformation.learning_rate_at is None:
        return None
    return transformation.learning_rate_at(state)


def find_states(state: Any, state_type: type) -> list[Any]:
    """Every sub-state of type `state_type` in a (chained, nested) optimizer state."""
    leaves = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, state_type))
    return [x for x in leaves if isinstance(x, state_type)]
