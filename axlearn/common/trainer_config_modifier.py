"""Config modifiers: named, reviewable edits of a trainer config.

Mesh rules map an instance type to either a mesh shape or one of these modifiers, so
that what changes on new hardware (mesh, remat policy, partition specs, any module's
config, trainer fields such as `per_device_microbatch_size`) is data that shows up in
golden configs.
"""

from collections.abc import Sequence
from typing import Any, Optional

from axlearn.common.config import (
    REQUIRED,
    ConfigBase,
    ConfigError,
    ConfigModifier,
    Required,
    config_class,
    config_for_function,
    get_recursively,
    set_recursively,
)
from axlearn.common.metrics import MetricAccumulator


class MeshShapeModifier(ConfigModifier):
    """Sets `mesh_shape`."""

    @config_class
    class Config(ConfigModifier.Config):
        """Configures MeshShapeModifier."""

        mesh_shape: Required[Sequence[int]] = REQUIRED

    def __call__(self, cfg):
        cfg.mesh_shape = tuple(self.config.mesh_shape)
        return cfg


class RematSpecModifier(ConfigModifier):
    """Sets `remat_spec` of the modules at the given config paths."""

    @config_class
    class Config(ConfigModifier.Config):
        """Configures RematSpecModifier."""

        # Config path (e.g. 'model.decoder.transformer.layer') -> remat spec dict or None.
        remat_policies: Required[dict[str, Any]] = REQUIRED

    def __call__(self, cfg):
        for path, remat_spec in self.config.remat_policies.items():
            target = _module_config(cfg, path, "remat_spec")
            target.remat_spec = remat_spec
        return cfg


class TrainerFieldsModifier(ConfigModifier):
    """Sets fields of the trainer config itself, e.g. `carry_train_dtype_weights`."""

    @config_class
    class Config(ConfigModifier.Config):
        """Configures TrainerFieldsModifier."""

        fields: Required[dict[str, Any]] = REQUIRED  # Field name -> value.

    def __call__(self, cfg):
        for name, value in self.config.fields.items():
            if name not in cfg.keys():
                raise ConfigError(f"TrainerFieldsModifier: the trainer config has no '{name}'")
            setattr(cfg, name, value)
        return cfg


class ModuleConfigModifier(ConfigModifier):
    """Replaces the config at `target_config` with `modification`, keeping shared fields.

    As AXLearn's: every field (but `klass`) that both the old and the new config have
    keeps its old value, whatever `modification` sets it to; only the fields the old
    config lacks come from `modification`.
    """

    @config_class
    class Config(ConfigModifier.Config):
        """Configures ModuleConfigModifier."""

        target_config: Required[str] = REQUIRED  # Config path, e.g. 'model.decoder.transformer'.
        modification: Required[ConfigBase] = REQUIRED

    def __call__(self, cfg):
        path, new = self.config.target_config, self.config.modification.clone()
        old = get_recursively(cfg, path)
        if not isinstance(old, ConfigBase):
            raise ConfigError(f"ModuleConfigModifier: '{path}' is not a config")
        for name in new.keys():
            if name != "klass" and name in old.keys():
                setattr(new, name, getattr(old, name))
        set_recursively(cfg, path, new)
        return cfg


class PartitionSpecModifier(ConfigModifier):
    """Sets partition-spec fields of modules by config path."""

    @config_class
    class Config(ConfigModifier.Config):
        """Configures PartitionSpecModifier."""

        # Config path -> {field name (e.g. 'param_partition_spec'): spec}.
        partition_specs: Required[dict[str, dict[str, Any]]] = REQUIRED

    def __call__(self, cfg):
        for path, fields in self.config.partition_specs.items():
            for field, spec in fields.items():
                if "partition_spec" not in field:
                    raise ConfigError(
                        f"PartitionSpecModifier: '{path}.{field}' is not a partition spec"
                    )
                target = _module_config(cfg, path, field)
                setattr(target, field, spec)
        return cfg


class GradientAccumulationModifier(ConfigModifier):
    """Runs each step as `grad_acc_steps` microbatches whose gradients are averaged, so the
    step equals the full-batch step in less memory (sets the trainer's grad_acc_steps)."""

    @config_class
    class Config(ConfigModifier.Config):
        """Configures GradientAccumulationModifier."""

        grad_acc_steps: Required[int] = REQUIRED  # Microbatches per step.
        # How the microbatches' summaries combine. The step combines them in-graph by
        # MetricAccumulator's rule (WeightedScalars by weight, floats averaged, integer
        # counts summed), the one rule supported.
        metric_accumulator: ConfigBase = MetricAccumulator.default_config()

    def __call__(self, cfg):
        modifier = self.config
        if getattr(modifier.metric_accumulator, "klass", None) is not MetricAccumulator:
            raise ConfigError(
                "GradientAccumulationModifier.metric_accumulator: only "
                f"MetricAccumulator is supported, got {modifier.metric_accumulator!r}"
            )
        if "grad_acc_steps" not in cfg.keys():
            raise ConfigError("GradientAccumulationModifier: the config is not a trainer's")
        cfg.grad_acc_steps = modifier.grad_acc_steps
        return cfg


