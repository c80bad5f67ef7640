"""Evaluation: run a model over an eval input at chosen steps and report its summaries.

The trainer owns a dict of `SpmdEvaler`s. At every step it calls
`evaler.eval_step(step, prng_key=..., model_params=...)`; the evaler's `eval_policy`
decides whether to run. A run casts the parameters to `eval_dtype`, feeds every batch of
the evaler's own input through the model (`ModelSummaryAccumulator`: the model method
under jit, its output-collection summaries accumulated by weight), writes the result to
its summary writer (`<trainer_dir>/summaries/<evaler name>`) and returns it flat:
'loss', 'perplexity' (exp of the token-weighted mean cross entropy), 'bits_per_byte'
when the model reports it, and the model's other summaries. On a terminal, a progress
bar counts the batches of the pass (`axlearn.common.progress`).
"""

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from axlearn.common.base_layer import ParameterSpec
from axlearn.common.config import (
    REQUIRED,
    ConfigError,
    InstantiableConfig,
    Required,
    config_class,
    config_for_function,
    register_configurable,
)
from axlearn.common.metrics import MetricAccumulator
from axlearn.common.module import Module, Tensor, functional
from axlearn.common.progress import progress_bar
from axlearn.common.run_dir import RunDir
from axlearn.common.sharding import batch_shards, global_batch, microbatch_count, named_sharding
from axlearn.common.summary import WeightedScalar
from axlearn.common.summary_writer import SummaryWriter, flatten_summaries, host_value
from axlearn.common.utils import cast_floats

# Batch axes used when the config names none: the trainer's default batch_axis_names.
_DEFAULT_BATCH_AXIS_NAMES = ("data", "expert", "fsdp", "seq")


@register_configurable
def every_n_steps_policy(
    n: int = 1, *, min_step: int = 1, max_step: Optional[int] = None
) -> Callable[[int], bool]:
    """A policy that evaluates at every multiple of `n` from `min_step` on, and at `max_step`.

    `max_step` (usually the trainer's) makes the final model evaluated even when it is
    not a multiple of `n`.
    """
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"every_n_steps_policy: n must be a positive int, got {n!r}")

    def policy(step: int) -> bool:
        if step < min_step:
            return False
        return step % n == 0 or (max_step is not None and step == max_step)

    return policy


def _current_mesh() -> Optional[jax.sharding.Mesh]:
    """The mesh set with `jax.set_mesh`, or None."""
    mesh = jax.sharding.get_mesh()
    return None if mesh is None or mesh.empty else mesh


class ModelSummaryAccumulator(Module):
    """Runs a model method on each batch under jit and accumulates its summaries."""

    @config_class
    class Config(Module.Config):
        """Configures ModelSummaryAccumulator."""

        metric_accumulator: InstantiableConfig = MetricAccumulator.default_config()
        # The model method to call with the input batch; its summaries are accumulated.
        model_method: str = "forward"

    def __init__(
        self,
        cfg: Config,
        *,
        parent: Optional[Module],
        model: Module,
        model_param_partition_specs: Any = None,
    ):
        super().__init__(cfg, parent=parent)
        if not callable(getattr(model, cfg.model_method, None)):
            raise ConfigError(
                f"{self.path()}.model_method: {type(model).__name__} has no method "
                f"'{cfg.model_method}'"
            )
        self._model = model
        self._model_param_partition_specs = model_param_partition_specs
        self._accumulator = cfg.metric_accumulator.instantiate()
        self._summaries_fn = jax.jit(self._batch_summaries)

    @property
    def model_param_partition_specs(self) -> Any:
        return self._model_param_partition_specs

    def _batch_summaries(self, model_params: Any, prng_key: Tensor, input_batch: Any) -> Any:
        _, collection = functional(
            self._model,
            state=model_params,
            inputs=(input_batch,),
            prng_key=prng_key,
            is_training=False,
            method=self._config.model_method,
        )
        return collection.summaries

    def start(self) -> None:
        """Begins a new evaluation."""
        self._accumulator.reset()

    def add_batch(self, *, model_params: Any, prng_key: Tensor, input_batch: Any) -> None:
        """Runs the model on one (global) batch and accumulates its summaries."""
        self._accumulator.update(self._summaries_fn(model_params, prng_key, input_batch))

    def summaries(self) -> dict[str, Any]:
        """The summaries accumulated since `start()`, nested as the model adds them."""
        return self._accumulator.summaries()


