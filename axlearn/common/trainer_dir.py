"""What a trainer directory holds, read outside the trainer: the run's config, its model
parameters at a step, and the tokenizer its data was made with.

    cfg = read_trainer_config(trainer_dir)                   # <trainer_dir>/config.txt
    step, params = restore_model_params(trainer_dir, step=None)  # the latest checkpoint
    step, lm_cfg, params = restore_language_model(trainer_dir)  # a DPO run's policy
    tokenizer = recorded_tokenizer(cfg)                      # a model file, 'bytes' or None

Only the model parameters are read from the checkpoint (not the optimizer state), into
the shapes and dtypes of the recorded model's parameter specs.
"""

import logging
import os
from typing import Any, Optional

import jax
import numpy as np

from axlearn.common import file_system, lora
from axlearn.common.base_layer import is_parameter_spec
from axlearn.common.causal_lm import language_model_config, language_model_field
from axlearn.common.checkpointer import Checkpointer
from axlearn.common.config import (
    REQUIRED,
    ConfigBase,
    ConfigError,
    Configurable,
    Required,
    config_class,
    qualified_name,
)
from axlearn.common.golden_text import parse_flat_text
from axlearn.common.input_token_format import TokenShard, TokenShardError
from axlearn.common.input_vocab import (
    BYTES_VOCAB_NAME,
    VocabularyError,
    file_sha256,
    resolve_vocab_file,
)
from axlearn.common.run_dir import RunDir
from axlearn.common.utils import flatten_with_paths, unflatten_paths

log = logging.getLogger(__name__)

BYTES_TOKENIZER = BYTES_VOCAB_NAME  # `recorded_tokenizer` for the byte vocabulary.
# Inputs that read the built-in corpus, tokenized as bytes.
_BYTE_INPUTS = ("axlearn.common.input_builtin.BuiltinTextInput",)
# Config fields that name a vocabulary model file (token shards; seqio vocabularies).
_VOCAB_FIELDS = ("vocab_name", "sentencepiece_model_name")
# A Hugging Face directory's tokenizer: its tokenizer.json, else its SentencePiece model.
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def read_trainer_config(trainer_dir: str) -> ConfigBase:
    """The trainer config the run recorded (<trainer_dir>/config.txt), built again."""
    path = RunDir(trainer_dir).config_record
    if not file_system.isfile(path):
        raise ConfigError(
            f"{path}: no such file; is {trainer_dir} the --trainer_dir of a run started by "
            "launch_trainer_main?"
        )
    return parse_flat_text(file_system.read_text(path), source=path)


def restore_model_params(
    trainer_dir: str,
    *,
    step: Optional[int] = None,
    model_config: Optional[ConfigBase] = None,
    sharding: Optional[jax.sharding.Sharding] = None,
    param_prefix: Optional[str] = None,
    frozen: bool = True,
) -> tuple[int, Any]:
    """(step, model parameters) of checkpoint `step` in `trainer_dir` (None: the latest
    committed one), without the optimizer state.

    `model_config` defaults to the recorded config's model; with `param_prefix`, it is
    the model of the checkpoint's parameters under that name (a wrapped language model)
    and only those are read. Every parameter is placed whole by `sharding`, by default on
    JAX's CPU device (host memory). A run whose checkpoints leave out its frozen
    parameters (`checkpoint_frozen_params=False`) gets them from their source, checked
    against the checkpoint's fingerprint; with `frozen=False` they are left out instead.
    """
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common import trainer as trainer_lib

    trainer_cfg = read_trainer_config(trainer_dir)
    if model_config is None:
        model_config = trainer_cfg.model
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    model = model_config.clone(name="model").instantiate(parent=None)
    specs = model.create_parameter_specs_recursively()
    unsaved = frozenset()
    if trainer_cfg.checkpoint_frozen_params is False:
        if param_prefix is not None:
            raise ConfigError(
                f"{trainer_dir}: its checkpoints leave out frozen parameters, so the "
                f"language model under '{param_prefix}' cannot be read alone"
            )
        learner = trainer_cfg.learner.clone(name="learner").instantiate(parent=None)
        unsaved = trainer_lib.frozen_param_paths(learner, specs)
    template = jax.tree.map(
        lambda spec: jax.ShapeDtypeStruct(tuple(spec.shape), spec.dtype, sharding=sharding),
        specs,
        is_leaf=is_parameter_spec,
    )
    full_template = template
    template = trainer_lib.drop_paths(template, unsaved) if unsaved else template
    directory = RunDir(trainer_dir).checkpoints
    checkpointer = Checkpointer.default_config().set(name="checkpointer", dir=directory)
    checkpointer = checkpointer.instantiate(parent=None)
    try:
        if step is None and checkpointer.latest_committed_step() is None:
            raise ConfigError(f"{directory}: no committed checkpoint")
        if param_prefix is not None:
            template = {param_prefix: template}
        restored_step, restored, extra = checkpointer.restore(
            step=step, state={"model": template}, subset=True
        )
    finally:
        checkpointer.stop()
    log.info("Restored the model parameters of step %d from %s", restored_step, directory)
    params = restored["model"]
    if param_prefix is not None:
        params = params[param_prefix]
    if unsaved and frozen:
        params = _with_frozen_params(
            trainer_cfg, model_config, model, specs, full_template, params, unsaved,
            restored_step, extra,
        )
    return restored_step, params


