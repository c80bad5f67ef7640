"""The learner: gradients, optimizer updates, parameter EMA and their summaries.

`Learner` wraps one optimizer (a `PartitionedGradientTransformation` config from
`axlearn.common.optimizers`) and gives the trainer four calls:

    specs = learner.create_state_partition_specs(param_specs)   # shard the learner state
    state = learner.init(params, param_specs=param_specs)
    loss, aux, grads = learner.compute_gradients(loss_fn, params, inputs, prng_key)
    params, state, summaries = learner.update(params, grads, state, param_specs=param_specs)

`update_rules` freeze parameters by path; `compute_gradients(..., num_microbatches=k)`
(k from the trainer's `per_device_microbatch_size`) splits a batch into microbatches
whose averaged gradients equal the full batch's.
`weight_decay_scales` gives each parameter's effective weight-decay scale (the
`_regularizer.txt` golden files).

Schedules are stepped as AXLearn's learner steps them: the update after c updates is
step c + 1. The learner state records that rule as `schedule_step_base` (1); a state
restored from a checkpoint written before the rule lacks it, and the trainer restores it
with base 0 (`restore_with_legacy_schedule_step`), the old rule, under which its
learning-rate curve goes on as it was (and is saved so, for later restarts).
"""

import functools
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp

from axlearn.common import schedule
from axlearn.common.base_layer import ParameterSpec
from axlearn.common.config import (
    REQUIRED,
    ConfigBase,
    ConfigError,
    InstantiableConfig,
    Required,
    config_class,
    config_for_function,
    maybe_instantiate,
)
from axlearn.common.module import Module, Tensor
from axlearn.common.optimizers import (
    SkipClipState,
    find_states,
    global_norm,
    is_param_leaf,
    learning_rate_at,
    param_ema,
    with_param_specs,
)
from axlearn.common.summary import WeightedScalar
from axlearn.common.utils import flatten_with_paths

Nested = Any
# loss_fn(params, inputs, prng_key) -> (loss, aux).
LossFn = Callable[[Nested, Nested, Optional[Tensor]], tuple[Tensor, Any]]

UPDATE_TYPES = ("all", "no_update")
_log = logging.getLogger(__name__)


