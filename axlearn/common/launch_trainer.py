"""From a config name to a run: the launcher's flags, the launch-time recipe that builds a
trainer config (`build_trainer_config`), and the run itself (`run_from_flags`, or with
`--eval_only`, `evaluate_only`).

The recipe's steps live in their own modules: `experiment_registry` (named configs),
`mesh_selection` (the mesh rule for the devices), `launch_data` (`--data_dir`) and
`run_record` (the config recorded in the trainer directory). `--init_from_hf` (a Hugging
Face model and its weights), max_step and vocab_size following are steps of the recipe here.
"""

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any, Optional

from absl import flags

from axlearn.common import data_record
from axlearn.common.command_flags import TRUSTED_PACKAGES_HELP
from axlearn.common.config import (
    ConfigBase,
    ConfigError,
    apply_overrides,
    get_recursively,
    parse_path,
    set_recursively,
    trust_packages,
)
from axlearn.common.experiment_registry import (
    build_named_config,
    list_configs_text,
    lookup_named_config,
)
from axlearn.common.launch_data import (
    BUILTIN_DATA_DIR,
    FAKE_DATA_DIR,
    check_evaler_shards,
    check_input_packages,
    use_builtin_text,
    use_data_dir,
    use_fake_data,
)
from axlearn.common.mesh_selection import mesh_rule_for
from axlearn.common.run_dir import RunDir
from axlearn.common.run_record import check_trainer_dir, record_config

log = logging.getLogger(__name__)

# (define function, name, default, help): the flags of launch_trainer_main.
FLAGS_TABLE = (
    (
        flags.DEFINE_string,
        "module",
        None,
        "Experiment module under experiments/ (optional when the config name is unique).",
    ),
    (flags.DEFINE_string, "config", None, "Name of the trainer config, e.g. gpt_test."),
    (
        flags.DEFINE_bool,
        "list_configs",
        False,
        "Print every named config with its parameter count and a one-line description, "
        "and exit.",
    ),
    (
        flags.DEFINE_string,
        "trainer_dir",
        None,
        "Directory for checkpoints, summaries, traces: a local path or a storage URL "
        "(gs://bucket/run, s3://bucket/run, ...; see axlearn.common.file_system).",
    ),
    (
        flags.DEFINE_string,
        "mesh_selector",
        None,
        "Instance type matched against the config's mesh_rules, e.g. gpu-h100-8. Unset: "
        "named from the devices this run sees (gpu-h100-1, cpu, ...); none: no rule, the "
        "config's own mesh_shape.",
    ),
    (
        flags.DEFINE_string,
        "data_dir",
        None,
        "Token shards for every input, at the config's batch shapes: a directory (local or "
        "a storage URL) whose train-*.tok or train/*.tok train and validation-*.tok or "
        "validation/*.tok evaluate (without a split, every *.tok trains), or a glob of "
        "shards; PATH:WEIGHT,PATH:WEIGHT,... trains on a mixture by weight. A path holding "
        "no shards is the TFDS data directory of tf.data inputs (an error for other "
        "configs). FAKE: synthetic batches; BUILTIN: the built-in byte corpus.",
    ),
    (
        flags.DEFINE_multi_string,
        "config_override",
        [],
        "path=value (a Python literal), type-checked; repeatable, applied in order. "
        "max_step=N also moves every field that held the config's step count; "
        "model.decoder.vocab_size=N every input's and evaler's copy of the model's.",
    ),
    (flags.DEFINE_bool, "print_config", False, "Print the flat config and exit (no training)."),
    (
        flags.DEFINE_bool,
        "allow_config_change",
        False,
        "Resume in a --trainer_dir whose recorded config differs in more than max_step and "
        "the log, summary, eval and checkpoint cadences.",
    ),
    (
        flags.DEFINE_bool,
        "allow_data_change",
        False,
        "Resume in a --trainer_dir whose recorded data (data.json: each input's vocabulary, "
        "shard count and shard header fingerprint) differs from this start's.",
    ),
    (
        flags.DEFINE_string,
        "init_from_hf",
        None,
        "A local Hugging Face Llama, Qwen2, Qwen3, Qwen3-MoE or Mistral directory "
        "(config.json, safetensors): the model is built "
        "from its config and starts from its weights, loaded onto the mesh shard by shard; "
        "optimizer, schedule, mesh and data stay the named config's. Read at step 0 of a "
        "fresh run only: a run with checkpoints resumes from them.",
    ),
    (
        flags.DEFINE_string,
        "init_from_checkpoint",
        None,
        "Another run's --trainer_dir: the model is that run's (without its adapters, with "
        "this config's LoRA layers if it has any) and starts from its newest checkpoint "
        "(a LoRA config's base from, e.g., a llama_sft run; fresh adapters). Read at step 0 "
        "of a fresh run only.",
    ),
    (
        flags.DEFINE_string,
        "init_lora_from",
        None,
        "A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) whose "
        "adapters start a LoRA config's (e.g. llama_lora's) instead of fresh ones; needs "
        "--init_from_hf for the base, and must match its layers, rank and alpha.",
    ),
    (
        flags.DEFINE_integer,
        "restore_step",
        None,
        "Restore this committed step of --trainer_dir instead of the newest one not judged "
        "bad; newer checkpoints are set aside and replaced as training reaches them.",
    ),
    (
        flags.DEFINE_bool,
        "eval_only",
        False,
        "Run every evaler once on the latest checkpoint (a fresh run: the initial or "
        "--init_from_hf weights), print their metrics and exit without training.",
    ),
    (
        flags.DEFINE_list,
        "trackers",
        None,
        "Where summaries go, several at once: tensorboard, jsonl, wandb (the wandb extra; "
        "WANDB_MODE=offline needs no network). Sets the trainer's and every evaler's "
        "summary_writer.trackers; unset: the config's (tensorboard,jsonl).",
    ),
    (
        flags.DEFINE_string,
        "artifact",
        None,
        "With --eval_only: evaluate this quantized artifact's weights (python -m "
        "axlearn.common.quantize export), dequantized, instead of a checkpoint's; "
        "--trainer_dir is then not needed and nothing is written.",
    ),
    (flags.DEFINE_list, "trusted_packages", [], TRUSTED_PACKAGES_HELP),
)


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    for define, name, default, help_text in FLAGS_TABLE:
        define(name, default, help_text, flag_values=flag_values)