def _with_frozen_params(
    trainer_cfg, model_config, model, specs, template, params, unsaved, step, extra
) -> Any:
    """`params` with the frozen parameters a checkpoint leaves out, from the run's
    init_params or its param_init (as `SpmdTrainer` restores them), fingerprint-checked."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common import trainer as trainer_lib

    shardings = jax.tree.map(lambda t: t.sharding, template)
    if trainer_cfg.init_params is not None:
        loaded = trainer_cfg.init_params.instantiate().load(
            model_config=model_config, param_specs=specs, shardings=shardings
        )
        source = f"init_params ({trainer_cfg.init_params.klass.__name__})"
    else:
        seed = 0 if trainer_cfg.seed is None else trainer_cfg.seed
        init_key, _ = jax.random.split(jax.random.PRNGKey(seed))
        loaded = jax.jit(model.initialize_parameters_recursively, out_shardings=shardings)(
            init_key
        )
        source = f"model.param_init with seed {seed}"
    flat = dict(flatten_with_paths(loaded))
    frozen = {path: flat[path] for path in sorted(unsaved)}
    recorded = (extra or {}).get(trainer_lib.FROZEN_FINGERPRINT)
    if recorded is None:
        raise ConfigError(
            f"Checkpoint step {step} records no {trainer_lib.FROZEN_FINGERPRINT}, so its "
            "frozen parameters cannot be checked"
        )
    trainer_lib.check_fingerprint(
        trainer_lib.params_fingerprint(frozen), recorded, source=source, step=step
    )
    merged = dict(flatten_with_paths(params))
    merged.update(frozen)
    return unflatten_paths(merged)


def latest_restorable_step(trainer_dir: str) -> int:
    """The newest committed checkpoint step of `trainer_dir` not judged bad (the one
    `restore_model_params` takes by default); ConfigError if there is none."""
    directory = RunDir(trainer_dir).checkpoints
    checkpointer = Checkpointer.default_config().set(name="checkpointer", dir=directory)
    checkpointer = checkpointer.instantiate(parent=None)
    try:
        steps = [s for s in checkpointer.committed_steps() if checkpointer.verdict(s) is not False]
    finally:
        checkpointer.stop()
    if not steps:
        raise ConfigError(f"{directory}: no committed checkpoint")
    return steps[-1]


class TrainerDirWeights(Configurable):
    """The initial parameters of a fresh run (`SpmdTrainer.Config.init_params`) from
    another run's checkpoint: each parameter from the same path there, or, for a LoRA
    model started from a run without adapters (e.g. full-parameter SFT), each base weight
    from its path in that run's model (`lora.base_param_paths`) and the adapters fresh
    (param_init, key PRNGKey(0); lora_up zero). Shapes must match; a parameter the source
    lacks is an error naming it."""

    @config_class
    class Config(Configurable.Config):
        """Configures TrainerDirWeights."""

        path: Required[str] = REQUIRED  # The other run's --trainer_dir.
        step: Optional[int] = None  # Its checkpoint step; None: the latest committed.
        # The config.json fields of the Hugging Face model the other run started from
        # (its init_params.source_fields), which export writes back. None: none.
        source_fields: Optional[dict[str, Any]] = None

    def load(self, *, model_config: ConfigBase, param_specs: Any, shardings: Any) -> Any:
        """The parameters of `model_config` in the dtypes of `param_specs`, placed by
        `shardings`."""
        cfg = self.config
        # The source run's language model: its model, or the one it wraps (a DPO policy).
        step, _, source = restore_language_model(cfg.path, step=cfg.step)
        log.info("Starting from step %d of %s", step, cfg.path)
        source = dict(flatten_with_paths(source))
        model = model_config.clone(name="model").instantiate(parent=None)
        is_spec = lambda x: hasattr(x, "shape")  # pylint: disable=unnecessary-lambda-assignment
        flat_specs = dict(flatten_with_paths(param_specs, is_leaf=is_spec))
        flat_shardings = dict(
            flatten_with_paths(shardings, is_leaf=lambda x: hasattr(x, "device_set"))
        )
        values, fresh = {}, []
        for path, base_path in lora.base_param_paths(model, param_specs).items():
            name = path if path in source else base_path
            if name is None:  # An adapter the source run did not have.
                fresh.append(path)
                continue
            if name not in source:
                raise ConfigError(
                    f"init_params.path={cfg.path}: step {step} has no parameter {path}"
                )
            spec = flat_specs[path]
            if tuple(source[name].shape) != tuple(spec.shape):
                raise ConfigError(
                    f"init_params.path={cfg.path}: {name} has shape {tuple(source[name].shape)} "
                    f"at step {step}, the model's {path} {tuple(spec.shape)}"
                )
            values[path] = jax.device_put(
                np.asarray(source[name]).astype(spec.dtype), flat_shardings[path]
            )
        if fresh:
            values.update(lora.initial_adapters(model, fresh, flat_shardings))
        return unflatten_paths(values)


def restore_language_model(
    trainer_dir: str,
    *,
    step: Optional[int] = None,
    sharding: Optional[jax.sharding.Sharding] = None,
    frozen: bool = True,
) -> tuple[int, ConfigBase, Any]:
    """(step, the causal LM's config, its parameters) of a run: its model, or the language
    model its model wraps (a DPO run's policy, without the reference copy). `frozen` as
    `restore_model_params`'s."""
    model = read_trainer_config(trainer_dir).model
    lm = language_model_config(model)
    restored_step, params = restore_model_params(
        trainer_dir, step=step, model_config=lm, sharding=sharding,
        param_prefix=language_model_field(model), frozen=frozen,
    )
    return restored_step, lm, params


# ----- the tokenizer recorded with the data -----


def _input_configs(cfg: ConfigBase) -> list[ConfigBase]:
    # Evalers without an input of their own (lm-eval's tasks) bring no tokenizer.
    evaler_inputs = [e.input for e in cfg.evalers.values() if "input" in e.keys()]
    return [cfg.input, *evaler_inputs]


def _named_vocab_files(cfg: ConfigBase) -> tuple[list[str], list[str], bool]:
    """(vocabulary names in the inputs' configs, token shard path patterns, whether an
    input reads bytes)."""
    names, patterns, is_bytes = [], [], []

    def visit(path: str, value: Any) -> None:
        field = path.rsplit(".", 1)[-1]
        if field in _VOCAB_FIELDS and isinstance(value, str):
            names.append(value)
        elif field.startswith("paths[") and isinstance(value, str):
            patterns.append(value)
        elif field == "klass" and qualified_name(value) in _BYTE_INPUTS:
            is_bytes.append(True)

    for input_cfg in _input_configs(cfg):
        if isinstance(input_cfg, ConfigBase):
            input_cfg.visit(visit)
    return names, patterns, bool(is_bytes)


def _first_local_shard(patterns: list[str]) -> Optional[str]:
    for pattern in patterns:
        if not file_system.is_local(pattern):
            continue
        matches = sorted(file_system.glob(file_system.local_path(pattern)))
        if matches:
            return matches[0]
    return None


def _shard_vocab_file(shard_path: str) -> Optional[str]:
    """The model file of the vocabulary a shard's manifest records: 'bytes', or the file
    of that name (in the vocabulary directory, beside the shard, or one level up) whose
    SHA-256 is the recorded one; None where none is found."""
    try:
        record = TokenShard(shard_path, verify_checksum=False).vocabulary
    except TokenShardError as e:
        log.warning("Cannot read the vocabulary of %s: %s", shard_path, e)
        return None
    if record.kind == "bytes" or record.name == BYTES_VOCAB_NAME:
        return BYTES_TOKENIZER
    shard_dir = os.path.dirname(os.path.abspath(shard_path))
    candidates = [os.path.join(shard_dir, record.name),
                  os.path.join(os.path.dirname(shard_dir), record.name)]
    try:
        candidates.insert(0, resolve_vocab_file(record.name))
    except VocabularyError:
        pass
    for candidate in candidates:
        if os.path.isfile(candidate) and (
            not record.sha256 or file_sha256(candidate) == record.sha256
        ):
            return candidate
    log.warning(
        "%s was tokenized with %s, whose file is not in the vocabulary directory nor beside "
        "the shards", shard_path, record.describe(),
    )
    return None


def recorded_tokenizer(cfg: ConfigBase) -> Optional[str]:
    """The tokenizer a run's data was made with: the path of a SentencePiece model or a
    Hugging Face tokenizer.json, BYTES_TOKENIZER for the byte vocabulary, or None.

    Looked up, in order: a vocabulary its input configs name; the vocabulary the manifest
    of its first local token shard records; the tokenizer of the Hugging Face checkpoint
    it started from (`init_params.path`).
    """
    names, patterns, is_bytes = _named_vocab_files(cfg)
    for name in names:
        if name == BYTES_VOCAB_NAME:
            return BYTES_TOKENIZER
        try:
            return resolve_vocab_file(name)
        except VocabularyError as e:
            log.warning("%s", e)
    if is_bytes:
        return BYTES_TOKENIZER
    shard = _first_local_shard(patterns)
    if shard is not None:
        found = _shard_vocab_file(shard)
        if found is not None:
            return found
    init_params = cfg.init_params if "init_params" in cfg.keys() else None
    if init_params is not None and "path" in init_params.keys():
        for name in _HF_TOKENIZER_FILES:
            path = os.path.join(init_params.path, name)
            if os.path.isfile(path):
                return path
    return None