class Learner(Module):
    """Computes gradients and applies the optimizer to the model parameters."""

    @config_class
    class Config(Module.Config):
        """Configures Learner."""

        # A config of a PartitionedGradientTransformation (see axlearn.common.optimizers).
        optimizer: Required[InstantiableConfig] = REQUIRED
        # A config of an EMA transformation of the parameters; param_ema(decay=None) keeps none.
        ema: InstantiableConfig = config_for_function(param_ema)
        # Adds parameter_norm, update_norm and parameter_norm/<path>, gradient_norm/<path>
        # and update_norm/<path> summaries to every step (on GPU at the cost of a copy of the
        # state a step).
        enable_per_variable_summaries: bool = False
        # (regex, 'all' | 'no_update') pairs; the first that fully matches a parameter's
        # '/'-path decides. None or no match: 'all'. 'no_update' parameters stay unchanged,
        # have no optimizer state and are not differentiated (their gradients are None).
        update_rules: Optional[Sequence[tuple[str, str]]] = None
        # True: a step whose loss is NaN or infinite leaves the parameters and the learner
        # state as they were, and counts in the 'skipped_steps' summary (the trainer then
        # treats it as a bad step, not a failed run). None/False: it updates as usual.
        ignore_undefined_loss: Optional[bool] = None

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        self._rules = []
        for i, rule in enumerate(cfg.update_rules or ()):
            pattern, update_type = rule
            if update_type not in UPDATE_TYPES:
                raise ConfigError(
                    f"{self.path()}.update_rules[{i}]: update type must be one of "
                    f"{UPDATE_TYPES}, got {update_type!r}"
                )
            try:
                self._rules.append((re.compile(pattern), update_type))
            except re.error as e:
                raise ConfigError(f"{self.path()}.update_rules[{i}]: bad regex {pattern!r}: {e}")
        self._optimizer = maybe_instantiate(cfg.optimizer)
        self._ema = maybe_instantiate(cfg.ema)

    @property
    def optimizer(self):
        """The PartitionedGradientTransformation built from `config.optimizer`."""
        return self._optimizer

    def update_type(self, path: str) -> str:
        """'all' or 'no_update' for the parameter at '/'-joined `path`."""
        for regex, update_type in self._rules:
            if regex.fullmatch(path):
                return update_type
        return "all"

    def _trainable(self, tree: Nested) -> Nested:
        """`tree` with None in place of every 'no_update' parameter."""
        if not self._rules:
            return tree
        path_leaves = flatten_with_paths(tree, is_leaf=is_param_leaf)
        treedef = jax.tree_util.tree_structure(tree, is_leaf=is_param_leaf)
        return treedef.unflatten(
            [leaf if self.update_type(path) == "all" else None for path, leaf in path_leaves]
        )

    def create_state_partition_specs(self, model_param_specs: Nested) -> dict[str, Any]:
        """The learner state's structure with ParameterSpec leaves (shape, dtype and
        mesh_axes; `.partition_spec` gives the jax PartitionSpec). Optimizer state is
        sharded like the parameter it belongs to; step counters are replicated scalars."""
        specs = dict(
            optimizer=self._optimizer.partition(self._trainable(model_param_specs)),
            ema=self._ema.partition(model_param_specs),
            schedule_step_base=ParameterSpec(shape=[], dtype=jnp.int32, mesh_axes=()),
        )
        if self._config.ignore_undefined_loss:
            specs["undefined_loss_steps"] = ParameterSpec(shape=[], dtype=jnp.int32, mesh_axes=())
        return specs

    def init(self, model_params: Nested, *, param_specs: Optional[Nested] = None) -> dict:
        """The initial learner state: {'optimizer': ..., 'ema': ..., 'schedule_step_base':
        schedule.UPDATE_STEP_BASE} (see the module docstring).

        Pass the model's `param_specs` (as given to create_state_partition_specs) so the
        optimizer sees weight-decay scales, factorizations and fan axes; without them it
        treats every parameter as a plain array (scale 1, shape-based choices).
        """
        params = self._with_specs(model_params, param_specs)
        state = dict(
            optimizer=self._optimizer.init(self._trainable(params)),
            ema=self._ema.init(model_params),
            schedule_step_base=jnp.asarray(schedule.UPDATE_STEP_BASE, jnp.int32),
        )
        if self._config.ignore_undefined_loss:
            state["undefined_loss_steps"] = jnp.zeros([], jnp.int32)  # Steps left undone.
        return state

    def _with_specs(self, model_params: Nested, param_specs: Optional[Nested]) -> Nested:
        return model_params if param_specs is None else with_param_specs(model_params, param_specs)

    def compute_gradients(
        self,
        loss_fn: LossFn,
        model_params: Nested,
        inputs: Nested,
        prng_key: Optional[Tensor],
        *,
        num_microbatches: int = 1,
    ) -> tuple[Tensor, Any, Nested]:
        """(loss, aux, grads) of `loss_fn(params, inputs, prng_key) -> (loss, aux)`.

        With k = `num_microbatches` > 1 (the trainer derives it), the leading (batch) axis of
        every array in `inputs` is split into k equal microbatches (`split_microbatches`),
        run one after another under jax.lax.scan with keys fold_in(prng_key, i); loss and
        gradients are averaged over microbatches, so a loss that is a mean over examples
        gives the full-batch result. aux leaves are
        averaged too, except WeightedScalars (combined by weight) and integer leaves (summed).
        """
        if self._rules:
            # Only the differentiated parameters (`is_differentiated`) enter as arguments:
            # the others are constants of the loss, so no weight gradient of theirs is ever
            # computed, and their place in `grads` holds None.
            loss_fn = self._loss_of_differentiated(loss_fn, model_params)
            model_params = self._differentiated(model_params)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        k = num_microbatches
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"{self.path()}: num_microbatches must be an int >= 1, got {k!r}")
        if k == 1:
            (loss, aux), grads = grad_fn(model_params, inputs, prng_key)
            return loss, aux, grads

        for path, x in flatten_with_paths(inputs):
            shape = tuple(getattr(x, "shape", ()))
            if not shape or shape[0] % k:
                raise ValueError(
                    f"{self.path()}: input '{path}' of shape {shape} cannot be split into "
                    f"{k} gradient accumulation microbatches along its leading axis"
                )
        microbatches = jax.tree.map(functools.partial(split_microbatches, k=k), inputs)
        zero_grads = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), model_params)

        def step(carry, xs):
            loss_sum, grad_sum = carry
            i, batch = xs
            key = None if prng_key is None else jax.random.fold_in(prng_key, i)
            (loss, aux), grads = grad_fn(model_params, batch, key)
            grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
            return (loss_sum + loss.astype(jnp.float32), grad_sum), aux

        (loss_sum, grad_sum), auxes = jax.lax.scan(
            step, (jnp.zeros([], jnp.float32), zero_grads), (jnp.arange(k), microbatches)
        )
        grads = jax.tree.map(
            lambda g, p: (g / k).astype(jnp.result_type(p)), grad_sum, model_params
        )
        return loss_sum / k, _combine_microbatches(auxes), grads

    def is_differentiated(self, path: str) -> bool:
        """Whether `compute_gradients` differentiates the parameter at '/'-joined `path`:
        those it updates ('all')."""
        return self.update_type(path) == "all"

    def _differentiated(self, tree: Nested) -> Nested:
        """`tree` with None in place of every parameter that is not differentiated."""
        path_leaves = flatten_with_paths(tree, is_leaf=is_param_leaf)
        treedef = jax.tree_util.tree_structure(tree, is_leaf=is_param_leaf)
        return treedef.unflatten(
            [leaf if self.is_differentiated(path) else None for path, leaf in path_leaves]
        )

    def _loss_of_differentiated(self, loss_fn: LossFn, model_params: Nested) -> LossFn:
        """loss_fn as a function of the differentiated parameters (None elsewhere), the
        others taken from `model_params`."""
        leaves, treedef = jax.tree_util.tree_flatten(model_params)
        paths = [path for path, _ in flatten_with_paths(model_params)]
        constant = [not self.is_differentiated(path) for path in paths]

        def differentiated_loss(differentiated, inputs, prng_key):
            given = treedef.flatten_up_to(differentiated)
            merged = [x if c else g for x, g, c in zip(leaves, given, constant)]
            return loss_fn(treedef.unflatten(merged), inputs, prng_key)

        return differentiated_loss

    def update(
        self,
        model_params: Nested,
        grads: Nested,
        learner_state: dict,
        *,
        param_specs: Optional[Nested] = None,
        loss: Optional[Tensor] = None,
    ) -> tuple[Nested, dict, dict[str, Tensor]]:
        """Applies one optimizer step: (new_params, new_learner_state, summaries).

        With `ignore_undefined_loss`, a non-finite `loss` (the step's) undoes the step.

        summaries: 'learning_rate' (of this step; absent if the optimizer has none),
        'gradient_norm' (of the updated parameters' gradients, before clipping),
        'skipped_steps' (steps skipped by skip_and_clip_by_global_norm so far; 0 without
        it), and with enable_per_variable_summaries 'parameter_norm' (after the step),
        'update_norm' and all three norms per parameter path.

        The norms of the new parameters and of the update are opt-in: they read every
        parameter once more, and a norm that XLA fuses into the update makes it copy every
        parameter and optimizer state instead of updating them in place. The trainer
        reports the parameter norm where it logs (`SpmdTrainer.parameter_norm`).
        """
        params = self._trainable(self._with_specs(model_params, param_specs))
        trainable_grads = self._trainable(grads)
        opt_state = learner_state["optimizer"]
        # A state without the leaf (built by hand, not by init) steps as AXLearn's.
        step_base = learner_state.get("schedule_step_base", schedule.UPDATE_STEP_BASE)
        with schedule.update_step_base(step_base):
            updates, new_opt_state = self._optimizer.update(trainable_grads, opt_state, params)
            lr = learning_rate_at(self._optimizer, opt_state)

        param_leaves, treedef = jax.tree_util.tree_flatten(model_params)
        update_leaves = treedef.flatten_up_to(updates)  # None for 'no_update' parameters.
        full_updates = [
            jnp.zeros_like(p) if u is None else u.astype(p.dtype)
            for p, u in zip(param_leaves, update_leaves)
        ]
        # 'no_update' parameters pass through as they are (no read-modify-write).
        new_params = treedef.unflatten(
            [p if u is None else p + d for p, u, d in zip(param_leaves, update_leaves, full_updates)]
        )
        full_updates = treedef.unflatten(full_updates)
        _, new_ema = self._ema.update(full_updates, learner_state["ema"], model_params)
        summaries = {}
        if lr is not None:
            summaries["learning_rate"] = lr
        summaries["gradient_norm"] = global_norm(trainable_grads)
        skipped = [s.nonvalid_count for s in find_states(new_opt_state, SkipClipState)]
        summaries["skipped_steps"] = sum(skipped) if skipped else jnp.zeros([], jnp.int32)
        if self._config.enable_per_variable_summaries:
            summaries["parameter_norm"] = global_norm(new_params)
            summaries["update_norm"] = global_norm(updates)
            for name, tree in (
                ("parameter_norm", new_params),
                ("gradient_norm", grads),
                ("update_norm", full_updates),
            ):
                for path, x in flatten_with_paths(tree):
                    summaries[f"{name}/{path}"] = global_norm(x)
        new_state = dict(optimizer=new_opt_state, ema=new_ema)
        if "schedule_step_base" in learner_state:
            new_state["schedule_step_base"] = learner_state["schedule_step_base"]
        if self._config.ignore_undefined_loss:
            new_params, new_state, summaries = self._undo_if_undefined(
                loss, (model_params, learner_state), (new_params, new_state), summaries
            )
        return new_params, new_state, summaries

    def _undo_if_undefined(self, loss, old, new, summaries):
        """(params, state, summaries) of the step, or of the step undone if `loss` is not
        finite (ignore_undefined_loss)."""
        if loss is None:
            raise ValueError(f"{self.path()}.ignore_undefined_loss: update() needs the loss")
        defined = jnp.isfinite(loss)
        (old_params, old_state), (new_params, new_state) = old, new
        new_params = jax.tree.map(lambda n, o: jnp.where(defined, n, o), new_params, old_params)
        counter = old_state["undefined_loss_steps"] + jnp.where(defined, 0, 1).astype(jnp.int32)
        new_state = jax.tree.map(
            lambda n, o: jnp.where(defined, n, o),
            new_state,
            {k: v for k, v in old_state.items() if k != "undefined_loss_steps"},
        )
        new_state["undefined_loss_steps"] = counter
        summaries = dict(summaries, skipped_steps=summaries["skipped_steps"] + counter)
        return new_params, new_state, summaries