# ----- one step count -----


def _int_copies(
    cfg: ConfigBase, value: int, names: Sequence[str], *, skip: set[tuple[Any, ...]]
) -> list[str]:
    """Paths of the int fields named one of `names` that hold `value` (copies of one
    number that follow it), except the parsed paths in `skip`."""
    found = []

    def visit(path: str, held: Any) -> None:
        if (
            path.rsplit(".", 1)[-1] in names
            and type(held) is int  # pylint: disable=unidiomatic-typecheck  (not bool)
            and held == value
            and tuple(parse_path(path)) not in skip
        ):
            found.append(path)

    cfg.visit(visit)
    return found


def follow_max_step(cfg: ConfigBase, old_max_step: Any, *, pinned: Sequence[str] = ()) -> list[str]:
    """After `max_step` changed from `old_max_step`: sets every other `max_step` field that
    held `old_max_step` (the learning-rate schedules', the save policy's, the eval
    policies') to the new value; returns their paths. Paths in `pinned` (overridden by
    hand) are left alone.

    A schedule whose int `warmup_steps` no longer fits the shorter run gets the same
    fraction of it (30 of 200 steps -> 3 of 20): the schedule could not be built otherwise.
    """
    new_max_step = cfg.max_step
    if new_max_step == old_max_step or not isinstance(new_max_step, int):
        return []
    pinned_paths = {tuple(parse_path(path)) for path in pinned}
    followers = _int_copies(cfg, old_max_step, ("max_step",), skip=pinned_paths | {("max_step",)})
    for path in followers:
        set_recursively(cfg, path, new_max_step)
        parts = parse_path(path)
        node = get_recursively(cfg, parts[:-1])
        warmup = getattr(node, "warmup_steps", None) if isinstance(node, ConfigBase) else None
        if (
            type(warmup) is int  # pylint: disable=unidiomatic-typecheck
            and warmup >= new_max_step
            and (*parts[:-1], "warmup_steps") not in pinned_paths
        ):
            scaled = max(0, min(new_max_step - 1, round(warmup * new_max_step / old_max_step)))
            node.warmup_steps = scaled
            log.info(
                "max_step=%d ends inside %s.warmup_steps=%d: shortened to %d, the same "
                "fraction of the run",
                new_max_step, path.rsplit(".", 1)[0], warmup, scaled,
            )
    if followers:
        log.info(
            "max_step %s -> %d; followed by %s", old_max_step, new_max_step, ", ".join(followers)
        )
    return followers


