"""Pipeline: a stack of identical stage layers run as pipeline stages (GPipe, GSPMD).

The stage layer's parameters are stacked on a new leading axis of size `num_layers` (the
number of stages), sharded over the 'pipeline' mesh axis, so each device group along
'pipeline' holds one stage. The batch is split into `num_microbatches` microbatches
[M, microbatch_size, ...]. Each iteration of a `jax.lax.scan` runs every stage once, in
parallel (`jax.vmap` over the stage axis, `spmd_axis_name='pipeline'`): stage 0 takes the
next microbatch, stage n > 0 the output of stage n - 1 from the previous iteration. That
shift along the stage axis is a roll of a pipeline-sharded array, which XLA lowers to a
collective permute between neighbouring stages. After num_stages + num_microbatches - 1
iterations the last stage has produced every microbatch's output.

The schedule (`GPipeSchedule`, `StreamSchedule`) decides where the microbatches wait and
how the last stage's outputs are gathered; both compute the same function. Each iteration
is rematerialized: the backward pass recomputes the stages from the iteration's inputs,
and the stage layer's own `remat_spec` applies inside that recomputation.

Stages fed a bubble (before their first or after their last microbatch) compute on
placeholder inputs whose results never reach the output; no gradient flows through them,
so that non-finite placeholder results cannot leak into the update.

What the stage layer adds to its output collection comes back per stage and microbatch:
summaries averaged over the microbatches ([num_stages, ...], as `Repeat` stacks its
layers'), module outputs as [num_stages, num_microbatches, ...]. State updates are not
supported (a stage runs many times a step; which update should win is undefined).
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from axlearn.common.base_layer import BaseLayer, is_parameter_spec, stacked_parameter_spec
from axlearn.common.config import REQUIRED, ConfigError, Configurable, Required, config_class
from axlearn.common.module import (
    Module,
    OutputCollection,
    Tensor,
    set_current_context,
    stacked_layer_context,
)
from axlearn.common.sharding import current_mesh_axes

PIPELINE_AXIS = "pipeline"
# The checkpoint name of the stages' inputs in one iteration.
_STAGE_INPUT = "pipeline_stage_input"

# One stage's computation: (stage params, stage input carry, PRNG key) -> (output carry,
# output collection). The schedules vmap it over the stage axis.
StageFn = Callable[[Any, Any, Optional[Tensor]], tuple[Any, OutputCollection]]


def _shard_stages(x: Tensor) -> Tensor:
    """Constrains the leading (stage) axis of `x` to the 'pipeline' mesh axis, leaving the
    other axes to the partitioner; a no-op without a mesh that has 'pipeline'."""
    if PIPELINE_AXIS not in current_mesh_axes():
        return x
    spec = PartitionSpec(PIPELINE_AXIS, *([PartitionSpec.UNCONSTRAINED] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, spec)


def _vmap_stages(fn: StageFn) -> StageFn:
    """`fn` vmapped over the stage axis, which is placed on 'pipeline' where the mesh has it
    (so the stage layer's own sharding constraints keep that axis)."""
    if PIPELINE_AXIS in current_mesh_axes():
        return jax.vmap(fn, spmd_axis_name=PIPELINE_AXIS)
    return jax.vmap(fn)


def _stage_zeros(num_stages: int, x: Tensor) -> Tensor:
    """Zeros [N, ...] shaped like one microbatch of `x` [M, ...] per stage."""
    return _shard_stages(jnp.zeros((num_stages, *x.shape[1:]), x.dtype))


def _shift_stages(x: Tensor, shift: int) -> Tensor:
    """`x` [N, ...] moved `shift` (+1 or -1) along the stage axis: out[n] = x[n - shift],
    zeros where that index falls outside. Written as pad-and-slice, which XLA partitions
    into one collective permute between neighbouring stages (its gradient is the opposite
    shift)."""
    n = x.shape[0]
    padding = [(1, 0) if shift > 0 else (0, 1)] + [(0, 0)] * (x.ndim - 1)
    start = 0 if shift > 0 else 1
    return jax.lax.slice_in_dim(jnp.pad(x, padding), start, start + n, axis=0)


def _feed_stages(first_stage_input: Tensor, previous_outputs: Tensor) -> Tensor:
    """Per-stage inputs [N, ...]: stage 0 gets `first_stage_input` [...], stage n > 0 the
    output of stage n - 1 from the previous iteration (`previous_outputs` [N, ...])."""
    shifted = _shift_stages(previous_outputs, 1)
    is_first = jax.lax.broadcasted_iota(jnp.int32, shifted.shape, 0) == 0
    stage_inputs = _shard_stages(jnp.where(is_first, first_stage_input[None], shifted))
    # The one activation each iteration keeps for the backward pass (_rematerialized).
    return checkpoint_name(stage_inputs, _STAGE_INPUT)


def _rematerialized(fn: Callable) -> Callable:
    """`fn` (one pipeline iteration) saving only the stages' inputs for the backward pass:
    the stages are recomputed from them, and the waiting microbatches are not saved."""
    return jax.checkpoint(
        fn, prevent_cse=False, policy=jax.checkpoint_policies.save_only_these_names(_STAGE_INPUT)
    )


def _mask_bubble_gradients(tree: Any, valid: Tensor) -> Any:
    """`tree` (leaves [N, ...]) whose gradient is zero for the stages where `valid` [N] is
    False (the forward values are unchanged)."""

    def mask(x: Tensor) -> Tensor:
        keep = jnp.reshape(valid, (-1,) + (1,) * (x.ndim - 1))
        return jnp.where(keep, x, jax.lax.stop_gradient(x))

    return jax.tree_util.tree_map(mask, tree)


class BaseSchedule(Configurable):
    """How microbatches move through the stages; `Pipeline` fills in both fields."""

    @config_class
    class Config(Configurable.Config):
        """Configures BaseSchedule."""

        num_stages: Required[int] = REQUIRED  # Set by Pipeline from its num_layers.
        num_microbatches: Required[int] = REQUIRED  # Set by Pipeline.

    @property
    def num_stages(self) -> int:
        return self.config.num_stages

    @property
    def num_microbatches(self) -> int:
        return self.config.num_microbatches

    @property
    def num_iterations(self) -> int:
        """The scan length: every microbatch through every stage, bubbles included."""
        return self.num_stages + self.num_microbatches - 1

    def valid_stages(self, t: Tensor) -> Tensor:
        """[N] bool: whether stage n holds a real microbatch (t - n) at iteration t."""
        stage = jnp.arange(self.num_stages, dtype=jnp.int32)
        return jnp.logical_and(stage <= t, t - stage < self.num_microbatches)

    def scan(
        self, fn: StageFn, *, carry: Any, state: Any, prng_keys: Optional[Tensor]
    ) -> tuple[Any, OutputCollection]:
        """Runs the pipeline.

        Args:
            fn: One stage's computation (see StageFn).
            carry: The microbatched inputs, leaves [M, microbatch_size, ...].
            state: The stacked stage parameters, leaves [N, ...].
            prng_keys: [num_iterations, N, 2] keys (one per stage per iteration), or None.

        Returns:
            (the last stage's outputs, leaves [M, microbatch_size, ...] in microbatch order;
            the output collections of every iteration, leaves [num_iterations, N, ...]).
        """
        raise NotImplementedError(type(self))

    def _step(self, fn: StageFn, state: Any, stage_inputs: Any, t: Tensor, keys: Any):
        """One iteration: every stage on its input; no gradient flows through a stage fed a
        bubble, to its parameters or back to its input."""
        valid = self.valid_stages(t)
        state = _mask_bubble_gradients(state, valid)
        stage_inputs = _mask_bubble_gradients(stage_inputs, valid)
        return _vmap_stages(fn)(state, stage_inputs, keys)


class GPipeSchedule(BaseSchedule):
    """GPipe's schedule: at iteration t stage n processes microbatch t - n.

    The microbatches wait, replicated over the stages, until stage 0 takes them; the
    scan stacks every iteration's stage outputs [T, N, ...] and the last stage's are
    sliced out at the end. Each iteration saves only its stage inputs for the backward pass.
    """

    def scan(self, fn, *, carry, state, prng_keys):
        n, m = self.num_stages, self.num_microbatches

        @_rematerialized
        def iteration(state, microbatches, previous, t, keys):
            inputs = jax.tree_util.tree_map(
                lambda mb, prev: _feed_stages(mb[t % m], prev), microbatches, previous
            )
            return self._step(fn, state, inputs, t, keys)

        def body(previous, xs_t):
            t, keys = xs_t
            outputs, collection = iteration(state, carry, previous, t, keys)
            return outputs, (outputs, collection)

        zeros = jax.tree_util.tree_map(functools.partial(_stage_zeros, n), carry)
        ts = jnp.arange(self.num_iterations, dtype=jnp.int32)
        _, (outputs, collections) = jax.lax.scan(body, zeros, (ts, prng_keys))
        # The last stage's output at iterations N-1 .. T-1 is microbatch 0 .. M-1's.
        last = jax.tree_util.tree_map(lambda x: x[n - 1 :, n - 1], outputs)
        return last, collections


class StreamSchedule(BaseSchedule):
    """A schedule whose microbatches wait in a buffer sharded over the stages (praxis'
    "stream" buffer): no stage holds more than M / N of them, and the last stage's
    outputs are written back into the slots the inputs leave.

    The buffer is [N, K = M / N, ...], row r holding microbatches r*K .. r*K + K - 1. At
    iteration t stage 0 reads column t % K of row 0; then that column shifts up one row
    (the next row's microbatch moves to the front), and the last stage's output fills the
    freed slot of the last row. After M + N - 1 iterations the buffer holds the outputs,
    each row's columns rotated by (N - 1) % K. Needs N to divide M. Each iteration saves
    its stage inputs for the backward pass.
    """

    def __init__(self, cfg: BaseSchedule.Config):
        super().__init__(cfg)
        cfg = self.config
        if cfg.num_microbatches % cfg.num_stages != 0:
            raise ConfigError(
                f"StreamSchedule: num_microbatches ({cfg.num_microbatches}) must be a multiple "
                f"of num_stages ({cfg.num_stages}); use GPipeSchedule otherwise"
            )

    def scan(self, fn, *, carry, state, prng_keys):
        n, m = self.num_stages, self.num_microbatches
        k = m // n

        @_rematerialized
        def iteration(state, loop, t, keys):
            previous, buffer = loop
            column = t % k
            waiting = jax.tree_util.tree_map(lambda b: b[:, column], buffer)  # [N, ...]
            inputs = jax.tree_util.tree_map(
                lambda w, prev: _feed_stages(w[0], prev), waiting, previous
            )
            outputs, collection = self._step(fn, state, inputs, t, keys)

            def refill(buf: Tensor, col: Tensor, out: Tensor) -> Tensor:
                # Row r takes row r + 1's waiting microbatch; the last row the last output.
                moved = _shift_stages(col, -1)
                is_last = jax.lax.broadcasted_iota(jnp.int32, moved.shape, 0) == n - 1
                moved = _shard_stages(jnp.where(is_last, out, moved))
                return jax.lax.dynamic_update_index_in_dim(buf, moved, column, axis=1)

            buffer = jax.tree_util.tree_map(refill, buffer, waiting, outputs)
            return (outputs, buffer), collection

        def body(loop, xs_t):
            t, keys = xs_t
            return iteration(state, loop, t, keys)

        zeros = jax.tree_util.tree_map(functools.partial(_stage_zeros, n), carry)
        buffer = jax.tree_util.tree_map(
            lambda x: _shard_stages(jnp.reshape(x, (n, k, *x.shape[1:]))), carry
        )
        ts = jnp.arange(self.num_iterations, dtype=jnp.int32)
        (_, buffer), collections = jax.lax.scan(body, (zeros, buffer), (ts, prng_keys))
        offset = (n - 1) % k
        last = jax.tree_util.tree_map(
            lambda b: jnp.reshape(jnp.roll(b, -offset, axis=1), (m, *b.shape[2:])), buffer
        )
        return last, collections


def _per_stage_and_microbatch(x: Tensor, num_stages: int, num_microbatches: int) -> Tensor:
    """[T, N, ...] per iteration and stage -> [N, M, ...]: stage n's value for microbatch
    m is the one of iteration m + n (the bubbles are dropped)."""
    stage = jnp.arange(num_stages)[:, None]
    microbatch = jnp.arange(num_microbatches)[None, :]
    return x[microbatch + stage, stage]


class Pipeline(BaseLayer):
    """Runs `num_layers` copies of `layer` as pipeline stages over `num_microbatches`."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures Pipeline."""

        layer: Required[BaseLayer.Config] = REQUIRED  # One stage; set by the parent.
        num_layers: Required[int] = REQUIRED  # The number of stages.
        # Into how many microbatches the batch is split; it must divide the batch size.
        num_microbatches: Required[int] = REQUIRED
        # Where microbatches wait between stages; num_stages and num_microbatches are
        # filled in from the fields above.
        schedule: BaseSchedule.Config = GPipeSchedule.default_config()

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        cfg = self.config
        for field in ("num_layers", "num_microbatches"):
            value = getattr(cfg, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{self.path()}.{field}: expected a positive int, got {value!r}")
        self._add_child("layer", cfg.layer)
        try:
            self._schedule: BaseSchedule = cfg.schedule.clone(
                num_stages=cfg.num_layers, num_microbatches=cfg.num_microbatches
            ).instantiate()
        except ConfigError as e:
            raise ConfigError(f"{self.path()}.schedule: {e}") from e

    def create_parameter_specs_recursively(self) -> dict[str, Any]:
        """The stage layer's specs with a leading stage axis over 'pipeline'."""
        specs = super().create_parameter_specs_recursively()
        num_stages = self.config.num_layers

        def stack(spec):
            stacked = stacked_parameter_spec(spec, num_stages)
            return dataclasses.replace(
                stacked, mesh_axes=(PIPELINE_AXIS, *stacked.mesh_axes[1:])
            )

        return jax.tree_util.tree_map(stack, specs, is_leaf=is_parameter_spec)

    def _to_microbatches(self, x: Tensor) -> Tensor:
        """[B, ...] -> [M, B / M, ...]; microbatch m holds rows m, m + M, ..., so that a
        batch split over devices stays split along the microbatch rows."""
        m = self.config.num_microbatches
        if x.shape[0] % m:
            raise ValueError(
                f"{self.path()}.num_microbatches={m} does not divide the batch of {x.shape[0]} rows"
            )
        x = jnp.reshape(x, (x.shape[0] // m, m, *x.shape[1:]))
        return jnp.swapaxes(x, 0, 1)

    @staticmethod
    def _from_microbatches(x: Tensor) -> Tensor:
        """The inverse of `_to_microbatches`: [M, B / M, ...] -> [B, ...]."""
        x = jnp.swapaxes(x, 0, 1)
        return jnp.reshape(x, (-1, *x.shape[2:]))

    def _run(self, fn: Callable[[Any], Any], carry: Any) -> Any:
        """carry -> fn(carry) through every stage, pipelined over the microbatches.

        `carry` is a tree of [B, ...] arrays (the batch rows leading); `fn` runs in this
        module's context with one stage's parameters, so it calls `self.layer(...)`, and
        returns a tree like its input. Returns the last stage's output, [B, ...] leaves.
        """
        cfg = self.config
        context = self.get_invocation_context()
        state = context.state if isinstance(context.state, dict) else {}
        n, iterations = cfg.num_layers, self._schedule.num_iterations
        keys = None
        if context.prng_key is not None:
            keys = jax.random.split(context.prng_key, iterations * n)
            keys = jnp.reshape(keys, (iterations, n, *keys.shape[1:]))

        def stage_fn(stage_state, stage_carry, key):
            inner = stacked_layer_context(context, stage_state, key)
            with set_current_context(inner):
                out = fn(stage_carry)
            return out, inner.output_collection

        microbatched = jax.tree_util.tree_map(self._to_microbatches, carry)
        outputs, collections = self._schedule.scan(
            stage_fn, carry=microbatched, state=state.get("layer", {}), prng_keys=keys
        )
        self._collect(collections)
        return jax.tree_util.tree_map(self._from_microbatches, outputs)

    def _collect(self, collections: OutputCollection) -> None:
        """Adds the stages' output collections [T, N, ...] to this call's (module doc)."""
        cfg = self.config
        if jax.tree_util.tree_leaves(collections.state_updates):
            raise NotImplementedError(
                f"{self.path()}: the stage layer adds state updates, which a pipeline does "
                "not support"
            )

        def per_stage(x):
            return _per_stage_and_microbatch(x, cfg.num_layers, cfg.num_microbatches)

        out = self.get_invocation_context().output_collection
        out.summaries.update(
            jax.tree_util.tree_map(lambda x: jnp.mean(per_stage(x), axis=1), collections.summaries)
        )
        out.module_outputs.update(jax.tree_util.tree_map(per_stage, collections.module_outputs))

    def _run_in_sequence(
        self, fn: Callable[[Any, Any], tuple[Any, Any]], carry: Any, xs: Any = None
    ) -> tuple[Any, Any]:
        """Scans `(carry, y_n) = fn(carry, xs[n])` over the stages, one after another, on
        the whole batch: for steps with nothing to pipeline, such as decoding a token.

        `fn` runs in this module's context with stage n's parameters (it calls
        `self.layer`). Returns the last carry and the ys stacked on a leading stage axis.
        The stages' output collections are not kept (a decoding step's summaries).
        """
        context = self.get_invocation_context()
        state = context.state if isinstance(context.state, dict) else {}

        def body(carry, scanned):
            stage_state, x = scanned
            inner = stacked_layer_context(context, stage_state, None)
            with set_current_context(inner):
                return fn(carry, x)

        return jax.lax.scan(
            body, carry, (state.get("layer", {}), xs), length=self.config.num_layers
        )

    def forward(self, carry: Any) -> Any:
        """carry [B, ...] leaves -> the last stage's `layer(carry)`."""
        return self._run(lambda c: self.layer(c), carry)