def split_microbatches(x: Tensor, *, k: int) -> Tensor:
    """[B, ...] -> [k, B / k, ...], where microbatch i holds rows i, i + k, i + 2k, ...

    Strided rather than contiguous because the batch is sharded in contiguous blocks:
    each device's block of B / n rows then holds B / (n k) rows of every microbatch, so
    the split moves no data between devices. (Contiguous microbatches would each live on
    n / k of the devices, and every microbatch would first be resharded.)
    """
    return jnp.swapaxes(x.reshape((x.shape[0] // k, k) + x.shape[1:]), 0, 1)


def _combine_microbatches(auxes: Nested) -> Nested:
    """Reduces aux outputs stacked over microbatches (leading axis)."""

    def combine(x):
        if isinstance(x, WeightedScalar):
            weight = jnp.sum(x.weight, axis=0)
            mean = jnp.sum(x.mean * x.weight, axis=0) / jnp.maximum(weight, 1e-30)
            return WeightedScalar(mean=mean, weight=weight)
        if jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.mean(x, axis=0)
        return jnp.sum(x, axis=0)

    return jax.tree.map(combine, auxes, is_leaf=lambda x: isinstance(x, WeightedScalar))


# ----- effective weight-decay scales -----


def _per_param_weight_decay_fns(optimizer_cfg: Any) -> list[Callable]:
    """The weight_decay_per_param_scale functions set anywhere in an optimizer config."""
    fns = []

    def enter(path: str, value: Any) -> bool:
        if isinstance(value, ConfigBase) and "weight_decay_per_param_scale" in value:
            scale = value.weight_decay_per_param_scale
            if scale is not None:
                fns.append(maybe_instantiate(scale))
        return True

    if isinstance(optimizer_cfg, ConfigBase):
        optimizer_cfg.visit(lambda path, value: None, enter)
    return fns


def weight_decay_scales(
    optimizer_cfg_or_learner: Union[InstantiableConfig, Learner.Config, Learner],
    param_specs: Nested,
) -> dict[str, float]:
    """Parameter path -> its effective weight-decay scale, as the `_regularizer.txt`
    golden files list it (`golden_text.regularizer_lines`): the spec's
    weight_decay_scale (None: 1) times every weight_decay_per_param_scale set in the
    optimizer config, and 0 for parameters the learner's update rules freeze."""
    learner = None
    if isinstance(optimizer_cfg_or_learner, Learner):
        learner = optimizer_cfg_or_learner
        optimizer_cfg = learner.config.optimizer
    elif isinstance(optimizer_cfg_or_learner, Learner.Config):
        learner = optimizer_cfg_or_learner.clone(name="learner").instantiate(parent=None)
        optimizer_cfg = optimizer_cfg_or_learner.optimizer
    else:
        optimizer_cfg = optimizer_cfg_or_learner
    path_leaves = flatten_with_paths(param_specs, is_leaf=is_param_leaf)
    paths = [p for p, _ in path_leaves]
    scales = [1.0 if s.weight_decay_scale is None else float(s.weight_decay_scale)
              for _, s in path_leaves]
    for fn in _per_param_weight_decay_fns(optimizer_cfg):
        extra = jax.tree.leaves(fn(param_specs))
        scales = [s * float(e) for s, e in zip(scales, extra)]
    if learner is not None:
        scales = [s if learner.update_type(p) == "all" else 0.0 for p, s in zip(paths, scales)]
    return dict(zip(paths, scales))


def restore_with_legacy_schedule_step(
    restore: Callable[[Any], tuple[Optional[int], Any, Any]], template: Any
) -> tuple[Optional[int], Any, Any]:
    """`restore(template)` -> (step, state, extra), the checkpointer's restore of a trainer
    state ({'learner': ..., ...}); where the checkpoint lacks only the learner's
    `schedule_step_base` (it was written before schedules stepped as AXLearn's), the rest
    is restored and the base is `schedule.LEGACY_UPDATE_STEP_BASE`: the run keeps the rule
    it trained under. Any other mismatch raises the full restore's error."""
    if "schedule_step_base" not in template.get("learner", {}):
        return restore(template)
    try:
        return restore(template)
    except ValueError as error:
        learner = dict(template["learner"])
        base_template = learner.pop("schedule_step_base")
        try:
            step, restored, extra = restore(dict(template, learner=learner))
        except ValueError:
            raise error from None
    _log.info(
        "Step %s was saved before schedules stepped as AXLearn's (the update count + 1): "
        "this run keeps the old rule (the count), so its learning-rate curve goes on as it was",
        step,
    )
    base = jnp.asarray(schedule.LEGACY_UPDATE_STEP_BASE, jnp.int32)
    sharding = getattr(base_template, "sharding", None)
    if sharding is not None:
        base = jax.device_put(base, sharding)
    restored = dict(restored, learner=dict(restored["learner"], schedule_step_base=base))
    return step, restored, extra