# ----- one vocabulary size -----

# The model's vocabulary size, which the inputs and evalers follow.
MODEL_VOCAB_SIZE = "model.decoder.vocab_size"
# Fields that hold a copy of the model's vocabulary size (an input's check of its token
# ids, a synthetic input's id range).
_VOCAB_SIZE_FIELDS = ("vocab_size", "model_vocab_size")


def model_vocab_size(cfg: ConfigBase) -> Any:
    """The model's vocabulary size (model.decoder.vocab_size, or that of the language model
    a model wraps: model.policy.decoder.vocab_size); None for a model without."""
    try:
        return get_recursively(cfg, parse_path(MODEL_VOCAB_SIZE))
    except (ConfigError, AttributeError, KeyError):
        pass
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.causal_lm import language_model_config

    try:
        return language_model_config(cfg.model).decoder.vocab_size
    except (ConfigError, AttributeError, KeyError):
        return None


def follow_vocab_size(
    cfg: ConfigBase, old_vocab_size: Any, *, pinned: Sequence[str] = ()
) -> list[str]:
    """After model.decoder.vocab_size changed from `old_vocab_size`: sets every other
    `vocab_size` or `model_vocab_size` field that held `old_vocab_size` (the inputs', the
    evalers' inputs') to the new value; returns their paths. Paths in `pinned`
    (overridden by hand) are left alone."""
    new_vocab_size = model_vocab_size(cfg)
    if new_vocab_size == old_vocab_size or not isinstance(new_vocab_size, int):
        return []
    skip = {tuple(parse_path(path)) for path in (*pinned, MODEL_VOCAB_SIZE)}
    followers = _int_copies(cfg, old_vocab_size, _VOCAB_SIZE_FIELDS, skip=skip)
    for path in followers:
        set_recursively(cfg, path, new_vocab_size)
    if followers:
        log.info(
            "%s %s -> %d; followed by %s",
            MODEL_VOCAB_SIZE, old_vocab_size, new_vocab_size, ", ".join(followers),
        )
    return followers


# ----- the recipe -----


