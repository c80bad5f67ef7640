"""Looks up a named trainer config, applies mesh rules and overrides, and trains.

Experiment modules live in the top-level `experiments` package; each exposes
`named_trainer_configs() -> {name: () -> SpmdTrainer.Config}`.
"""

import difflib
import importlib
import logging
import pkgutil
from collections.abc import Callable, Sequence
from typing import Any, Optional

from absl import flags

from axlearn.common.config import ConfigBase, ConfigError, apply_overrides

log = logging.getLogger(__name__)

EXPERIMENTS_PACKAGE = "experiments"
FAKE_DATA_DIR = "FAKE"
BUILTIN_DATA_DIR = "BUILTIN"


# (define function, name, default, help): the flags of launch_trainer_main.
FLAGS_TABLE = (
    (
        flags.DEFINE_string,
        "module",
        None,
        "Experiment module under experiments/ (optional when the config name is unique).",
    ),
    (flags.DEFINE_string, "config", None, "Name of the trainer config, e.g. gpt_test."),
    (flags.DEFINE_string, "trainer_dir", None, "Directory for checkpoints, summaries, traces."),
    (
        flags.DEFINE_string,
        "mesh_selector",
        None,
        "Instance type matched against the config's mesh_rules, e.g. gpu-h100-8.",
    ),
    (
        flags.DEFINE_string,
        "data_dir",
        None,
        "Data directory of the inputs; FAKE: synthetic batches; BUILTIN: the built-in byte "
        "corpus.",
    ),
    (
        flags.DEFINE_multi_string,
        "config_override",
        [],
        "path=value (a Python literal), type-checked; repeatable, applied in order.",
    ),
    (flags.DEFINE_bool, "print_config", False, "Print the flat config and exit (no training)."),
)


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    for define, name, default, help_text in FLAGS_TABLE:
        define(name, default, help_text, flag_values=flag_values)


def experiment_modules() -> list[str]:
    """Names of the experiment modules (experiments.<name>)."""
    package = importlib.import_module(EXPERIMENTS_PACKAGE)
    names = (info.name for info in pkgutil.iter_modules(package.__path__))
    return sorted(name for name in names if not name.startswith("_"))