def _partition_spec(spec: Any) -> PartitionSpec:
    if isinstance(spec, ParameterSpec):
        return spec.partition_spec
    if isinstance(spec, PartitionSpec):
        return spec
    return PartitionSpec(*(spec or ()))


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (ParameterSpec, PartitionSpec, tuple, list))


def _with_derived_metrics(flat: dict[str, Any]) -> dict[str, Any]:
    """Replaces each 'perplexity' by exp of its sibling 'cross_entropy' mean.

    The mean of per-batch perplexities is not the perplexity of the whole set; exp of
    the token-weighted mean cross entropy is.
    """
    out = dict(flat)
    for name, value in flat.items():
        if name.rsplit("/", 1)[-1] != "cross_entropy":
            continue
        mean = value.mean if isinstance(value, WeightedScalar) else value
        weight = value.weight if isinstance(value, WeightedScalar) else 1.0
        perplexity_name = name[: -len("cross_entropy")] + "perplexity"
        out[perplexity_name] = WeightedScalar(jnp.exp(mean), weight)
    return out


class SpmdEvaler(Module):
    """Evaluates the model over its own input when `eval_policy` says so."""

    @config_class
    class Config(Module.Config):
        """Configures SpmdEvaler."""

        # Floating-point parameters are cast to this dtype for evaluation; None: no cast.
        eval_dtype: Any = jnp.bfloat16
        # A config of a function returning `policy(step) -> bool`.
        eval_policy: InstantiableConfig = config_for_function(every_n_steps_policy)
        input: Required[InstantiableConfig] = REQUIRED  # Yields host-local numpy batches.
        metric_calculator: InstantiableConfig = ModelSummaryAccumulator.default_config()
        summary_writer: InstantiableConfig = SummaryWriter.default_config()
        # Mesh axes (a name or names) the batch dimension is split over; None: those of
        # ('data', 'expert', 'fsdp', 'seq') that the current mesh has. Axes the mesh
        # lacks are ignored.
        batch_axis_names: Optional[Union[str, Sequence[str]]] = None
        # Rows each device runs at once: a larger share of an eval batch is fed to the
        # model in pieces of this size, with the same summaries as the whole batch. The
        # trainer sets its own per_device_microbatch_size here when this is None.
        per_device_microbatch_size: Optional[int] = None

    def __init__(
        self,
        cfg: Config,
        *,
        parent: Optional[Module],
        model: Module,
        model_param_partition_specs: Any = None,
    ):
        super().__init__(cfg, parent=parent)
        self._add_child("input", cfg.input)
        self._add_child(
            "metric_calculator",
            cfg.metric_calculator,
            model=model,
            model_param_partition_specs=model_param_partition_specs,
        )
        writer_cfg = cfg.summary_writer.clone()
        if writer_cfg.dir is None:
            writer_cfg.dir = self._default_summary_dir(parent)
        if writer_cfg.dir is None:
            # Like the trainer without a directory: results are returned, not written.
            logging.info("%s: no summary directory; summaries are not written", self.path())
        else:
            self._add_child("summary_writer", writer_cfg)
        self._policy = cfg.eval_policy.instantiate()
        self._model_param_partition_specs = model_param_partition_specs
        self._cast_fns: dict[Any, Callable] = {}

    def _default_summary_dir(self, parent: Optional[Module]) -> Optional[str]:
        """<run dir>/summaries/<evaler name> when the parent (the trainer) has a run
        directory (its `run_dir`, a `RunDir`)."""
        run: Optional[RunDir] = getattr(parent, "run_dir", None)
        return None if run is None else run.summaries(self.name)

    # ----- parameters and batches -----

    def _cast_params(self, model_params: Any) -> Any:
        """Floating-point parameters in eval_dtype, laid out by their partition specs."""
        dtype = self._config.eval_dtype
        if dtype is None:
            return model_params
        mesh = _current_mesh()
        key = mesh  # One compiled cast per mesh (None: no mesh set).
        if key not in self._cast_fns:
            out_shardings = None
            if mesh is not None and self._model_param_partition_specs is not None:
                out_shardings = jax.tree_util.tree_map(
                    lambda spec: named_sharding(mesh, _partition_spec(spec)),
                    self._model_param_partition_specs,
                    is_leaf=_is_spec_leaf,
                )

            self._cast_fns[key] = jax.jit(
                lambda params: cast_floats(params, dtype), out_shardings=out_shardings
            )
        return self._cast_fns[key](model_params)

    def _batch_axis_names(self) -> Union[str, Sequence[str]]:
        return self._config.batch_axis_names or _DEFAULT_BATCH_AXIS_NAMES

    def _microbatches(self, batch: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        """`batch` in host-local pieces of per_device_microbatch_size rows a device."""
        microbatch, mesh = self._config.per_device_microbatch_size, _current_mesh()
        rows = [np.shape(x)[0] for x in jax.tree_util.tree_leaves(batch) if np.ndim(x)]
        if microbatch is None or not rows:
            return [batch]
        shards = 1 if mesh is None else batch_shards(mesh, self._batch_axis_names())
        per_device = rows[0] * jax.process_count() // shards
        k = microbatch_count(per_device, microbatch)
        if k is None:
            raise ValueError(
                f"{self.path()}.per_device_microbatch_size={microbatch} does not divide the "
                f"{per_device} rows a device gets of an eval batch"
            )
        if k == 1:
            return [batch]
        piece = rows[0] // k  # Host-local rows; each piece splits evenly over the devices.

        def rows_of(i: int) -> Callable[[Any], Any]:
            return lambda x: x[i * piece : (i + 1) * piece] if np.ndim(x) else x

        return [jax.tree_util.tree_map(rows_of(i), batch) for i in range(k)]

    def _global_batch(self, batch: Mapping[str, Any]) -> Any:
        """Host-local numpy arrays -> jax arrays, split over the batch axes of the mesh."""
        mesh = _current_mesh()
        if mesh is None:
            return jax.tree_util.tree_map(jnp.asarray, batch)
        return global_batch(batch, mesh, self._batch_axis_names(), path=self.path())

    # ----- evaluation -----

    def due(self, step: int) -> bool:
        """Whether the eval policy evaluates at `step`."""
        return bool(self._policy(step))

    def eval_step(
        self, step: int, *, prng_key: Tensor, model_params: Any
    ) -> Optional[dict[str, Any]]:
        """Evaluates at `step` if the policy says so; returns the flat summaries or None."""
        if not self.due(step):
            return None
        return self.evaluate(step, prng_key=prng_key, model_params=model_params)

    def evaluate(self, step: int, *, prng_key: Tensor, model_params: Any) -> dict[str, Any]:
        """One pass over the input at `step`, whatever the policy; returns the flat
        summaries (also written to the summary writer)."""
        start = time.time()
        params = self._cast_params(model_params)
        calculator = self.metric_calculator
        calculator.start()
        num_batches = 0
        # Inputs that know the length of a pass (`num_eval_batches`) give the bar its end.
        total = getattr(self.input, "num_eval_batches", None)
        with progress_bar(total=total, desc=f"Evaluating {self.name}", unit="batch") as bar:
            for batch in self.input.dataset():
                for microbatch in self._microbatches(batch):
                    calculator.add_batch(
                        model_params=params,
                        prng_key=(
                            None if prng_key is None else jax.random.fold_in(prng_key, num_batches)
                        ),
                        input_batch=self._global_batch(microbatch),
                    )
                    num_batches += 1
                bar.update()
        if num_batches == 0:
            raise ValueError(f"{self.path()}: the eval input yielded no batches")
        summaries = _with_derived_metrics(flatten_summaries(calculator.summaries()))
        if "summary_writer" in self.children:
            self.summary_writer(step, summaries)
            self.summary_writer.flush()
        result = {name: self._host_number(value) for name, value in summaries.items()}
        # The trainer logs the headline metrics; every summary is at debug level.
        logging.debug(
            "%s step %d (%d batches, %.1fs): %s",
            self.path(),
            step,
            num_batches,
            time.time() - start,
            ", ".join(f"{k}={v:.6g}" for k, v in sorted(result.items()) if isinstance(v, float)),
        )
        return result

    @staticmethod
    def _host_number(value: Any) -> Any:
        """A Python float for scalars (a WeightedScalar's mean), else a NumPy array."""
        if isinstance(value, WeightedScalar):
            value = value.mean
        array = np.asarray(host_value(value))
        return float(array) if array.ndim == 0 else array
