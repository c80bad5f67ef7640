"""SpmdTrainer: the training loop over one device mesh.

The trainer builds the mesh, the model, the learner, the input, the evalers, the
checkpointer and the summary writer from its config; restores the latest committed
checkpoint in its directory or initializes, while the train step compiles in a thread
(`compile_ahead`); then runs one jitted, sharded `train_step` per batch until `max_step`,
with summaries, evaluation and checkpoints by policy. The first step logs where the start
went (`perf.StartTimes`: process to trainer, state, trackers and first batch, train step
ready, first step).
"""

import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from axlearn.common import compilation_cache, executable_store, fp8, perf, preemption, run_lock
from axlearn.common.base_layer import BaseLayer, ParameterSpec, is_parameter_spec
from axlearn.common.checkpointer import (
    Checkpointer,
    CheckpointCorruptError,
    CheckpointMismatchError,
)
from axlearn.common.config import (
    REQUIRED,
    ConfigError,
    InstantiableConfig,
    Required,
    config_class,
)
from axlearn.common.evaler import SpmdEvaler
from axlearn.common.input_prefetch import prefetch_in_thread
from axlearn.common.learner import Learner, restore_with_legacy_schedule_step
from axlearn.common.module import Module, functional
from axlearn.common.optimizers import SkipClipState, find_states, global_norm
from axlearn.common.run_dir import TRAIN_SUMMARIES, RunDir
from axlearn.common.sharding import (
    batch_shards,
    create_mesh,
    global_batch,
    global_batch_spec,
    indivisible_dim,
    microbatch_count,
    named_sharding,
)
from axlearn.common.summary import WeightedScalar, scalar_value
from axlearn.common.summary_writer import SummaryWriter
from axlearn.common.utils import HybridMeshShape, flatten_with_paths, unflatten_paths
from axlearn.common.weight_copies import WeightCopies, uses_float32_weight_grads

log = logging.getLogger(__name__)

MeshShape = Sequence[int]


class TrainingDivergedError(RuntimeError):
    """Training stopped because its state went bad; the one-line message names the step and
    the last good checkpoint. The launcher exits with status 1 and this message."""


class NonFiniteLossError(TrainingDivergedError):
    """The loss became NaN or infinite and the optimizer does not skip such steps."""


class ConsecutiveBadStepsError(TrainingDivergedError):
    """`SpmdTrainer.Config.max_consecutive_bad_steps` steps in a row were bad."""


class ParameterNormBlowUpError(TrainingDivergedError):
    """The parameter norm grew over MAX_PARAMETER_NORM_GROWTH times that of the newest good
    state, though the loss stayed finite."""


# SpmdTrainer.Config.max_consecutive_bad_steps when None.
DEFAULT_MAX_CONSECUTIVE_BAD_STEPS = 20
# In a run with a directory, a parameter norm (checked where the loop logs or saves) over
# this many times that of the newest good state (at a run's start: the restored or initial
# one) stops the run with ParameterNormBlowUpError: an update blew the parameters up, even
# if the loss stays finite (saturated units with zero gradients).
MAX_PARAMETER_NORM_GROWTH = 100.0


def infer_mesh_shape(mesh_shape: MeshShape, num_devices: int) -> tuple[int, ...]:
    """Resolves one -1 entry so that the product equals `num_devices`. A HybridMeshShape
    is resolved as its product shape, the -1 axis a multiple of its other part."""
    if isinstance(mesh_shape, HybridMeshShape):
        shape = infer_mesh_shape(mesh_shape.flat(), num_devices)
        parts = zip(mesh_shape.ici_mesh_shape, mesh_shape.dcn_mesh_shape)
        for axis, (ici, dcn) in enumerate(parts):
            part = dcn if ici == -1 else ici
            if shape[axis] % abs(part):
                raise ConfigError(
                    f"mesh_shape {mesh_shape}: axis {axis} of {shape[axis]} devices does not "
                    f"split into parts of {part}"
                )
        return shape
    shape = list(mesh_shape)
    unknown = [i for i, d in enumerate(shape) if d == -1]
    if len(unknown) > 1:
        raise ConfigError(f"mesh_shape {tuple(mesh_shape)} has more than one -1")
    known = math.prod(d for d in shape if d != -1)
    if known <= 0 or any(d == 0 or d < -1 for d in shape):
        raise ConfigError(f"mesh_shape {tuple(mesh_shape)} has invalid entries")
    if unknown:
        if num_devices % known:
            raise ConfigError(
                f"mesh_shape {tuple(mesh_shape)} cannot cover {num_devices} devices: "
                f"{num_devices} is not divisible by {known}"
            )
        shape[unknown[0]] = num_devices // known
    if math.prod(shape) != num_devices:
        raise ConfigError(
            f"mesh_shape {tuple(mesh_shape)} needs {math.prod(shape)} devices, "
            f"but {num_devices} are available"
        )
    return tuple(shape)


@dataclasses.dataclass
class TrainerState:
    """What the train step carries from one step to the next."""

    prng_key: jax.Array
    model: Any
    learner: Any
    # train_dtype copies of the model's weights, None in place of the other parameters
    # (SpmdTrainer.Config.carry_train_dtype_weights); None: not carried. Derived from
    # the weights, so not checkpointed.
    weight_copies: Any = None
    # With SpmdTrainer.Config.split_carried_weights, each weight is kept as its copy and
    # these int16 low bits (`split_float.join_float32`), and `model` holds None in its
    # place; None: not split. `SpmdTrainer.model_params` joins them.
    weight_low_bits: Any = None


jax.tree_util.register_dataclass(
    TrainerState,
    data_fields=["prng_key", "model", "learner", "weight_copies", "weight_low_bits"],
    meta_fields=[],
)


@dataclasses.dataclass
class BadStepCounts:
    """The bad steps of this run: steps whose update the optimizer skipped
    (skip_and_clip_by_global_norm: a non-finite or too large gradient norm)."""

    skipped: int = 0  # Bad steps so far.
    nonfinite_loss: int = 0  # Those of them whose loss was not finite.
    consecutive: int = 0  # Bad steps in a row, up to the last checked step.
    first: Optional[int] = None  # The first step of those in a row; None while there are none.

    def record(self, step: int, *, bad: bool, loss_finite: bool) -> None:
        if not bad:
            self.consecutive, self.first = 0, None
            return
        self.skipped += 1
        self.nonfinite_loss += not loss_finite
        self.consecutive += 1
        if self.first is None:
            self.first = step

    def summaries(self) -> dict[str, int]:
        return {
            "trainer/skipped_steps": self.skipped,
            "trainer/nonfinite_loss_steps": self.nonfinite_loss,
            "trainer/consecutive_bad_steps": self.consecutive,
        }


def _to_state_dict(state: TrainerState) -> dict[str, Any]:
    return {"prng_key": state.prng_key, "model": state.model, "learner": state.learner}


def _from_state_dict(tree: dict[str, Any]) -> TrainerState:
    return TrainerState(prng_key=tree["prng_key"], model=tree["model"], learner=tree["learner"])


@dataclasses.dataclass
class _StartUp:
    """A run's start until its first step has trained (`SpmdTrainer._train`)."""

    times: perf.StartTimes  # Its phases (`perf.StartTimes`), logged at the first step.
    # The train step compiling ahead (`compile_ahead`); None once the first step took it,
    # or where it is not compiled ahead.
    ahead: Optional[compilation_cache.CompiledAhead] = None


@dataclasses.dataclass
class _Loop:
    """What one run() of the loop carries from step to step (`SpmdTrainer._train`)."""

    accounting: perf.StepAccounting
    log_every: int  # Steps from one progress line to the next.
    has_writer: bool
    has_checkpointer: bool
    batches: Any  # The prefetcher: (input state after the batch, host batch) pairs.
    timer: perf.StepTimer
    vote_to_stop: Callable[[bool], bool]  # preemption.StopVote: a stop agreed by all.
    host_batch: Any = None  # This process's rows of the current batch.
    # The last logged step's host summaries.
    last: dict[str, Any] = dataclasses.field(default_factory=dict)
    pending: Optional[tuple[int, dict[str, Any]]] = None  # A step whose loss waits its check.
    saved_step: Optional[int] = None  # The last step saved.
    tracing_until: Optional[int] = None  # The step a running trace ends at.
    stopping: bool = False  # A stop signal: this step was the last.