def _config_sources(module: Optional[str]) -> dict[str, list[tuple[str, Callable[[], ConfigBase]]]]:
    """Config name -> every (module name, builder) defining it, over one module or all."""
    modules = [module] if module else experiment_modules()
    sources: dict[str, list[tuple[str, Callable[[], ConfigBase]]]] = {}
    for name in modules:
        try:
            mod = importlib.import_module(f"{EXPERIMENTS_PACKAGE}.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"{EXPERIMENTS_PACKAGE}.{name}":
                raise ConfigError(
                    f"No experiment module '{name}'; available: {', '.join(experiment_modules())}"
                ) from e
            raise
        for config_name, builder in mod.named_trainer_configs().items():
            sources.setdefault(config_name, []).append((name, builder))
    return sources


def named_configs(module: Optional[str] = None) -> dict[str, tuple[str, Callable[[], ConfigBase]]]:
    """Config name -> (module name, builder), over one module or all of them.

    Names that several modules define are left out: they need `--module`.
    """
    return {name: found[0] for name, found in _config_sources(module).items() if len(found) == 1}


def get_named_trainer_config(config_name: str, *, module: Optional[str] = None) -> ConfigBase:
    """The trainer config `config_name` from `module` (or from the only module defining it)."""
    sources = _config_sources(module)
    found = sources.get(config_name, [])
    if len(found) > 1:
        modules = ", ".join(m for m, _ in found)
        raise ConfigError(
            f"Config '{config_name}' is defined in several experiment modules ({modules}); "
            "choose one with --module"
        )
    if not found:
        close = difflib.get_close_matches(config_name, list(sources), n=5, cutoff=0.4)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        where = f"module '{module}'" if module else "the experiment modules"
        raise ConfigError(f"Unknown config '{config_name}' in {where}.{hint}")
    return found[0][1]()


def _find_field(cfg: ConfigBase, field: str) -> Optional[Any]:
    found = []

    def visit(path: str, value: Any) -> None:
        if path.split(".")[-1] == field and value is not None:
            found.append(value)

    cfg.visit(visit)
    return found[0] if found else None


def _batch_shape(cfg: ConfigBase, input_cfg: ConfigBase, data_dir: str) -> tuple[int, int]:
    """(global_batch_size, max_sequence_length) of an input, the latter from the trainer
    where the input does not say it (pre-packed TFDS data)."""
    batch = _find_field(input_cfg, "global_batch_size")
    seq_len = _find_field(input_cfg, "max_sequence_length") or _find_field(
        cfg, "max_sequence_length"
    )
    if batch is None or seq_len is None:
        raise ConfigError(
            f"--data_dir={data_dir} needs the input's global_batch_size and "
            f"max_sequence_length; found {batch} and {seq_len}"
        )
    return batch, seq_len


def _replace_inputs(cfg: ConfigBase, replacement: Callable[[ConfigBase], ConfigBase]) -> ConfigBase:
    """Replaces the training input and every evaler's input by `replacement(input)`."""
    cfg.input = replacement(cfg.input)
    for evaler in cfg.evalers.values():
        evaler.input = replacement(evaler.input)
    return cfg


def use_fake_data(cfg: ConfigBase) -> ConfigBase:
    """Replaces the training input (and evaluation inputs) with synthetic batches."""
    from axlearn.common.input_fake import FakeLmInput  # pylint: disable=import-outside-toplevel

    def fake_like(input_cfg: ConfigBase) -> ConfigBase:
        batch, seq_len = _batch_shape(cfg, input_cfg, FAKE_DATA_DIR)
        return FakeLmInput.default_config().set(
            global_batch_size=batch,
            max_sequence_length=seq_len,
            vocab_size=cfg.model.decoder.vocab_size,
            is_training=input_cfg.is_training,
        )

    return _replace_inputs(cfg, fake_like)


def use_builtin_text(cfg: ConfigBase) -> ConfigBase:
    """Replaces the training input with the built-in byte-level corpus (its 'train' split)
    and the evaluation inputs with its 'validation' split, in the same batch shapes: real
    text for any config, where its corpora are not at hand. The model's vocabulary must
    hold the 259 byte ids."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.input_builtin import BuiltinTextInput

    def builtin_like(input_cfg: ConfigBase) -> ConfigBase:
        batch, seq_len = _batch_shape(cfg, input_cfg, BUILTIN_DATA_DIR)
        return BuiltinTextInput.default_config().set(
            global_batch_size=batch,
            max_sequence_length=seq_len,
            split="train" if input_cfg.is_training else "validation",
            is_training=input_cfg.is_training,
            model_vocab_size=cfg.model.decoder.vocab_size,
        )

    return _replace_inputs(cfg, builtin_like)


def set_data_dir(cfg: ConfigBase, data_dir: str) -> ConfigBase:
    """Sets every `data_dir` field of the inputs."""

    def set_in(sub: ConfigBase) -> None:
        def enter(path: str, value: Any) -> bool:
            if isinstance(value, ConfigBase) and "data_dir" in value.keys():
                value.data_dir = data_dir
            return True

        sub.visit(lambda path, value: None, enter)

    set_in(cfg.input)
    for evaler in cfg.evalers.values():
        set_in(evaler.input)
    return cfg


def build_trainer_config(
    *,
    config_name: str,
    module: Optional[str] = None,
    mesh_selector: Optional[str] = None,
    data_dir: Optional[str] = None,
    config_overrides: Sequence[str] = (),
    trainer_dir: Optional[str] = None,
) -> ConfigBase:
    """The whole launch-time recipe: name -> mesh rule -> data dir -> overrides."""
    from axlearn.common.trainer import select_mesh_rule  # pylint: disable=import-outside-toplevel
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.trainer_config_modifier import apply_mesh_rule

    cfg = get_named_trainer_config(config_name, module=module)
    if mesh_selector:
        rule = select_mesh_rule(cfg.mesh_rules, mesh_selector)
        if rule is None:
            patterns = [p for p, _ in cfg.mesh_rules or ()]
            raise ConfigError(
                f"--mesh_selector={mesh_selector} matches none of {config_name}'s mesh_rules: "
                f"{patterns}"
            )
        what = type(rule).__qualname__.split(".")[0] if hasattr(rule, "klass") else f"mesh {rule}"
        log.info("--mesh_selector=%s: applying %s (see --print_config)", mesh_selector, what)
        cfg = apply_mesh_rule(cfg, rule)
    if data_dir == FAKE_DATA_DIR:
        cfg = use_fake_data(cfg)
    elif data_dir == BUILTIN_DATA_DIR:
        cfg = use_builtin_text(cfg)
    elif data_dir:
        cfg = set_data_dir(cfg, data_dir)
    cfg = apply_overrides(cfg, config_overrides)
    if trainer_dir:
        cfg.dir = trainer_dir
    return cfg


def run_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> Optional[dict[str, Any]]:
    if not flag_values.config:
        raise ConfigError("--config is required (e.g. --config=gpt_test)")
    cfg = build_trainer_config(
        config_name=flag_values.config,
        module=flag_values.module,
        mesh_selector=flag_values.mesh_selector,
        data_dir=flag_values.data_dir,
        config_overrides=flag_values.config_override,
        trainer_dir=flag_values.trainer_dir,
    )
    if flag_values.print_config:
        print(cfg.debug_string())
        return None
    if not flag_values.trainer_dir:
        raise ConfigError("--trainer_dir is required to train (or pass --print_config)")
    trainer = cfg.instantiate(parent=None)
    return trainer.run()