class ChainConfigModifier(ConfigModifier):
    """Applies several modifiers in order."""

    @config_class
    class Config(ConfigModifier.Config):
        """Configures ChainConfigModifier."""

        config_modifiers: Required[Sequence[ConfigModifier.Config]] = REQUIRED

    def __call__(self, cfg):
        for modifier in self.config.config_modifiers:
            cfg = modifier.instantiate()(cfg)
        return cfg


def _module_config(cfg: ConfigBase, path: str, field: str) -> ConfigBase:
    target = get_recursively(cfg, path)
    if not isinstance(target, ConfigBase) or field not in target.keys():
        raise ConfigError(f"'{path}' is not a config with a '{field}' field")
    return target


def apply_mesh_rule(cfg: ConfigBase, rule_value: Optional[Any]) -> ConfigBase:
    """Applies a mesh rule's value: a mesh shape, a modifier config, or None (no change)."""
    if rule_value is None:
        return cfg
    if isinstance(rule_value, ConfigModifier.Config):
        return rule_value.instantiate()(cfg)
    if isinstance(rule_value, (list, tuple)) and all(isinstance(d, int) for d in rule_value):
        cfg.mesh_shape = tuple(rule_value)
        return cfg
    raise ConfigError(
        f"A mesh rule's value must be a mesh shape or a ConfigModifier config, got {rule_value!r}"
    )


class FP8ConfigModifier(ConfigModifier):
    """Switches the matmuls of the model's transformer layers to FP8 (`axlearn.common.fp8`).

    Every layer with an `fp8` field inside a `TransformerLayer` (the attention's input and
    output projections and the feed-forward linears) gets an `Fp8Matmul`: e4m3 operands
    forward, e5m2 gradients backward. The token embedding, the logits (tied or an
    untied `lm_head`) and attention's own products stay in the train dtype, and so do
    the float32 weights and the optimizer. With delayed scaling the learner becomes an
    `Fp8Learner`, which writes the scaling state.
    """

    @config_class
    class Config(ConfigModifier.Config):
        """Configures FP8ConfigModifier."""

        # > 0: delayed scaling over this many steps' amaxes (Fp8Matmul.amax_history_length);
        # 0: current scaling, each scale from the tensor being cast.
        fp8_amax_history_length: Required[int] = REQUIRED

    def __call__(self, cfg):
        # Imported here: the model and learner modules import jax, configs do not need it.
        # pylint: disable=import-outside-toplevel
        from axlearn.common.attention import TransformerLayer
        from axlearn.common.fp8 import Fp8Matmul
        from axlearn.common.fp8_learner import Fp8Learner
        from axlearn.common.learner import Learner

        length = self.config.fp8_amax_history_length
        if not isinstance(length, int) or isinstance(length, bool) or length < 0:
            raise ConfigError(
                "FP8ConfigModifier.fp8_amax_history_length must be an int >= 0 (0: current "
                f"scaling), got {length!r}"
            )
        fp8 = Fp8Matmul.default_config().set(amax_history_length=length)
        switched = []

        def enter_layer(path: str, value: Any) -> bool:
            if isinstance(value, ConfigBase) and "fp8" in value.keys():
                value.fp8 = fp8.clone()
                switched.append(path)
                return False
            return True

        def enter(path: str, value: Any) -> bool:
            if isinstance(value, TransformerLayer.Config):
                value.visit(lambda *_: None, lambda p, v: enter_layer(f"{path}.{p}", v))
                return False
            return True

        cfg.model.visit(lambda *_: None, enter)
        if not switched:
            raise ConfigError(
                "FP8ConfigModifier: the model has no TransformerLayer with linear layers to "
                "switch to FP8"
            )
        if length > 0 and not isinstance(cfg.learner, Fp8Learner.Config):
            if cfg.learner.klass is not Learner:
                raise ConfigError(
                    "FP8ConfigModifier: delayed scaling replaces learner (a Learner) with an "
                    f"Fp8Learner, but learner.klass is {cfg.learner.klass.__qualname__}"
                )
            learner = Fp8Learner.default_config()
            for name in cfg.learner.keys():
                if name != "klass":
                    setattr(learner, name, getattr(cfg.learner, name))
            cfg.learner = learner
        return cfg