class SpmdTrainer(Module):
    """Trains a model with one jitted train step over a device mesh."""

    @config_class
    class Config(Module.Config):
        """Configures SpmdTrainer."""

        dir: Optional[str] = None  # The trainer directory (checkpoints, summaries, traces).
        model: Required[BaseLayer.Config] = REQUIRED
        learner: Required[Learner.Config] = REQUIRED
        input: Required[Module.Config] = REQUIRED
        evalers: dict[str, SpmdEvaler.Config] = {}
        checkpointer: Checkpointer.Config = Checkpointer.default_config()
        summary_writer: SummaryWriter.Config = SummaryWriter.default_config()
        max_step: Required[int] = REQUIRED
        # Parameters stay in model.dtype; the forward and backward run in this dtype.
        train_dtype: Optional[jnp.dtype] = None
        # Keep train_dtype copies of the weights (of matrix products and embeddings: the
        # parameters with fan axes) from one step to the next: each step writes them with
        # the new parameters, and the next step reads them instead of casting every weight
        # again. Costs train_dtype's bytes per weight of memory; needs train_dtype. None:
        # no copies (and the field stays out of golden files).
        carry_train_dtype_weights: Optional[bool] = None
        # Carry each such weight as its bfloat16 copy and the 16 bits below it instead of
        # as float32 beside the copy (`split_float`): the same float32 weights in 4 bytes
        # instead of 6, and 2 fewer bytes a weight for the update to write. The copies round
        # halfway cases away from zero (one float32 in 2**17 differs from a cast).
        # Evaluation and checkpoints join the halves into float32 arrays while they run.
        # Needs carry_train_dtype_weights, train_dtype bfloat16 and float32 weights.
        # None: not split.
        split_carried_weights: Optional[bool] = None
        # Batch rows each device computes gradients for at once. A device's share of a
        # larger global batch is run as microbatches of this size, with the gradients
        # accumulated (the step equals the full-batch step; Learner.compute_gradients).
        # Lets one config run its cluster-sized batch on fewer devices. None: the whole
        # share at once.
        per_device_microbatch_size: Optional[int] = None
        # Microbatches each step runs in, whatever the device count (AXLearn's
        # GradientAccumulationModifier sets it); the global batch must divide by it. Not
        # with per_device_microbatch_size. None: see per_device_microbatch_size.
        grad_acc_steps: Optional[int] = None
        mesh_shape: Required[MeshShape] = REQUIRED  # One entry may be -1 (inferred).
        mesh_axis_names: Required[Sequence[str]] = REQUIRED
        # [(instance-type regex, mesh shape or config modifier)]; applied by the launcher.
        mesh_rules: Optional[Sequence[tuple[str, Any]]] = None
        batch_axis_names: Union[str, Sequence[str]] = "data"  # Mesh axes the batch is split over.
        save_input_iterator: bool = False  # Save the input position with each checkpoint.
        start_trace_process_indices: Sequence[int] = (0,)  # Processes that record traces.
        # A trace starts once this many steps are done (s: it records steps s+1, s+2, ...).
        start_trace_steps: Optional[Sequence[int]] = None
        start_trace_num_steps: Optional[int] = None  # Steps per trace; None: 3.
        prune_empty_state_updates: bool = True
        log_every_n_steps: Optional[int] = None  # None: summary_writer.write_every_n_steps.
        seed: Optional[int] = None  # PRNG seed; None: 0.
        # Peak dense TFLOP/s per device for MFU; None: looked up from the device kind.
        peak_tflops_per_device: Optional[float] = None
        # Bad steps in a row (updates the optimizer skipped, e.g. skip_and_clip_by_global_norm
        # on a non-finite gradient) that stop the run with ConsecutiveBadStepsError; no
        # checkpoint is saved at a bad step. Without such an optimizer a non-finite loss
        # stops the run at once. None: DEFAULT_MAX_CONSECUTIVE_BAD_STEPS (20).
        max_consecutive_bad_steps: Optional[int] = None
        # Seconds from SIGTERM or SIGINT until the run exits with status
        # preemption.PREEMPTED_EXIT_CODE, even if the step it reached is not saved by
        # then (see `run`). None: preemption.DEFAULT_GRACE_PERIOD_S.
        preemption_grace_period_s: Optional[float] = None
        # Verbosity of the per-step debug log: each step logs its batch shapes at level 1
        # and its loss at level 2 (which waits for the step); a level-n message is logged
        # where n <= vlog. None: no per-step log.
        vlog: Optional[int] = None
        # Where the model's weights come from at step 0 of a fresh run instead of
        # model.param_init: a config whose instance has `load(model_config=, param_specs=,
        # shardings=)` returning the parameters (hf_llama.HfLlamaWeights: a Hugging Face
        # checkpoint). A run with checkpoints resumes from them. None: param_init.
        init_params: Optional[InstantiableConfig] = None
        # False: checkpoints leave out the parameters the learner never updates (its
        # update_rules' 'no_update' ones, e.g. a LoRA run's frozen base), which each save
        # would otherwise write again unchanged. A restore takes them from where the run
        # got them, init_params or param_init with the run's seed, and checks them against
        # the fingerprint every checkpoint records (`frozen_params_fingerprint`): a changed
        # source fails the restore, naming the parameter. None: saved like the others.
        checkpoint_frozen_params: Optional[bool] = None
        # False: the train step compiles (or loads from the compilation cache) at the first
        # step's call. None: it compiles ahead, in a thread that run() starts before it
        # restores or initializes the state, for the state and batch the first step will
        # get (from their shardings and the input's element_spec), so that tracing,
        # lowering and compiling overlap the restore, the initialization and the input's
        # start; a first step whose state or batch differ from those compiles then
        # (logged, with the difference).
        compile_ahead: Optional[bool] = None

    # run()'s start until its first step has trained; None outside it.
    _start_up: Optional["_StartUp"] = None

    def __init__(
        self,
        cfg: Config,
        *,
        parent: Optional[Module] = None,
        devices=None,
        run_dir: Optional[RunDir] = None,
    ):
        """`run_dir`: the RunDir of `cfg.dir` that the launcher made (and may hold locked);
        None: one made here."""
        super().__init__(cfg, parent=parent)
        cfg = self._config
        devices = list(jax.devices() if devices is None else devices)
        self._check_fields()
        mesh_shape = infer_mesh_shape(cfg.mesh_shape, len(devices))
        self._mesh = create_mesh(mesh_shape, cfg.mesh_axis_names, devices)
        self._devices = devices
        log.info(
            "Mesh %s over %d %s devices", dict(self._mesh.shape), len(devices), devices[0].platform
        )

        self._add_child("model", cfg.model)
        self._add_child("learner", cfg.learner)
        self._add_child("input", cfg.input.clone(is_training=True))
        # Every path under the trainer directory comes from it (None: nothing is written).
        if run_dir is None and cfg.dir is not None:
            run_dir = RunDir(cfg.dir)
        if run_dir is not None and run_dir.root != cfg.dir:
            raise ValueError(f"{self.path()}: run_dir {run_dir.root} is not dir {cfg.dir}")
        self._run_dir: Optional[RunDir] = run_dir
        if run_dir is not None:
            self._add_run_dir_children(run_dir)
        self._model_param_specs = self.model.create_parameter_specs_recursively()
        self._check_parameters_split_evenly()
        # Model parameter paths that checkpoints leave out (checkpoint_frozen_params).
        self._unsaved_paths: frozenset = frozenset()
        if cfg.checkpoint_frozen_params is False:
            self._unsaved_paths = frozen_param_paths(self.learner, self._model_param_specs)
        self._frozen_fingerprint: Optional[dict[str, int]] = None  # Of the unsaved params.
        # What a step carries of the weights besides (or instead of) their float32 values.
        self._weight_copies = WeightCopies(
            self._model_param_specs,
            train_dtype=cfg.train_dtype,
            carry=cfg.carry_train_dtype_weights,
            split=cfg.split_carried_weights,
            path=self.path(),
        )
        self._evalers = self._add_evalers()
        self._step = 0
        self._skipped_steps = 0  # The optimizer's count of skipped steps, as last checked.
        self._bad_steps = BadStepCounts()
        self._checked_step: Optional[int] = None  # The last step `_check_finite` checked.
        self._window_loss = perf.WindowMean()  # Losses checked since the last console line.
        # (step, its parameter norm or None) of the saved (or restored) step whose verdict
        # waits for the check of the step after it (`_judge_saved_step`); None: none waits.
        self._awaiting_verdict: Optional[tuple[int, Optional[float]]] = None
        # The parameter norm of the newest state judged good (at the start: the restored or
        # initial state's); None: not known.
        self._good_param_norm: Optional[float] = None
        self._checked_param_norm: Optional[float] = None  # Of the last checked step, if known.
        self._restore_step: Optional[int] = None  # run()'s or evaluate()'s restore_step.
        self._input_state: Optional[dict[str, Any]] = None  # After the last consumed batch.
        self._state: Optional[TrainerState] = None
        self._jit_train_step = None
        self._jit_parameter_norm = None
        self._jit_model_params = None
        self._stop: Optional[preemption.StopRequest] = None  # While run() runs.

    def _add_run_dir_children(self, run: RunDir) -> None:
        """The children that write under the run directory: the checkpointer and the
        trainer's summary writer."""
        cfg = self._config
        self._add_child("checkpointer", cfg.checkpointer.clone(dir=run.checkpoints))
        writer_cfg = cfg.summary_writer.clone(dir=run.summaries(TRAIN_SUMMARIES))
        if "run_dir" in writer_cfg.keys():  # The W&B run's, shared with the evalers.
            writer_cfg.run_dir = run.root
        self._add_child("summary_writer", writer_cfg)

    def _add_evalers(self) -> dict[str, Module]:
        """The evalers of cfg.evalers, as children: over the training batch axes, in the
        training microbatch size unless they name their own, each writing its summaries
        under the run directory."""
        cfg, run = self._config, self._run_dir
        evalers = {}
        for name, evaler_cfg in cfg.evalers.items():
            # Evaluation batches are split over the same mesh axes as training batches.
            evaler_cfg = evaler_cfg.clone(batch_axis_names=cfg.batch_axis_names)
            if evaler_cfg.per_device_microbatch_size is None:
                # Eval batches are as large as training ones: a share that training runs
                # in microbatches would not fit one forward pass either.
                evaler_cfg.per_device_microbatch_size = cfg.per_device_microbatch_size
            if run is not None and "dir" in evaler_cfg.summary_writer.keys():
                evaler_cfg.summary_writer.dir = run.summaries(name)
                if "run_dir" in evaler_cfg.summary_writer.keys():  # One W&B run for all.
                    evaler_cfg.summary_writer.run_dir = run.root
            evalers[name] = self._add_child(
                name,
                evaler_cfg,
                model=self.model,
                model_param_partition_specs=self._model_param_specs,
            )
        return evalers

    def _check_fields(self) -> None:
        """ConfigErrors naming the field, for fields that no type annotation checks: the
        mesh's two lists, the weight copies' options, the bad-step limit, microbatches and
        gradient accumulation, the preemption grace period."""
        cfg = self._config
        if len(cfg.mesh_shape) != len(cfg.mesh_axis_names):
            raise ConfigError(
                f"{self.path()}: mesh_shape {tuple(cfg.mesh_shape)} and mesh_axis_names "
                f"{tuple(cfg.mesh_axis_names)} differ in length"
            )
        WeightCopies.check_options(
            self.path(),
            train_dtype=cfg.train_dtype,
            carry=cfg.carry_train_dtype_weights,
            split=cfg.split_carried_weights,
        )
        max_bad = cfg.max_consecutive_bad_steps
        if max_bad is not None and (not isinstance(max_bad, int) or max_bad < 1):
            raise ConfigError(
                f"{self.path()}.max_consecutive_bad_steps must be None or an int >= 1, "
                f"got {max_bad!r}"
            )
        microbatch = cfg.per_device_microbatch_size
        if microbatch is not None:
            if not isinstance(microbatch, int) or microbatch < 1:
                raise ConfigError(
                    f"{self.path()}.per_device_microbatch_size must be None or an int >= 1, "
                    f"got {microbatch!r}"
                )
        steps = cfg.grad_acc_steps
        if steps is not None and (not isinstance(steps, int) or steps < 1 or microbatch):
            raise ConfigError(
                f"{self.path()}.grad_acc_steps must be None or an int >= 1, and not set with "
                f"per_device_microbatch_size; got {steps!r} and {microbatch!r}"
            )
        grace = cfg.preemption_grace_period_s
        if grace is not None and not (isinstance(grace, (int, float)) and 0 < grace < math.inf):
            raise ConfigError(
                f"{self.path()}.preemption_grace_period_s must be None or a positive number "
                f"of seconds, got {grace!r}"
            )

    # ----- properties -----

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self._mesh

    @property
    def run_dir(self) -> Optional[RunDir]:
        """The paths under `dir` (None: the trainer writes nothing)."""
        return self._run_dir

    @property
    def step(self) -> int:
        return self._step

    @property
    def stop_requested(self) -> bool:
        """Whether SIGTERM or SIGINT has asked the running run() to stop."""
        return self._stop is not None and self._stop.requested

    @property
    def trainer_state(self) -> Optional[TrainerState]:
        """The state as the step carries it; its `model` lacks the weights that
        `split_carried_weights` splits (`model_params` has them all)."""
        return self._state

    @property
    def model_param_specs(self) -> dict[str, Any]:
        return self._model_param_specs

    # ----- shardings -----

    def _check_parameters_split_evenly(self) -> None:
        """A config error naming the parameter when the mesh cannot split it evenly (jax
        would only say which shape, once the state is placed)."""
        sizes = dict(self._mesh.shape)
        for path, spec in flatten_with_paths(self._model_param_specs, is_leaf=is_parameter_spec):
            where = indivisible_dim(spec.shape, spec.partition_spec, sizes)
            if where is not None:
                raise ConfigError(
                    f"{self.path()}.mesh_shape {tuple(self._config.mesh_shape)} (mesh {sizes}) "
                    f"cannot split model parameter {path} of shape {tuple(spec.shape)} by "
                    f"{tuple(spec.partition_spec)}: {where}. Pick a mesh rule whose axes "
                    "divide the model's dimensions (docs/mesh_rules.md)."
                )

    def _param_shardings(self, specs: Any) -> Any:
        def to_sharding(spec):
            if isinstance(spec, ParameterSpec):
                return named_sharding(self._mesh, spec.partition_spec)
            if isinstance(spec, PartitionSpec):
                return named_sharding(self._mesh, spec)
            return NamedSharding(self._mesh, PartitionSpec())

        return jax.tree.map(
            to_sharding, specs, is_leaf=lambda x: isinstance(x, (ParameterSpec, PartitionSpec))
        )

    def _checkpointed_shardings(self) -> TrainerState:
        """The shardings of the state as checkpoints hold it: float32 parameters, no copies."""
        learner_specs = self.learner.create_state_partition_specs(self._model_param_specs)
        return TrainerState(
            prng_key=NamedSharding(self._mesh, PartitionSpec()),
            model=self._param_shardings(self._model_param_specs),
            learner=self._param_shardings(learner_specs),
        )

    def frozen_matmul_parameter_count(self) -> int:
        """Matmul parameters (`causal_lm.matmul_parameter_count`) that the learner never
        updates: their products have no weight gradient, so a token costs 4 FLOPs of each
        instead of 6 (DESIGN.md's LoRA count; `perf.StepAccounting`)."""
        # pylint: disable-next=import-outside-toplevel
        from axlearn.common.causal_lm import matmul_parameter_count

        frozen = frozen_param_paths(self.learner, self._model_param_specs)
        if not frozen:
            return 0
        flat = flatten_with_paths(self._model_param_specs, is_leaf=is_parameter_spec)
        return matmul_parameter_count(unflatten_paths({p: s for p, s in flat if p in frozen}))

    def _saved(self, model_tree: Any) -> Any:
        """`model_tree` (shaped like the parameters) without the unsaved parameters."""
        if not self._unsaved_paths:
            return model_tree
        return drop_paths(model_tree, self._unsaved_paths)

    def _state_shardings(self) -> TrainerState:
        """The shardings of the state as the train step carries it (`WeightCopies.carry`)."""
        state = self._checkpointed_shardings()
        model, copies, low_bits = self._weight_copies.carry(state.model, cast=False)
        return dataclasses.replace(
            state, model=model, weight_copies=copies, weight_low_bits=low_bits
        )

    def global_batch(self, local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Assembles the global batch from this process's rows, split over the batch axes:
        the input dispatcher's partition spec's first entry where it gives one, else
        batch_axis_names."""
        return global_batch(local_batch, self._mesh, self._batch_axis_names(), path=self.path())

    def _batch_axis_names(self) -> Union[str, Sequence[str]]:
        """The mesh axes `global_batch` splits a batch over (its docstring)."""
        dispatcher = self.input.children.get("input_dispatcher")
        spec = None if dispatcher is None else dispatcher.config.partition_spec
        if spec is not None and len(spec) and spec[0] is not None:
            return spec[0]
        return self._config.batch_axis_names

    def _abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The shapes, dtypes and shardings of the global batches `global_batch` makes of
        the input's (from its element_spec)."""
        return global_batch_spec(self.input.element_spec(), self._mesh, self._batch_axis_names())

    # ----- state -----

    def _carried_state(
        self, prng_key: jax.Array, params: Any, learner_state: Any
    ) -> TrainerState:
        """The state a step carries for float32 `params` (`WeightCopies.carry`)."""
        model, copies, low_bits = self._weight_copies.carry(params)
        return TrainerState(
            prng_key=prng_key,
            model=model,
            learner=learner_state,
            weight_copies=copies,
            weight_low_bits=low_bits,
        )

    def _joined_params(self, state: TrainerState) -> Any:
        """The float32 model parameters of `state` (`WeightCopies.join`)."""
        return self._weight_copies.join(state.model, state.weight_copies, state.weight_low_bits)

    def _init_fn(self, prng_key: jax.Array, params: Any = None) -> TrainerState:
        """The initial state: `params` (None: drawn by the model's param_init), a fresh
        learner state for them and the training PRNG key."""
        init_key, train_key = jax.random.split(prng_key)
        if params is None:
            params = self.model.initialize_parameters_recursively(init_key)
        learner_state = self.learner.init(params, param_specs=self._model_param_specs)
        return self._carried_state(train_key, params, learner_state)

    def init_state(self, prng_key: jax.Array) -> TrainerState:
        """Initializes model and learner state directly in their shardings."""
        with jax.set_mesh(self._mesh):
            return jax.jit(self._init_fn, out_shardings=self._state_shardings())(prng_key)

    def init_state_from(self, prng_key: jax.Array, params: Any) -> TrainerState:
        """The initial state with the given model parameters (in their shardings, which
        the state takes over) instead of drawn ones."""
        with jax.set_mesh(self._mesh):
            return jax.jit(
                self._init_fn, out_shardings=self._state_shardings(), donate_argnums=(1,)
            )(prng_key, params)

    def _loaded_params(self) -> Any:
        """The parameters `init_params` loads, placed in the parameters' shardings."""
        cfg = self._config
        source = cfg.init_params.instantiate()
        return source.load(
            model_config=cfg.model,
            param_specs=self._model_param_specs,
            shardings=self._param_shardings(self._model_param_specs),
        )

    def _checkpointed(self, state: TrainerState) -> TrainerState:
        """`state` as checkpoints hold it: float32 parameters (but the unsaved ones), no
        copies."""
        return TrainerState(
            prng_key=state.prng_key,
            model=self._saved(self._joined_params(state)),
            learner=state.learner,
        )

    def _state_template(self) -> dict[str, Any]:
        """Shapes, dtypes and shardings of the checkpointed state, for restoring without
        allocating."""
        shapes = jax.eval_shape(
            lambda key: self._checkpointed(self._init_fn(key)), jax.random.PRNGKey(0)
        )
        shardings = self._checkpointed_shardings()
        shardings = dataclasses.replace(shardings, model=self._saved(shardings.model))
        return _to_state_dict(
            jax.tree.map(
                lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                shapes,
                shardings,
            )
        )

    def _initial_state_values(self, paths: Sequence[str], *, seed: int) -> dict[str, jax.Array]:
        """{path: value} of a fresh run's checkpointed state at `paths`, in their shardings
        (only these are computed: XLA drops the rest of the initialization)."""
        shardings = dict(flatten_with_paths(_to_state_dict(self._checkpointed_shardings())))

        def init(key):
            state = self._init_fn(key)
            state = _to_state_dict(
                TrainerState(
                    prng_key=state.prng_key, model=self._joined_params(state), learner=state.learner
                )
            )
            flat = dict(flatten_with_paths(state))
            return {path: flat[path] for path in paths}

        with jax.set_mesh(self._mesh):
            return jax.jit(init, out_shardings={path: shardings[path] for path in paths})(
                jax.random.PRNGKey(seed)
            )

    def _carried(self, state: TrainerState) -> TrainerState:
        """A restored (checkpointed) `state` as the train step carries it."""
        if not self._config.carry_train_dtype_weights:
            return state
        carried = self._state_shardings()
        shardings = (carried.model, carried.weight_copies, carried.weight_low_bits)
        with jax.set_mesh(self._mesh):
            model, copies, low_bits = jax.jit(
                self._weight_copies.carry, out_shardings=shardings
            )(state.model)
        return dataclasses.replace(
            state, model=model, weight_copies=copies, weight_low_bits=low_bits
        )

    def model_params(self) -> Any:
        """The float32 model parameters of the current state (device arrays): the state's
        own, with any split weights joined."""
        if self._state.weight_low_bits is None:
            return self._state.model
        if self._jit_model_params is None:
            self._jit_model_params = jax.jit(
                self._joined_params, out_shardings=self._checkpointed_shardings().model
            )
        with jax.set_mesh(self._mesh):
            return self._jit_model_params(self._state)

    def _restore_or_init(self) -> bool:
        """Restores the state (see `run`), or initializes it; True where it restored."""
        cfg = self._config
        seed = 0 if cfg.seed is None else cfg.seed
        if self._restore_step is not None and "checkpointer" not in self.children:
            raise ConfigError(
                f"restore_step={self._restore_step}: {self.path()}.dir is not set, so there "
                "are no checkpoints"
            )
        if "checkpointer" in self.children:
            step, restored, extra = fp8.restore_with_fresh_scaling_state(
                lambda template: restore_with_legacy_schedule_step(
                    lambda t: self.checkpointer.restore(step=self._restore_step, state=t),
                    template,
                ),
                self._state_template(),
                functools.partial(self._initial_state_values, seed=seed),
            )
            if step is not None:
                if self.checkpointer.verdict(step) is not True:
                    self._awaiting_verdict = (step, None)
                restored = _from_state_dict(restored)
                if self._unsaved_paths:
                    restored = dataclasses.replace(
                        restored, model=self._with_unsaved_params(restored.model, step, extra)
                    )
                self._state = self._carried(restored)
                self._step = step
                if cfg.save_input_iterator and extra and "input_iterator" in extra:
                    self.input.set_state(extra["input_iterator"])
                self._skipped_steps = self._optimizer_skip_count()
                log.info("Restored step %d from %s", step, self.checkpointer.config.dir)
                if cfg.init_params is not None:
                    log.info(
                        "init_params is not read: it initializes fresh runs only, and this "
                        "run resumes from its checkpoints"
                    )
                return True
        if cfg.init_params is not None:
            self._state = self.init_state_from(jax.random.PRNGKey(seed), self._loaded_params())
            log.info("Initialized the model parameters with %s", cfg.init_params.klass.__name__)
        else:
            self._state = self.init_state(jax.random.PRNGKey(seed))
        self._step = 0
        return False

    def _abstract_state(self) -> TrainerState:
        """The shapes, dtypes and shardings of the state the train step carries."""
        key = jax.eval_shape(jax.random.PRNGKey, 0)
        return jax.tree.map(
            lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
            jax.eval_shape(self._init_fn, key),
            self._state_shardings(),
        )

    def _with_unsaved_params(self, saved: Any, step: int, extra: Optional[dict]) -> Any:
        """The model parameters of restored checkpoint `step`: its `saved` ones and the
        unsaved ones from their source, checked against the checkpoint's fingerprint."""
        cfg = self._config
        paths = sorted(self._unsaved_paths)
        if cfg.init_params is not None:
            flat = dict(flatten_with_paths(self._loaded_params()))
            unsaved = {path: flat[path] for path in paths}
            source = f"init_params ({cfg.init_params.klass.__name__})"
        else:
            seed = 0 if cfg.seed is None else cfg.seed
            values = self._initial_state_values([f"model/{p}" for p in paths], seed=seed)
            unsaved = {path: values[f"model/{path}"] for path in paths}
            source = f"model.param_init with seed {seed}"
        recorded = (extra or {}).get(FROZEN_FINGERPRINT)
        if recorded is None:
            raise CheckpointCorruptError(
                f"Checkpoint step {step} in {self.checkpointer.directory} records no "
                f"{FROZEN_FINGERPRINT}, so its frozen parameters cannot be checked"
            )
        check_fingerprint(params_fingerprint(unsaved), recorded, source=source, step=step)
        flat = dict(flatten_with_paths(saved))
        flat.update(unsaved)
        return unflatten_paths(flat)

    def _frozen_params_fingerprint(self) -> dict[str, int]:
        """The fingerprint of the unsaved parameters (computed once: they never change)."""
        if self._frozen_fingerprint is None:
            flat = dict(flatten_with_paths(self.model_params()))
            with jax.set_mesh(self._mesh):
                self._frozen_fingerprint = params_fingerprint(
                    {path: flat[path] for path in self._unsaved_paths}
                )
        return self._frozen_fingerprint

    def _optimizer_skip_count(self) -> int:
        """Steps skipped so far as the optimizer state counts them (SkipClipState), so that
        only later skips count as new (read once, after a restore)."""
        return sum(int(s.nonvalid_count) for s in find_states(self._state.learner, SkipClipState))

    # ----- the train step -----

    def _loss_fn(
        self, model_params, input_batch, prng_key, weight_copies=None, float32_weight_grads=False
    ):
        params = self._weight_copies.train_dtype_params(
            model_params, weight_copies, float32_weight_grads=float32_weight_grads
        )
        (loss, aux), collection = functional(
            self.model,
            state=params,
            inputs=dict(input_batch=input_batch),
            prng_key=prng_key,
            is_training=True,
        )
        aux = {k: v for k, v in (aux or {}).items() if k != "logits"}
        return loss, dict(aux=aux, summaries=collection.summaries)

    def num_microbatches(self, global_batch_size: int) -> int:
        """Microbatches a step of `global_batch_size` rows runs in (grad_acc_steps, or from
        per_device_microbatch_size); 1 where both are None."""
        if self._config.grad_acc_steps is not None:
            return self._config.grad_acc_steps
        microbatch = self._config.per_device_microbatch_size
        if microbatch is None:
            return 1
        shards = batch_shards(self._mesh, self._config.batch_axis_names)
        per_device = global_batch_size // shards
        count = microbatch_count(per_device, microbatch)
        if count is None:
            raise ConfigError(
                f"{self.path()}.per_device_microbatch_size={microbatch} does not divide the "
                f"{per_device} rows a device gets of a global batch of {global_batch_size} "
                f"over {shards} batch shards; change it or input.global_batch_size"
            )
        return count

    def _train_step(self, state: TrainerState, input_batch: dict[str, jax.Array]):
        prng_key, step_key = jax.random.split(state.prng_key)
        partition = getattr(self.input, "partition_batch", None)  # BaseInput's, if any.
        if partition is not None:
            input_batch = partition(input_batch)
        global_batch_size = jax.tree.leaves(input_batch)[0].shape[0]
        num_microbatches = self._log_microbatches(global_batch_size)  # Once a trace.
        loss_fn = functools.partial(
            self._loss_fn,
            weight_copies=state.weight_copies,
            float32_weight_grads=uses_float32_weight_grads(num_microbatches, self._mesh.size),
        )
        # Split weights are joined here and split again below; XLA fuses both into the
        # update, whose fusions then read and write the halves, never float32 weights.
        params = self._joined_params(state)
        loss, aux, grads = self.learner.compute_gradients(
            loss_fn, params, input_batch, step_key, num_microbatches=num_microbatches
        )
        with jax.named_scope("learner"):
            new_params, new_learner_state, learner_summaries = self.learner.update(
                params, grads, state.learner, param_specs=self._model_param_specs, loss=loss
            )
        summaries = dict(loss=loss, learner=learner_summaries, model=aux["summaries"])
        return self._carried_state(prng_key, new_params, new_learner_state), summaries

    def _log_microbatches(self, global_batch_size: int) -> int:
        """The step's microbatch count for `global_batch_size`, logged where over one (as
        the step is traced, or loaded untraced)."""
        num_microbatches = self.num_microbatches(global_batch_size)
        if num_microbatches > 1:
            log.info(
                "Each step accumulates gradients over %d microbatches of %d rows a device",
                num_microbatches,
                self._config.per_device_microbatch_size,
            )
        return num_microbatches

    def _compile_train_step(self):
        shardings = self._state_shardings()
        return jax.jit(
            self._train_step,
            in_shardings=(shardings, None),
            out_shardings=(shardings, None),
            donate_argnums=(0,),
        )

    def _compile_ahead(self) -> Optional[compilation_cache.CompiledAhead]:
        """The train step compiling in a thread for the state and batch the first step will
        get (`compile_ahead`); None where it is off or the batches are not known ahead."""
        if self._config.compile_ahead is False:
            return None
        try:
            batch = self._abstract_batch()
        except Exception as e:  # pylint: disable=broad-except
            log.info("The train step compiles at the first step: no batch shapes ahead (%s)", e)
            return None
        return compilation_cache.CompiledAhead(
            self._compile_train_step(),
            lambda: (self._abstract_state(), batch),
            what="the train step",
            log_fn=log.info,
            context=lambda: jax.set_mesh(self._mesh),
            store=self._train_step_store(),
        )

    def _train_step_store(self) -> Optional[executable_store.ExecutableStore]:
        """Where a restart of this run finds the train step compiled by its last start
        (`executable_store`): the run directory's, unless the run has none or compiles
        without a cache (--jax_compilation_cache_dir=none)."""
        if self._run_dir is None or not jax.config.values.get("jax_compilation_cache_dir"):
            return None
        return executable_store.ExecutableStore(
            self._run_dir.compiled, "train_step", self._config.debug_string()
        )

    def _take_compiled_ahead(self, input_batch: dict[str, jax.Array]) -> Any:
        """The step compiled ahead, once ready, where it fits the current state and
        `input_batch` (`_ahead_mismatch`); None where there is none or it does not fit
        (logged). Raises the error its compile raised."""
        start = self._start_up
        ahead = None if start is None else start.ahead
        if ahead is None:
            return None
        start.ahead = None
        ahead.wait()
        reason = self._ahead_mismatch(ahead, input_batch)
        if reason is not None:
            start.times.phase("train step compiled ahead, unused")
            log.info("The train step compiled ahead does not fit, so it compiles again: %s", reason)
            return None
        compiled = ahead.result()
        if ahead.loaded:  # Not traced: said here instead.
            self._log_microbatches(jax.tree.leaves(input_batch)[0].shape[0])
        note = f"compiled ahead in {ahead.seconds:.1f} s: {ahead.outcome}"
        start.times.phase("train step ready", note)
        return compiled

    def _ahead_mismatch(
        self, ahead: compilation_cache.CompiledAhead, input_batch: dict[str, jax.Array]
    ) -> Optional[str]:
        """How the state, `input_batch` or the state the step returns differ from the state
        and batch `ahead` was compiled for; None where they agree, or where its compile
        failed before it had them (its result() raises)."""
        if ahead.args is None:
            return None
        state, batch = ahead.args
        new_state = None if ahead.compiled is None else ahead.compiled.out_info[0]
        return (
            compilation_cache.abstract_mismatch(batch, input_batch, "the batch")
            or compilation_cache.abstract_mismatch(state, self._state, "the state")
            or (
                new_state is not None
                and compilation_cache.abstract_mismatch(state, new_state, "the step's new state")
            )
            or None
        )

    @contextlib.contextmanager
    def _first_call_compiling(self):
        """Around the jitted step's first call, which compiles: says so before it starts,
        with its time after (also a phase of the start's times, within run())."""
        outcome = compilation_cache.CacheOutcome()
        before = perf.compile_seconds()
        with perf.compile_notice("the train step", log.info, note=outcome.describe):
            yield
        if self._start_up is not None:
            self._start_up.times.phase(
                "train step ready",
                f"compiled at the first step: {outcome.describe()}",
                seconds=perf.compile_seconds() - before,
            )

    def train_step(self, input_batch: dict[str, jax.Array]) -> dict[str, Any]:
        """Runs one step on a global batch; returns its summaries (device arrays). The first
        call compiles the step, or within run() takes the one compiled ahead
        (`compile_ahead`) where that was compiled for this state and batch."""
        compiling = None
        if self._jit_train_step is None:
            self._jit_train_step = self._take_compiled_ahead(input_batch)
        if self._jit_train_step is None:
            self._jit_train_step = self._compile_train_step()
            compiling = self._first_call_compiling()
        with jax.set_mesh(self._mesh), compiling or contextlib.nullcontext():
            self._state, summaries = self._jit_train_step(self._state, input_batch)
        self._step += 1
        return summaries

    def parameter_norm(self) -> jax.Array:
        """The L2 norm of all model parameters of the current state (float32, on device).

        Computed here, where the loop logs or saves, rather than in every step, whose
        update would otherwise read all parameters once more. A non-finite parameter also
        shows as a non-finite loss one step later, which the loop checks every step.
        """
        if self._jit_parameter_norm is None:
            self._jit_parameter_norm = jax.jit(
                lambda state: global_norm(self._joined_params(state))
            )
        with jax.set_mesh(self._mesh):
            return self._jit_parameter_norm(self._state)

    # ----- evaluation alone -----

    def evaluate(self, *, restore_step: Optional[int] = None) -> dict[str, dict[str, Any]]:
        """Evaluates without training: restores the latest checkpoint, or `restore_step`
        (a fresh run: initializes, from `init_params` if set), runs every evaler once at
        that step, whatever its eval_policy, and returns {evaler name: its metrics}."""
        self._restore_step = restore_step
        self._restore_or_init()
        return self._evaluate(self.model_params())

    def evaluate_params(self, model_params: Any, *, step: int = 0) -> dict[str, dict[str, Any]]:
        """Every evaler once on `model_params` (the model's parameter tree, host or device
        arrays, e.g. a quantized artifact's dequantized), reported at `step`; restores and
        initializes nothing."""
        self._step = step
        shardings = self._param_shardings(self._model_param_specs)
        return self._evaluate(jax.device_put(model_params, shardings))

    def _evaluate(self, model_params: Any) -> dict[str, dict[str, Any]]:
        results = {}
        for name, evaler in self._evalers.items():
            with jax.set_mesh(self._mesh):
                results[name] = evaler.evaluate(
                    self._step, prng_key=jax.random.PRNGKey(self._step), model_params=model_params
                )
            headline = {k: v for k, v in results[name].items() if k in perf.EVAL_HEADLINE_METRICS}
            log.info("eval %s step %d: %s", name, self._step, perf.format_metrics(headline))
        return results

    # ----- the loop -----

    def run(
        self, prng_key: Optional[jax.Array] = None, *, restore_step: Optional[int] = None
    ) -> dict[str, Any]:
        """Trains until max_step; returns the last logged step's summaries (host values).

        Resumes from the newest checkpoint not judged bad, or from `restore_step` (the
        launcher's --restore_step; RestoreStepError, one line listing the committed steps,
        if it is not there or fails its checks). Resumed from `restore_step`, the newer
        checkpoints are judged bad: the run goes on from the chosen step, and replaces
        them as it reaches their steps.

        Holds the directory's lock while it runs (`RunDir.lock`: a second trainer there
        fails at once), unless its RunDir, the launcher's, is held already.
        SIGTERM or SIGINT stops it early: it finishes the current step, saves
        it, flushes the summaries and raises `preemption.Preempted` (the launcher exits
        with `preemption.PREEMPTED_EXIT_CODE`) within `preemption_grace_period_s`; a
        second SIGINT exits at once.
        """
        del prng_key  # The key comes from cfg.seed, so that restarts are reproducible.
        cfg = self._config
        self._restore_step = restore_step
        grace = cfg.preemption_grace_period_s or preemption.DEFAULT_GRACE_PERIOD_S
        with contextlib.ExitStack() as stack:
            if self._run_dir is not None:
                stack.enter_context(self._run_dir.lock())
            self._stop = stack.enter_context(
                preemption.StopRequest(grace_period_s=grace, on_forced_exit=run_lock.release_all)
            )
            try:
                return self._train()
            finally:
                self._stop = None

    def _train(self) -> dict[str, Any]:
        """run()'s loop, with the lock held and the stop signals caught: the state is
        restored or initialized while the train step compiles (`compile_ahead`), then one
        step a batch until max_step or a stop signal."""
        self._start_up = self._begin_start_up()
        try:
            restored = self._restore_or_init()
            self._prepare_to_train()
            self._start_up.times.phase("state (restore)" if restored else "state (init)")
            loop = self._open_loop()
        except BaseException:
            self._end_start_up()
            raise
        try:
            while self._step < self._config.max_step and not loop.stopping:
                self._train_one_step(loop)
            if loop.pending is not None:
                self._check_finite(*loop.pending)
        finally:
            self._end_start_up()
            self._close_loop(loop)
        if loop.stopping:
            raise self._preempted(loop.saved_step)
        return self._finish(loop)

    def _begin_start_up(self) -> "_StartUp":
        """The start's times (from the process's start at the trainer's first run) and the
        train step compiling ahead (`compile_ahead`), unless compiled already."""
        if self._jit_train_step is not None:
            return _StartUp(times=perf.StartTimes())
        times = perf.StartTimes.from_process_start("process to trainer")
        return _StartUp(times=times, ahead=self._compile_ahead())

    def _end_start_up(self) -> None:
        """Waits for a compile ahead that no step took (a failed or empty run), so that no
        compile is left running as the process exits."""
        start, self._start_up = self._start_up, None
        if start is not None and start.ahead is not None:
            if not start.ahead.done():
                log.info("Waiting for the train step's compile (ahead, unused) to end first")
            start.ahead.wait()

    def _prepare_to_train(self) -> None:
        """After the restore or initialization: the norm later ones are measured against,
        newer checkpoints set aside, later summaries dropped."""
        if "checkpointer" in self.children:
            # What later parameter norms are measured against (_check_finite).
            self._good_param_norm = float(self.parameter_norm())
        self._set_aside_newer_checkpoints()
        self._drop_summaries_after(self._step)

    def _open_loop(self) -> "_Loop":
        """Logs the model's size, opens the summary writer and starts reading batches."""
        cfg = self._config
        accounting = perf.StepAccounting.for_trainer(self)
        has_writer = "summary_writer" in self.children
        log_every = cfg.log_every_n_steps or (
            self.summary_writer.config.write_every_n_steps if has_writer else 100
        )
        flops = accounting.flops_per_step
        log.info(
            "Model: %s, %s", accounting.params_text(),
            "no FLOPs count (no TFLOP/s or MFU)" if flops is None
            else f"{flops:.3g} model FLOPs per step",
        )
        if self._step >= cfg.max_step:
            log.info("Step %d is at max_step %d: nothing to train", self._step, cfg.max_step)
        if has_writer:
            self.summary_writer.open()
        # Host batches are read in a thread, two steps ahead, so the host never makes the
        # accelerator wait for input. They are put on the devices here, in this thread:
        # device memory is then always taken in the same order, between one step's
        # dispatch and the next. Taken from the reading thread, a batch could land just
        # above a step's large temporary buffer while it was held, and the next step's
        # buffer could then fit neither below nor above it (out of memory).
        return _Loop(
            accounting=accounting,
            log_every=log_every,
            has_writer=has_writer,
            has_checkpointer="checkpointer" in self.children,
            batches=prefetch_in_thread(self._host_batches(), size=2),
            # The step time of each report's window; it waits for the steps by their state.
            timer=perf.StepTimer(wait=lambda: jax.block_until_ready(self._state)),
            vote_to_stop=preemption.StopVote.over_mesh(self._mesh),
        )

    def _train_one_step(self, loop: "_Loop") -> None:
        """One step of the loop: a batch and the step; the previous step's checks; then as
        due, the reports, evaluation and a checkpoint. After a stop signal (voted on by
        every process), this step is logged and saved, and `loop.stopping` ends the loop."""
        cfg = self._config
        loop.tracing_until = self._maybe_trace(loop.tracing_until)
        summaries = self._dispatch_step(loop)
        # Check the previous step's loss now: that sync overlaps with this step.
        if loop.pending is not None:
            self._check_finite(*loop.pending)
        loop.pending = (self._step, summaries)
        step = self._step
        self.vlog(1, "Step %d: batch %s", step, _shapes(loop.host_batch))
        self.vlog(2, "Step %d: loss %s", step, summaries["loss"])
        loop.stopping = loop.vote_to_stop(self.stop_requested)
        must_log = step % loop.log_every == 0 or step == cfg.max_step or loop.stopping
        writer_due = loop.has_writer and self.summary_writer.should_write(step)
        saving = loop.has_checkpointer and (
            self.checkpointer.should_save(step) or step == cfg.max_step or loop.stopping
        )
        if must_log or writer_due or saving:
            # Never save or report a state whose loss or parameters are not finite.
            if "parameter_norm" not in summaries["learner"]:  # Per-variable mode has it.
                summaries["learner"]["parameter_norm"] = self.parameter_norm()
            self._check_finite(step, summaries)
            loop.pending = None
        if must_log or writer_due:
            self._report(loop, step, summaries, write=writer_due, log_line=must_log)
        self._evaluate_and_save(loop, step, saving=saving)

    def _dispatch_step(self, loop: "_Loop") -> dict[str, Any]:
        """The next batch, put on the devices, and the step on it dispatched; the first step
        of a run is waited for, and the start's times logged."""
        # The prefetcher reads ahead, so the position to save travels with the batch.
        self._input_state, loop.host_batch = next(loop.batches)
        input_batch = self.global_batch(loop.host_batch)
        start = self._start_up
        if start is not None:
            start.times.phase("trackers and first batch")
        # A first step's program is new, compiled by the call or ahead of it.
        with loop.timer.step(new_program=start is not None):
            summaries = self.train_step(input_batch)
        if start is not None:
            jax.block_until_ready(summaries["loss"])
            start.times.phase("first step")
            log.info("%s", start.times.line())
            self._start_up = None
        return summaries

    def _report(
        self, loop: "_Loop", step: int, summaries: dict[str, Any], *, write: bool, log_line: bool
    ) -> None:
        """The step's summaries with the window's step time and rates: to the summary
        writer (`write`), and as the console's progress line (`log_line`)."""
        host = self._host_summaries(summaries)
        step_time = loop.timer.mean_step_s()
        if step_time is not None:  # None: the window has no step with measured time.
            host.update(loop.accounting.metrics(step_time))
        loop.timer.restart()
        if write:
            self.summary_writer(step, host)
        if log_line:
            mean_loss = self._window_loss.take()
            log.info(perf.progress_line(step, self._config.max_step, host, mean_loss=mean_loss))
        loop.last = host

    def _evaluate_and_save(self, loop: "_Loop", step: int, *, saving: bool) -> None:
        """The evalers due at `step`, and its checkpoint where `saving`."""
        due = self._due_evalers(step)
        if not (due or saving):
            return
        loop.timer.pause()  # Evaluation and saving are not step time.
        # One join serves the evalers and the checkpoint alike: with split weights it
        # writes every weight as a new float32 array, so it happens only at these steps
        # and is dropped right after.
        model_params = self.model_params()
        self._run_evalers(step, due, model_params)
        if saving and self._save(step, model_params):
            loop.saved_step = step
        del model_params

    def _close_loop(self, loop: "_Loop") -> None:
        """Stops reading batches and tracing; waits for the checkpoint being written and
        flushes the summaries."""
        loop.batches.close()
        if loop.tracing_until is not None:
            self._stop_trace()
        if loop.has_checkpointer:
            self.checkpointer.wait_until_finished()
        if loop.has_writer:
            self.summary_writer.flush()

    def _finish(self, loop: "_Loop") -> dict[str, Any]:
        """run()'s result: the last logged step's host summaries (or the step alone)."""
        if loop.saved_step is not None:
            log.info(
                "Finished at step %d; latest checkpoint: step %d", self._step, loop.saved_step
            )
        if not loop.last and self._step:
            return {"step": self._step}
        return loop.last

    def _set_aside_newer_checkpoints(self) -> None:
        """After a restore of an explicit restore_step, judges the newer checkpoints bad:
        they are not this run's past any more, so no later resume may pick them."""
        if self._restore_step is None:
            return
        checkpointer = self.checkpointer
        newer = [s for s in checkpointer.committed_steps() if s > self._step]
        for step in newer:
            checkpointer.set_verdict(
                step, False, reason=f"set aside: the run was restarted from step {self._step}"
            )
        checkpointer.wait_until_finished()
        if newer:
            log.warning(
                "Restored step %d as asked: the newer checkpoints %s are set aside (judged "
                "bad) and replaced as training reaches them", self._step, newer,
            )

    def _drop_summaries_after(self, step: int) -> None:
        """Drops the summary records past `step` (the restored step, 0 for a fresh run):
        the steps after it are trained, and written, again."""
        writers = [self] + list(self._evalers.values())
        for owner in writers:
            writer = owner.children.get("summary_writer")
            if hasattr(writer, "drop_records_after"):
                writer.drop_records_after(step)

    def vlog(self, level: int, message: str, *args) -> None:
        """Logs `message % args` if the config's `vlog` is at least `level`."""
        vlog = self._config.vlog
        if vlog is not None and level <= vlog:
            log.info(message, *args)

    def _preempted(self, saved_step: Optional[int]) -> preemption.Preempted:
        """The error ending a run stopped by a signal, once its last step is saved."""
        signal_name = self._stop.signal_name or "a stop signal on another process"
        if saved_step is not None:
            saved = (
                f"saved step {saved_step} in {self.checkpointer.directory}; a restart resumes "
                "there"
            )
        else:
            saved = "nothing saved (the trainer has no directory)"
        message = f"Stopped at step {self._step} on {signal_name}: {saved}"
        log.warning("%s", message)
        return preemption.Preempted(
            message, step=self._step, saved_step=saved_step, signal_name=signal_name
        )

    def _host_batches(self):
        """Yields (input state after this batch, this process's rows of the batch)."""
        for batch in self.input.dataset():
            yield self.input.get_state(), batch

    def _maybe_trace(self, tracing_until: Optional[int]) -> Optional[int]:
        cfg = self._config
        if tracing_until is not None and self._step >= tracing_until:
            self._stop_trace()
            tracing_until = None
        if (
            tracing_until is None
            and cfg.start_trace_steps
            and self._step in cfg.start_trace_steps
            and jax.process_index() in cfg.start_trace_process_indices
            and self._run_dir is not None
        ):
            trace_dir = self._run_dir.traces
            jax.profiler.start_trace(trace_dir)
            tracing_until = self._step + (cfg.start_trace_num_steps or 3)
            log.info("Tracing steps %d-%d into %s", self._step + 1, tracing_until, trace_dir)
        return tracing_until

    def _stop_trace(self) -> None:
        # Wait for the traced steps to finish on the device, so the trace holds all of them.
        jax.block_until_ready(self._state)
        jax.profiler.stop_trace()
        log.info("Stopped trace at step %d", self._step)

    def _check_finite(self, step: int, summaries: dict[str, Any]) -> None:
        """Checks step `step`'s loss and skip count (and the parameter norm where the loop
        logs or saves), once per step, at the cadence of the loop's host reads.

        A step whose update the optimizer skipped is bad: counted, warned about, and
        ConsecutiveBadStepsError once max_consecutive_bad_steps come in a row. A
        non-finite loss or parameter norm the optimizer did not skip raises
        NonFiniteLossError; a parameter norm over MAX_PARAMETER_NORM_GROWTH times the
        newest good state's, ParameterNormBlowUpError. Each of those first judges bad the
        checkpoints not judged good yet. The check also gives the checkpoint saved at the
        step before `step` its verdict (`_judge_saved_step`).
        """
        learner_summaries = summaries.get("learner", {})
        loss = float(summaries["loss"])
        self._window_loss.add(loss)
        skipped = learner_summaries.get("skipped_steps")
        skipped = None if skipped is None else int(skipped)
        newly_skipped = skipped is not None and skipped > self._skipped_steps
        if skipped is not None:
            self._skipped_steps = skipped
        self._checked_step = step
        # Step `step` trained on the state before it: that state's verdict, if it waits.
        grad_norm = learner_summaries.get("gradient_norm")
        self._judge_saved_step(
            step,
            good=not newly_skipped
            and math.isfinite(loss)
            and (grad_norm is None or math.isfinite(float(grad_norm))),
        )
        # The parameter norm after the update (on the steps the loop logs or saves) catches a
        # finite loss whose update overflowed.
        param_norm = learner_summaries.get("parameter_norm")
        param_norm = 0.0 if param_norm is None else float(param_norm)
        self._checked_param_norm = param_norm if "parameter_norm" in learner_summaries else None
        if not math.isfinite(param_norm) or not (math.isfinite(loss) or newly_skipped):
            what = f"Loss became {loss}" if not math.isfinite(loss) else (
                f"The parameter norm became {param_norm} (loss {loss})"
            )
            self._condemn_unjudged_steps(f"the run diverged at step {step}: {what}")
            raise NonFiniteLossError(
                f"{what} at step {step}. Nothing was saved after it; "
                f"{self._last_good_checkpoint()}. Lower the learning rate, enable "
                "skip_and_clip_by_global_norm, or check the input."
            )
        reference = self._good_param_norm
        if reference and param_norm > MAX_PARAMETER_NORM_GROWTH * reference:
            what = (
                f"The parameter norm grew from {reference:.4g} (the last good state) to "
                f"{param_norm:.4g} at step {step}, over {MAX_PARAMETER_NORM_GROWTH:g} times"
            )
            self._condemn_unjudged_steps(f"the run diverged at step {step}: {what}")
            raise ParameterNormBlowUpError(
                f"{what}: an update blew the parameters up (loss {loss}). Nothing was saved "
                f"after it; {self._last_good_checkpoint()}. Lower the learning rate."
            )
        bad = self._bad_steps
        if not newly_skipped:
            if bad.consecutive > 1:
                log.warning(
                    "Step %d updated the parameters again after %d skipped steps (steps %d-%d)",
                    step, bad.consecutive, bad.first, step - 1,
                )
            bad.record(step, bad=False, loss_finite=True)
            return
        bad.record(step, bad=True, loss_finite=math.isfinite(loss))
        limit = self._config.max_consecutive_bad_steps or DEFAULT_MAX_CONSECUTIVE_BAD_STEPS
        if bad.consecutive >= limit:
            self._condemn_unjudged_steps(
                f"the run diverged: {bad.consecutive} bad steps in a row (steps {bad.first}-{step})"
            )
            raise ConsecutiveBadStepsError(
                f"{bad.consecutive} bad steps in a row (steps {bad.first}-{step}): the optimizer "
                f"skipped every update (last loss {loss}). Nothing was saved from step "
                f"{bad.first} on; {self._last_good_checkpoint()}. Lower the learning rate or "
                f"check the input; {self.path()}.max_consecutive_bad_steps={limit} stops the run."
            )
        # The first step of a run of bad steps warns, then the 2nd, 4th, 8th...: a long run
        # stays readable in the log.
        if bad.consecutive & (bad.consecutive - 1) == 0:
            log.warning(
                "Step %d: loss is %s; the optimizer skipped the update (%d steps skipped so "
                "far, %d in a row; %d in a row stop the run)",
                step, loss, skipped, bad.consecutive, limit,
            )

    def _judge_saved_step(self, step: int, *, good: bool) -> None:
        """Gives the saved step awaiting its verdict one, once `step` (the step after it)
        is checked: good where `step` had a finite loss and gradient norm and was not
        skipped. A saved state is judged by the step that trains on it, so that a state
        whose update blew up (finite, but too large to train on) is never named good; its
        parameter norm is then what later ones are measured against.
        Without a verdict, a step is judged bad if the run diverges before a later step
        is judged good (`_condemn_unjudged_steps`)."""
        if self._awaiting_verdict is None or step != self._awaiting_verdict[0] + 1:
            return
        saved, norm = self._awaiting_verdict
        self._awaiting_verdict = None
        if good:
            self.checkpointer.set_verdict(saved, True)
            if norm is not None:
                self._good_param_norm = norm
        else:
            log.warning("Checkpoint step %d stays without a verdict: step %d was bad", saved, step)

    def _condemn_unjudged_steps(self, reason: str) -> None:
        """Records a bad verdict on every committed step newer than the newest good one:
        none of them has been seen to train on, so a rerun must not restore them (an
        explicit restore_step still can)."""
        if "checkpointer" not in self.children:
            return
        checkpointer = self.checkpointer
        checkpointer.wait_until_finished()
        good = checkpointer.latest_good_step()
        for step in checkpointer.committed_steps():
            if (good is None or step > good) and checkpointer.verdict(step) is not True:
                checkpointer.set_verdict(step, False, reason=reason)
        checkpointer.wait_until_finished()

    def _last_good_checkpoint(self) -> str:
        """Names the newest checkpoint saved as good (after any save in flight)."""
        if "checkpointer" not in self.children:
            return "no checkpoint was committed before it"
        checkpointer = self.checkpointer
        checkpointer.wait_until_finished()
        good = checkpointer.latest_good_step()
        if good is not None:
            return f"the last good checkpoint is step {good} in {checkpointer.directory}"
        latest = checkpointer.latest_committed_step()
        if latest is None:
            return "no checkpoint was committed before it"
        return (
            f"no checkpoint in {checkpointer.directory} is judged good (committed: "
            f"{checkpointer.committed_steps()}; --restore_step=N restores one anyway)"
        )

    def _host_summaries(self, summaries: dict[str, Any]) -> dict[str, Any]:
        """The step's scalar summaries as host values, with the run's bad-step counts."""
        flat = {}
        for path, value in flatten_with_paths(
            summaries, is_leaf=lambda x: isinstance(x, WeightedScalar)
        ):
            value = scalar_value(value)
            array = np.asarray(value)
            if array.size == 1:
                flat[path] = array.item()
        flat.update(self._bad_steps.summaries())
        return flat

    def _due_evalers(self, step: int) -> dict[str, SpmdEvaler]:
        """The evalers that evaluate at `step`, by name."""
        return {name: evaler for name, evaler in self._evalers.items() if evaler.due(step)}

    def _run_evalers(self, step: int, due: dict[str, SpmdEvaler], model_params: Any) -> None:
        """Runs the `due` evalers on `model_params` (the float32 parameters) at `step`."""
        for name, evaler in due.items():
            with jax.set_mesh(self._mesh):
                results = evaler.eval_step(
                    step, prng_key=jax.random.PRNGKey(step), model_params=model_params
                )
            if results:
                # The evaler logs every metric; this line keeps the headline ones readable.
                headline = {k: v for k, v in results.items() if k in perf.EVAL_HEADLINE_METRICS}
                log.info("eval %s step %d: %s", name, step, perf.format_metrics(headline))

    def _save(self, step: int, model_params: Any) -> bool:
        """Saves the state at `step` with `model_params` (the float32 parameters), unless
        `step` is bad or follows bad steps; returns whether it saved. The checkpoint gets
        its verdict once the next step is checked (`_judge_saved_step`).

        `step` must be checked first (`_check_finite`): no state is committed whose loss
        was not seen to be finite. Summaries up to `step` are flushed to disk first, so that
        a run resumed from this checkpoint finds every step before it in metrics.jsonl.
        """
        if self._checked_step != step:
            raise RuntimeError(
                f"Checkpoint step {step} would be saved unchecked (last checked: step "
                f"{self._checked_step}); call _check_finite on its summaries first"
            )
        bad = self._bad_steps
        if bad.consecutive:
            log.warning(
                "Not saving checkpoint step %d: it is bad step %d in a row (since step %d); %s",
                step, bad.consecutive, bad.first, self._last_good_checkpoint(),
            )
            return False
        log.info("Saving checkpoint step %d in %s", step, self.checkpointer.directory)
        if "summary_writer" in self.children:
            self.summary_writer.flush(durable=True)
        extra = {}
        if self._config.save_input_iterator:
            extra["input_iterator"] = self._input_state
        if self._unsaved_paths:
            extra[FROZEN_FINGERPRINT] = self._frozen_params_fingerprint()
        state = dataclasses.replace(self._state, model=self._saved(model_params))
        self.checkpointer.save(step, _to_state_dict(state), extra=extra)
        self._awaiting_verdict = (step, self._checked_param_norm)
        return True


# The `extra` field of a checkpoint's index holding `params_fingerprint` of the parameters
# it leaves out (SpmdTrainer.Config.checkpoint_frozen_params).
FROZEN_FINGERPRINT = "frozen_params_fingerprint"


def frozen_param_paths(learner: Learner, param_specs: Any) -> frozenset:
    """The '/'-paths of the parameters `learner` never updates ('no_update')."""
    return frozenset(
        path
        for path, _ in flatten_with_paths(param_specs, is_leaf=is_parameter_spec)
        if learner.update_type(path) != "all"
    )


def drop_paths(tree: Any, paths: frozenset) -> Any:
    """`tree` without the leaves at `paths` (and without dicts left empty)."""
    flat = [(p, x) for p, x in flatten_with_paths(tree) if p not in paths]
    return unflatten_paths(dict(flat))


@jax.jit
def _fingerprints(flat: dict[str, jax.Array]) -> dict[str, jax.Array]:
    def one(x):
        bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
        bits = bits.reshape(-1).astype(jnp.uint32)
        weights = (jnp.arange(bits.size, dtype=jnp.uint32) % jnp.uint32(65521)) + jnp.uint32(1)
        return jnp.sum(bits * weights, dtype=jnp.uint32)

    return {path: one(x) for path, x in flat.items()}


def params_fingerprint(flat: dict[str, Any]) -> dict[str, int]:
    """{path: a 32-bit fingerprint of the array's bits}: the sum of each element's bits
    times a weight from 1 to 65521 by position, so any one changed element changes it."""
    return {path: int(value) for path, value in _fingerprints(dict(flat)).items()}


def check_fingerprint(
    actual: dict[str, int], recorded: dict[str, Any], *, source: str, step: int
) -> None:
    """Raises CheckpointMismatchError naming the first parameter whose fingerprint from
    `source` differs from the one checkpoint `step` recorded."""
    for path in sorted(set(actual) | set(recorded)):
        if actual.get(path) != recorded.get(path):
            raise CheckpointMismatchError(
                f"The frozen parameter {path} from {source} is not the one checkpoint step "
                f"{step} was trained with (fingerprint {actual.get(path)} against "
                f"{recorded.get(path)}): the source changed since"
            )


def _shapes(batch: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {key: tuple(getattr(value, "shape", ())) for key, value in batch.items()}