def use_hf_checkpoint(cfg: ConfigBase, path: str) -> ConfigBase:
    """Replaces the model with the Hugging Face model in directory `path` (its config.json:
    a Llama, Qwen2, Qwen3, Qwen3-MoE or Mistral, `hf_models.FAMILIES`; keeping the named
    model's sharding, remat, dtype and dropout settings) and makes the trainer start from
    its weights (`init_params`)."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common import hf_models

    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.causal_lm import language_model_field

    path = os.path.abspath(path)
    field = language_model_field(cfg.model)  # A model that wraps the LM (DPO's 'policy').
    recipe = cfg.model if field is None else getattr(cfg.model, field)
    lm, weights = hf_models.warm_start(recipe, path)
    family = hf_models.FAMILIES[getattr(weights, "model_type", "llama")][1]
    if field is None:
        cfg.model, cfg.init_params = lm, weights
    else:
        setattr(cfg.model, field, lm)
        cfg.init_params = cfg.model.klass.init_params_config(weights)
    decoder = lm.decoder
    log.info(
        "--init_from_hf=%s: a %s of %d layers, dim %d, vocab %d; weights read at step 0 "
        "of a fresh run",
        path, family, decoder.transformer.num_layers, decoder.dim, decoder.vocab_size,
    )
    return cfg


def use_run_checkpoint(cfg: ConfigBase, path: str) -> ConfigBase:
    """Replaces the model with the language model of the run in trainer directory `path`
    (without its LoRA layers; with the named config's, if any, and its parameter dtype) and
    makes the trainer start from that run's latest checkpoint (`trainer_dir.TrainerDirWeights`).
    A model that wraps the language model (DPO's 'policy') keeps its wrapper."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common import lora, trainer_dir

    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.causal_lm import language_model_config, language_model_field

    path = os.path.abspath(path)
    source = trainer_dir.read_trainer_config(path)
    field = language_model_field(cfg.model)
    recipe = cfg.model if field is None else getattr(cfg.model, field)
    model = lora.with_lora_layers(
        lora.base_model_config(language_model_config(source.model)),
        lora.lora_layer_configs(recipe),
    )
    model.dtype = recipe.dtype
    source_init = source.init_params
    if source_init is not None and "source" in source_init.keys():
        source_init = source_init.source  # A DPO run's policy weights (dpo.PolicyWeights).
    step = trainer_dir.latest_restorable_step(path)  # Pinned: restores read it again.
    weights = trainer_dir.TrainerDirWeights.default_config().set(
        path=path,
        step=step,
        source_fields=getattr(source_init, "source_fields", None) if source_init else None,
    )
    if field is None:
        cfg.model, cfg.init_params = model, weights
    else:
        setattr(cfg.model, field, model)
        cfg.init_params = cfg.model.klass.init_params_config(weights)
    log.info(
        "--init_from_checkpoint=%s: its model and step %d, read at step 0 of a fresh run",
        path, step,
    )
    return cfg


def use_peft_adapter(cfg: ConfigBase, path: str) -> ConfigBase:
    """Makes a LoRA config's adapters start from the PEFT adapter directory `path` (read
    with the --init_from_hf weights, checked against the model's adapters)."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common import hf_llama, hf_peft, lora

    init = cfg.init_params
    if init is None or getattr(init, "klass", None) is not hf_llama.HfLlamaWeights:
        raise ConfigError(f"--init_lora_from={path} needs --init_from_hf for the base weights")
    if not lora.lora_layer_configs(cfg.model):
        raise ConfigError(
            f"--init_lora_from={path}: the model has no LoRA layers (e.g. --config=llama_lora)"
        )
    path = os.path.abspath(path)
    model = cfg.model.clone(name="model").instantiate(parent=None)
    hf_peft.check_adapter(path, model, model.create_parameter_specs_recursively())
    init.lora_from = path
    return cfg


def build_trainer_config(
    *,
    config_name: str,
    module: Optional[str] = None,
    mesh_selector: Optional[str] = None,
    devices: Optional[Sequence[Any]] = None,
    data_dir: Optional[str] = None,
    config_overrides: Sequence[str] = (),
    trainer_dir: Optional[str] = None,
    init_from_hf: Optional[str] = None,
    init_lora_from: Optional[str] = None,
    init_from_checkpoint: Optional[str] = None,
    trackers: Optional[Sequence[str]] = None,
) -> ConfigBase:
    """The whole launch-time recipe: name -> Hugging Face model and weights -> mesh rule
    (`mesh_selection.mesh_rule_for`: `mesh_selector` checked against `devices`, or named
    from them; without devices, as given) -> data dir (which checks the model's vocabulary) -> overrides (max_step carrying
    the fields that held the step count with it, `follow_max_step`; the model's
    vocab_size the inputs' copies of it, `follow_vocab_size`)."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.trainer_config_modifier import apply_mesh_rule

    cfg = build_named_config(config_name, module=module)
    if init_from_hf:  # Before the mesh rule, whose modifiers (remat, FP8) apply to its model.
        cfg = use_hf_checkpoint(cfg, init_from_hf)
    if init_from_checkpoint:
        if init_from_hf:
            raise ConfigError("Pass one of --init_from_hf and --init_from_checkpoint")
        cfg = use_run_checkpoint(cfg, init_from_checkpoint)
    if init_lora_from:
        cfg = use_peft_adapter(cfg, init_lora_from)
    # The --mesh_selector flag (checked against `devices`, or named from them) -> the rule.
    chosen = mesh_rule_for(mesh_selector, cfg.mesh_rules, devices=devices, config_name=config_name)
    if chosen is not None:
        cfg = apply_mesh_rule(cfg, chosen.rule)
    layouts = None
    if data_dir == FAKE_DATA_DIR:
        cfg = use_fake_data(cfg)
    elif data_dir == BUILTIN_DATA_DIR:
        cfg = use_builtin_text(cfg)
    elif data_dir:
        cfg, layouts = use_data_dir(cfg, data_dir)
    old_max_step = cfg.max_step
    old_vocab_size = model_vocab_size(cfg)
    cfg = apply_overrides(cfg, config_overrides)
    new_max_step = cfg.max_step
    # pylint: disable-next=unidiomatic-typecheck  (not bool)
    if new_max_step != old_max_step and not (type(new_max_step) is int and new_max_step >= 1):
        raise ConfigError(
            f"--config_override=max_step={new_max_step!r}: max_step must be a positive int, the "
            f"steps to train ({config_name}'s is {old_max_step})"
        )
    pinned = [override.split("=", 1)[0].strip() for override in config_overrides]
    follow_max_step(cfg, old_max_step, pinned=pinned)
    follow_vocab_size(cfg, old_vocab_size, pinned=pinned)
    if trackers is not None:
        use_trackers(cfg, trackers)
    if layouts:
        check_evaler_shards(cfg, config_name, data_dir, layouts)
    if trainer_dir:
        cfg.dir = trainer_dir
    return cfg


def use_trackers(cfg: ConfigBase, trackers: Sequence[str]) -> ConfigBase:
    """--trackers: the trainer's and every evaler's summary writer write to `trackers`."""
    writers = [cfg.summary_writer] + [
        evaler.summary_writer for evaler in getattr(cfg, "evalers", {}).values()
    ]
    for writer in writers:
        if "trackers" in writer.keys():
            writer.trackers = list(trackers)
    return cfg


# ----- the run -----


def _sync_processes() -> None:
    """Returns once every process of a multi-process run has called it."""
    import jax  # pylint: disable=import-outside-toplevel

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

        multihost_utils.sync_global_devices("launch_trainer.record_config")


def run_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> Optional[dict[str, Any]]:
    """The launcher's entry point (`launch_trainer_main`, after `launch.setup_from_flags`):
    the flags -> a trainer config -> a run. Returns None for `--list_configs` and
    `--print_config` (printed), the metrics of `--eval_only` (also printed, one JSON line
    an evaler), and otherwise the trainer's `run()` result.

    A run, in order: the named config is looked up before jax looks for devices;
    `build_trainer_config` applies the Hugging Face model, the mesh rule (for these devices,
    `mesh_selection.mesh_rule_for`), the data, the overrides; then the trainer directory
    (`run_dir.RunDir` of `--trainer_dir`) is checked, locked, and given the run's
    `config.txt` and `data.json` (`run_record`, `data_record`: a restart may not silently
    change either), and the trainer trains to max_step. Errors are ConfigErrors (one line:
    `launch_trainer_main.exit_for`), `preemption.Preempted` on SIGTERM or SIGINT.
    """
    trust_packages(flag_values.trusted_packages)  # Before any config text or override is read.
    if flag_values.list_configs:
        print(list_configs_text(flag_values.module))
        return None
    if not flag_values.config:
        raise ConfigError(
            "--config is required (e.g. --config=gpt_test; --list_configs lists them)"
        )
    # The name is checked before JAX starts looking for devices.
    lookup_named_config(flag_values.config, module=flag_values.module)
    devices = None  # Printing a config for other hardware (to review a GPU host's) checks none.
    if not (flag_values.print_config and flag_values.mesh_selector):
        import jax  # pylint: disable=import-outside-toplevel

        devices = jax.devices()  # A run checks the selector against them, or names it.
    cfg = build_trainer_config(
        config_name=flag_values.config,
        module=flag_values.module,
        mesh_selector=flag_values.mesh_selector,
        devices=devices,
        data_dir=flag_values.data_dir,
        config_overrides=flag_values.config_override,
        trainer_dir=flag_values.trainer_dir,
        init_from_hf=flag_values.init_from_hf,
        init_lora_from=flag_values.init_lora_from,
        init_from_checkpoint=flag_values.init_from_checkpoint,
        trackers=flag_values.trackers,
    )
    if flag_values.print_config:
        print(cfg.debug_string())
        return None
    if flag_values.artifact:
        if not flag_values.eval_only:
            raise ConfigError("--artifact applies to --eval_only")
        return evaluate_artifact(cfg, flag_values.artifact)
    if not flag_values.trainer_dir:
        raise ConfigError("--trainer_dir is required to train (or pass --print_config)")
    run = RunDir(flag_values.trainer_dir)  # cfg.dir too (build_trainer_config).
    check_trainer_dir(run.root)
    check_input_packages(cfg, flag_values.config)
    import jax  # pylint: disable=import-outside-toplevel

    if flag_values.eval_only:
        return evaluate_only(cfg, run, restore_step=flag_values.restore_step)
    # Locked before the config is recorded: a second run on the directory fails before it
    # writes anything there. The trainer gets `run` locked, and takes the lock no more.
    with run.lock():
        data = data_record.describe_data(cfg)
        data_record.check_data_record(run, data, allow_change=flag_values.allow_data_change)
        record_config(
            run,
            cfg.debug_string(),
            allow_change=flag_values.allow_config_change,
            write=jax.process_index() == 0,
            all_have_read=_sync_processes,
        )
        if jax.process_index() == 0:  # After record_config's barrier: all have compared.
            data_record.write_data_record(run, data)
        trainer = cfg.instantiate(parent=None, run_dir=run)
        if jax.process_index() == 0:
            log.info("Summaries: tensorboard --logdir=%s", run.summaries())
        # Raises preemption.Preempted on SIGTERM or SIGINT, once the step it reached is
        # saved; launch_trainer_main turns that into preemption.PREEMPTED_EXIT_CODE.
        with _checkpoint_errors_as_config_errors(run):
            return trainer.run(restore_step=flag_values.restore_step)


@contextlib.contextmanager
def _checkpoint_errors_as_config_errors(run: RunDir) -> Iterator[None]:
    """Turns the checkpointer's verdict on checkpoints that cannot be restored (every one
    corrupt, one that does not fit the model) into a ConfigError naming what to do."""
    from axlearn.common import checkpointer  # pylint: disable=import-outside-toplevel

    try:
        yield
    except checkpointer.RestoreStepError:
        raise  # Names the step asked for and the committed ones.
    except (checkpointer.CheckpointCorruptError, checkpointer.CheckpointMismatchError) as e:
        directory = run.checkpoints
        raise ConfigError(
            f"{e}. Move the bad step directories out of {directory} (the run resumes from "
            "the newest one left, or starts afresh), or start a new run in another --trainer_dir"
        ) from e


# The metrics --eval_only prints (the evalers' summary writers record all of them).
EVAL_ONLY_METRICS = ("loss", "perplexity", "bits_per_byte", "accuracy")


def evaluate_only(
    cfg: ConfigBase, run: RunDir, *, restore_step: Optional[int] = None
) -> dict[str, Any]:
    """--eval_only: every evaler once on the run's latest checkpoint, or `restore_step` (a
    fresh run: its initial weights); prints one JSON line of metrics per evaler (loss, perplexity, bits
    per byte where the input counts bytes, accuracy) and returns them all. Records no config: the
    evaluation is no start of the run."""
    import jax  # pylint: disable=import-outside-toplevel

    if not cfg.evalers:
        raise ConfigError("--eval_only: the config has no evalers")
    with run.lock(), _checkpoint_errors_as_config_errors(run):
        trainer = cfg.instantiate(parent=None, run_dir=run)
        results = trainer.evaluate(restore_step=restore_step)
    if jax.process_index() == 0:
        for name, metrics in results.items():
            headline = {k: v for k, v in metrics.items() if k in EVAL_ONLY_METRICS}
            print(json.dumps({"evaler": name, "step": trainer.step, **headline}, sort_keys=True))
    return results


def evaluate_artifact(cfg: ConfigBase, path: str) -> dict[str, Any]:
    """--eval_only --artifact: every evaler once on the artifact's dequantized weights
    (the trainer without a directory: no checkpoint is read, nothing written); prints
    one JSON line of metrics per evaler, as evaluate_only does."""
    from axlearn.common import quantize  # pylint: disable=import-outside-toplevel

    if not cfg.evalers:
        raise ConfigError("--eval_only: the config has no evalers")
    try:
        header, entries = quantize.read_artifact(path)
    except quantize.ArtifactError as e:
        raise ConfigError(f"--artifact: {e}") from e
    trainer = cfg.clone(dir=None).instantiate(parent=None)
    specs = trainer.model.create_parameter_specs_recursively()
    params = quantize.params_for_specs(entries, specs, source=path)
    step = int(header.get("meta", {}).get("step") or 0)
    results = trainer.evaluate_params(params, step=step)
    for name, metrics in results.items():
        headline = {k: v for k, v in metrics.items() if k in EVAL_ONLY_METRICS}
        print(json.dumps(
            {"evaler": name, "step": step, "artifact": path, **headline}, sort_keys=True
        ))
    return results