class ReplaceLayerConfigModifier(ConfigModifier):
    """Replaces every layer config of class `target_cls` in the model config with a copy
    of `source_config`: fields both configs have keep the replaced config's values, except
    `exclude_keys`, which take `source_config`'s. A mesh rule thus swaps a layer's
    implementation, or sets a few of its fields everywhere it occurs, without naming paths.
    """

    @config_class
    class Config(ConfigModifier.Config):
        """Configures ReplaceLayerConfigModifier."""

        target_cls: Required[type] = REQUIRED  # The layer class whose configs are replaced.
        source_config: Required[ConfigBase] = REQUIRED  # The replacement (any layer class).
        exclude_keys: Sequence[str] = ()  # Fields that take source_config's values anyway.

    def __call__(self, cfg):
        target, source = self.config.target_cls, self.config.source_config
        unknown = [key for key in self.config.exclude_keys if key not in source.keys()]
        if unknown:
            raise ConfigError(
                f"ReplaceLayerConfigModifier: exclude_keys {unknown} are not fields of "
                f"source_config ({type(source).__name__})"
            )
        replaced = []

        def replacement(old: ConfigBase) -> ConfigBase:
            new = source.clone()
            for name in new.keys():
                if name != "klass" and name in old.keys() and name not in self.config.exclude_keys:
                    setattr(new, name, getattr(old, name))
            return new

        def visit(value: Any, path: str) -> Any:
            if isinstance(value, ConfigBase):
                if getattr(value, "klass", None) is target:
                    replaced.append(path)
                    return replacement(value)
                for name in value.keys():
                    setattr(value, name, visit(getattr(value, name), f"{path}.{name}"))
            elif isinstance(value, dict):
                return {key: visit(item, f"{path}[{key!r}]") for key, item in value.items()}
            elif isinstance(value, list):
                return [visit(item, f"{path}[{i}]") for i, item in enumerate(value)]
            return value

        cfg.model = visit(cfg.model, "model")
        if not replaced:
            raise ConfigError(
                f"ReplaceLayerConfigModifier: the model config has no {target.__name__} config"
            )
        return cfg


class OptimizerStateDtypeModifier(ConfigModifier):
    """Keeps parts of the optimizer's state in narrower dtypes between steps: the
    optimizer config at `optimizer_path` is wrapped in one `optimizers.cast_optimizer_state`
    per entry of `state_dtypes`, the first entry outermost (as
    `adastar_learner_config(state_dtype={...})` builds it). Each update still computes in
    float32; only what is carried to the next step is rounded.

    A mesh rule for a card whose memory holds a model only in a compact state (gpt_7b on
    one H200) sets it, so the same named config keeps float32 moments where they fit.
    """

    @config_class
    class Config(ConfigModifier.Config):
        """Configures OptimizerStateDtypeModifier."""

        # {state path regex (cast_optimizer_state.state_paths): dtype}, e.g.
        # {'gradient_square_ema': jnp.bfloat16, 'update_ema': jnp.float16} for Adastar.
        state_dtypes: Required[dict[str, Any]] = REQUIRED
        # The config path of the optimizer whose state is cast: the learner's optimizer
        # inside its skip-and-clip wrapper for the GPT configs.
        optimizer_path: str = "learner.optimizer.inner"

    def __call__(self, cfg):
        # pylint: disable-next=import-outside-toplevel
        from axlearn.common.optimizers import cast_optimizer_state

        modifier = self.config
        path = modifier.optimizer_path
        if not modifier.state_dtypes:
            raise ConfigError("OptimizerStateDtypeModifier.state_dtypes: give at least one entry")
        try:
            inner = get_recursively(cfg, path)
        except (AttributeError, KeyError, ConfigError) as e:
            raise ConfigError(f"OptimizerStateDtypeModifier: no optimizer config at '{path}'") from e
        if not isinstance(inner, ConfigBase) or not hasattr(inner, "instantiate"):
            raise ConfigError(f"OptimizerStateDtypeModifier: '{path}' is not an optimizer config")
        for state_paths, dtype in reversed(list(modifier.state_dtypes.items())):
            inner = config_for_function(cast_optimizer_state).set(
                inner=inner, dtype=dtype, state_paths=state_paths
            )
        set_recursively(cfg, path, inner)
        return cfg
