"""From a config name to a run: looks up a named trainer config, picks its mesh rule for
the devices at hand, applies `--init_from_hf` (a Hugging Face model and its weights),
`--data_dir` and the overrides, records the resolved config in the trainer directory, and
trains (or, with `--eval_only`, evaluates once).

Experiment modules live in the top-level `experiments` package; each exposes
`named_trainer_configs() -> {name: () -> SpmdTrainer.Config}`, and may describe its configs
in one line each for `--list_configs` in a module-level `DESCRIPTIONS = {name: "..."}`.
"""

import dataclasses
import difflib
import functools
import importlib
import importlib.util
import inspect
import json
import logging
import math
import os
import pkgutil
import re
from collections.abc import Callable, Sequence
from typing import Any, Optional

from absl import flags

from axlearn.common import file_system
from axlearn.common.config import (
    REQUIRED,
    ConfigBase,
    ConfigError,
    apply_overrides,
    flat_lines,
    get_recursively,
    parse_path,
    qualified_name,
    set_recursively,
)

log = logging.getLogger(__name__)

EXPERIMENTS_PACKAGE = "experiments"
FAKE_DATA_DIR = "FAKE"
BUILTIN_DATA_DIR = "BUILTIN"
NO_MESH_RULE = "none"  # --mesh_selector=none: the config's own mesh_shape, no rule.


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
        "max_step=N also moves every field that held the config's step count.",
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
        flags.DEFINE_string,
        "init_from_hf",
        None,
        "A local Hugging Face Llama directory (config.json, safetensors): the model is built "
        "from its config and starts from its weights, loaded onto the mesh shard by shard; "
        "optimizer, schedule, mesh and data stay the named config's. Read at step 0 of a "
        "fresh run only: a run with checkpoints resumes from them.",
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
)


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    for define, name, default, help_text in FLAGS_TABLE:
        define(name, default, help_text, flag_values=flag_values)


# ----- the registry of named configs -----


def experiment_modules() -> list[str]:
    """Names of the experiment modules (experiments.<name>)."""
    package = importlib.import_module(EXPERIMENTS_PACKAGE)
    names = (info.name for info in pkgutil.iter_modules(package.__path__))
    return sorted(name for name in names if not name.startswith("_"))


Builder = Callable[[], ConfigBase]


def _config_sources(module: Optional[str]) -> dict[str, list[tuple[str, Builder]]]:
    """Config name -> every (module name, builder) defining it, over one module or all."""
    modules = [module] if module else experiment_modules()
    sources: dict[str, list[tuple[str, Builder]]] = {}
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


def named_configs(module: Optional[str] = None) -> dict[str, tuple[str, Builder]]:
    """Config name -> (module name, builder), over one module or all of them.

    Names that several modules define are left out: they need `--module`.
    """
    return {name: found[0] for name, found in _config_sources(module).items() if len(found) == 1}


def lookup_named_config(config_name: str, *, module: Optional[str] = None) -> tuple[str, Builder]:
    """(module name, builder) of `config_name`: the one lookup behind every tool's
    `--config`. An unknown name is an error listing the close names."""
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
    return found[0]


def get_named_trainer_config(config_name: str, *, module: Optional[str] = None) -> ConfigBase:
    """The trainer config `config_name` from `module` (or from the only module defining it)."""
    return lookup_named_config(config_name, module=module)[1]()


def _first_sentence(obj: Any) -> Optional[str]:
    doc = inspect.getdoc(obj)
    if not doc:
        return None
    paragraph = " ".join(doc.split("\n\n")[0].split())
    return paragraph.split(". ")[0].rstrip(".") + "."


def _short(value: Any) -> str:
    """A bound argument as a description shows it: classes and dtypes by their last name."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_short(v)}" for k, v in value.items()) + "}"
    name = qualified_name(value)
    return name.rsplit(".", 1)[-1] if name else repr(value)


DESCRIPTIONS_ATTRIBUTE = "DESCRIPTIONS"  # An experiment module's {config name: one line}.


def module_descriptions(module: str) -> dict[str, str]:
    """The `DESCRIPTIONS` of experiment module `module` ({} where it has none). A name it
    describes that the module does not define is an error (a rename left behind)."""
    mod = importlib.import_module(f"{EXPERIMENTS_PACKAGE}.{module}")
    descriptions = getattr(mod, DESCRIPTIONS_ATTRIBUTE, {})
    unknown = sorted(set(descriptions) - set(mod.named_trainer_configs()))
    if unknown:
        raise ConfigError(
            f"{mod.__name__}.{DESCRIPTIONS_ATTRIBUTE} describes {', '.join(unknown)}, which "
            "its named_trainer_configs() does not define"
        )
    return descriptions


def config_description(module: str, config_name: str, builder: Builder) -> str:
    """`config_name`'s line in its module's `DESCRIPTIONS`; without one, the builder's first
    docstring sentence, or for a functools.partial without a docstring of its own, its
    function's, followed by the arguments the partial binds."""
    described = module_descriptions(module).get(config_name)
    if described:
        return described
    if isinstance(builder, functools.partial) and "__doc__" not in vars(builder):
        bound = [_short(a) for a in builder.args]
        bound += [f"{k}={_short(v)}" for k, v in builder.keywords.items()]
        call = f"{builder.func.__name__}({', '.join(bound)})"
        return f"{_first_sentence(builder.func) or ''} [{call}]".lstrip()
    return _first_sentence(builder) or "(no docstring)"


def parameter_count(cfg: ConfigBase) -> int:
    """The model's parameters, counted from its parameter specs (no weights are made)."""
    from axlearn.common.causal_lm import count_parameters  # pylint: disable=import-outside-toplevel

    return count_parameters(cfg.model.clone(name="model").instantiate(parent=None))


def list_configs_text(module: Optional[str] = None) -> str:
    """One line per named config: name, parameter count, description."""
    rows = []
    for name, found in sorted(_config_sources(module).items()):
        for mod, builder in found:
            shown = name if len(found) == 1 else f"{name} (--module={mod})"
            description = config_description(mod, name, builder)
            rows.append((shown, f"{parameter_count(builder()):,}", description))
    name_width = max(len(row[0]) for row in rows)
    count_width = max(len(row[1]) for row in rows)
    return "\n".join(
        f"{name:<{name_width}}  {count:>{count_width}} parameters  {description}"
        for name, count, description in rows
    )


# ----- the mesh rule for the devices at hand -----

# A GPU's chip in its JAX device kind: 'H100' in 'NVIDIA H100 80GB HBM3', 'A100' in
# 'NVIDIA A100-SXM4-80GB', 'MI300X' in 'AMD Instinct MI300X'.
_GPU_CHIP = re.compile(r"[A-Za-z]{1,2}[0-9]{1,4}[A-Za-z]?")
# TPU device kinds ('TPU v5 lite') -> their family in instance types ('tpu-v5litepod-256').
_TPU_FAMILIES = {"v5 lite": "v5litepod", "v5": "v5p", "v6 lite": "v6e"}
# TPU v4 and v5p instance sizes count TensorCores; their two cores per chip form one JAX
# device (megacore). Other sizes count devices.
_TENSORCORES_PER_DEVICE = {"v4": 2, "v5p": 2}


def _gpu_chip(device_kind: str) -> str:
    tokens = re.split(r"[\s_-]+", device_kind.strip())
    for token in tokens:
        if _GPU_CHIP.fullmatch(token):
            return token.lower()
    # No chip-like token (e.g. 'NVIDIA GeForce RTX 4090'): the kind without its vendor.
    rest = [t.lower() for t in tokens if t.lower() not in ("nvidia", "amd", "")]
    return "".join(rest) or "unknown"


def _tpu_family(device_kind: str) -> str:
    version = device_kind.lower().strip().removeprefix("tpu").strip()
    return _TPU_FAMILIES.get(version, version.replace(" ", ""))


def mesh_selector_for_devices(platform: str, device_kind: str, count: int) -> str:
    """The instance type that names a run's devices, for matching mesh rules: (platform,
    device kind of the first device, number of devices over all processes) ->
    'gpu-h100-8', 'gpu-a100-8', 'tpu-v5p-1024' (TensorCores, as the fleets count them), or
    'cpu' for CPUs of any count."""
    platform = platform.lower()
    if platform == "cpu":
        return "cpu"
    if platform == "tpu":
        family = _tpu_family(device_kind)
        return f"tpu-{family}-{count * _TENSORCORES_PER_DEVICE.get(family, 1)}"
    if platform in ("gpu", "cuda", "rocm"):
        return f"gpu-{_gpu_chip(device_kind)}-{count}"
    return f"{platform}-{count}"


def selector_contradiction(
    selector: str, platform: str, device_kind: str, count: int
) -> Optional[str]:
    """Why `selector` cannot name these devices (another platform, another device count),
    or None. Names that do not start with cpu, gpu or tpu are the user's own: not checked."""
    detected = mesh_selector_for_devices(platform, device_kind, count)
    parts = selector.split("-")
    if parts[0] not in ("cpu", "gpu", "tpu"):
        return None
    if parts[0] != detected.split("-")[0]:
        return f"it names {parts[0]} devices"
    if len(parts) > 1 and parts[-1].isdigit():
        family = "-".join(parts[1:-1])
        devices = int(parts[-1])
        if parts[0] == "tpu":
            devices //= _TENSORCORES_PER_DEVICE.get(family, 1)
        if devices != count:
            return f"it names {devices} devices"
    return None


def mesh_selector_from_devices(flag_value: Optional[str]) -> Optional[str]:
    """The selector a run uses: `flag_value` once checked against the devices JAX sees, or
    (unset) the name of those devices; None for `none`."""
    import jax  # pylint: disable=import-outside-toplevel

    device, count = jax.devices()[0], jax.device_count()
    detected = mesh_selector_for_devices(device.platform, device.device_kind, count)
    devices = f"{count} {device.device_kind} device{'s' if count > 1 else ''} ({detected})"
    if flag_value == NO_MESH_RULE:
        log.info("--mesh_selector=none: no mesh rule; the config's own mesh_shape on %s", devices)
        return None
    if flag_value:
        reason = selector_contradiction(flag_value, device.platform, device.device_kind, count)
        if reason:
            raise ConfigError(
                f"--mesh_selector={flag_value} contradicts this run's devices, {devices}: "
                f"{reason}; leave the flag out to use {detected}"
            )
        return flag_value
    log.info("Mesh selector %s, named from this run's devices: %s", detected, devices)
    return detected


def _select_mesh_rule(cfg: ConfigBase, config_name: str, mesh_selector: str) -> tuple[str, Any]:
    """(pattern, value) of the first rule whose regex matches all of `mesh_selector`."""
    for pattern, value in cfg.mesh_rules or ():
        if re.fullmatch(pattern, mesh_selector):
            return pattern, value
    patterns = [p for p, _ in cfg.mesh_rules or ()]
    raise ConfigError(
        f"--mesh_selector={mesh_selector} matches none of {config_name}'s mesh_rules: "
        f"{patterns}; pass one they match, or --mesh_selector={NO_MESH_RULE} for the "
        "config's own mesh_shape"
    )


# ----- one step count -----


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
    followers = []

    def visit(path: str, value: Any) -> None:
        if (
            path.endswith(".max_step")
            and type(value) is int  # pylint: disable=unidiomatic-typecheck  (not bool)
            and value == old_max_step
            and tuple(parse_path(path)) not in pinned_paths
        ):
            followers.append(path)

    cfg.visit(visit)
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


# ----- inputs -----


def _find_field(cfg: ConfigBase, field: str) -> Optional[Any]:
    found = []

    def visit(path: str, value: Any) -> None:
        if path.split(".")[-1] == field and value is not None and value is not REQUIRED:
            found.append(value)

    cfg.visit(visit)
    return found[0] if found else None


def _batch_shape(cfg: ConfigBase, input_cfg: ConfigBase, data_dir: str) -> tuple[int, int]:
    """(global_batch_size, max_sequence_length) of an input, the latter from the trainer
    where the input does not say it (pre-packed TFDS data)."""
    # AXLearn's inputs give it to their input_dispatcher as global_logical_batch_size.
    batch = _find_field(input_cfg, "global_batch_size") or _find_field(
        input_cfg, "global_logical_batch_size"
    )
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


def _data_dir_inputs(cfg: ConfigBase) -> list[ConfigBase]:
    """The configs of the inputs (training and evaluation) that have a `data_dir` field."""
    found = []

    def enter(path: str, value: Any) -> bool:
        if isinstance(value, ConfigBase) and "data_dir" in value.keys():
            found.append(value)
        return True

    for input_cfg in [cfg.input, *(evaler.input for evaler in cfg.evalers.values())]:
        input_cfg.visit(lambda path, value: None, enter)
    return found


def set_data_dir(cfg: ConfigBase, data_dir: str) -> ConfigBase:
    """Sets every `data_dir` field of the inputs (the TFDS data directory of tf.data)."""
    for input_cfg in _data_dir_inputs(cfg):
        input_cfg.data_dir = data_dir
    return cfg


# ----- --data_dir: token shards -----

# Under a --data_dir directory, the first pattern of each that matches a file.
TRAIN_SHARDS = ("train-*.tok", "train/*.tok")
VALIDATION_SHARDS = ("validation-*.tok", "validation/*.tok")
UNSPLIT_SHARDS = "*.tok"  # Without train shards: every shard trains.
SHARD_SUFFIX = ".tok"
_GLOB_CHARS = "*?["


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """The token shards of one --data_dir source, as TokenShardInput `paths` (globs)."""

    source: str  # The directory, glob or file given.
    train: list[str]
    validation: list[str]  # Empty: no validation shards.


def _under(directory: str, pattern: str) -> str:
    """`directory/pattern`, for local paths and URLs alike (no percent-encoding: a glob)."""
    return f"{directory.rstrip('/')}/{pattern}"


def _is_glob(path: str) -> bool:
    return any(c in path for c in _GLOB_CHARS)


def find_token_shards(path: str) -> Optional[ShardLayout]:
    """The token shards at `path` (a local path or storage URL), or None where there are
    none (see `use_data_dir` for the layout)."""
    if _is_glob(path):
        matches = [match for match in file_system.glob(path) if file_system.isfile(match)]
        return ShardLayout(path, [path], []) if matches else None
    if file_system.isfile(path):
        return ShardLayout(path, [path], []) if path.endswith(SHARD_SUFFIX) else None
    if not file_system.isdir(path):
        return None

    def first_match(patterns: Sequence[str]) -> list[str]:
        for pattern in patterns:
            if file_system.glob(_under(path, pattern)):
                return [_under(path, pattern)]
        return []

    train, validation = first_match(TRAIN_SHARDS), first_match(VALIDATION_SHARDS)
    if validation and not train:
        expected = " or ".join(_under(path, p) for p in TRAIN_SHARDS)
        raise ConfigError(
            f"--data_dir: {path} holds validation shards ({validation[0]}) but no training "
            f"shards: expected {expected}"
        )
    train = train or first_match([UNSPLIT_SHARDS])
    return ShardLayout(path, train, validation) if train else None


def parse_data_dir(data_dir: str) -> list[tuple[str, Optional[float]]]:
    """(path, weight) of each source: `PATH` -> [(PATH, None)];
    `PATH:WEIGHT,PATH:WEIGHT,...` -> a mixture. A suffix ':X' is a weight where X is a
    number, so URLs (gs://...) pass whole."""
    sources = []
    for part in data_dir.split(","):
        path, sep, suffix = part.strip().rpartition(":")
        try:
            weight = float(suffix) if sep and path else None
        except ValueError:
            weight = None
        sources.append((part.strip(), None) if weight is None else (path, weight))
    if len(sources) > 1 and any(weight is None for _, weight in sources):
        raise ConfigError(
            f"--data_dir={data_dir}: a mixture gives every source a weight, "
            "PATH:WEIGHT,PATH:WEIGHT,..."
        )
    for path, weight in sources:
        if weight is not None and not (math.isfinite(weight) and weight > 0):
            raise ConfigError(f"--data_dir={data_dir}: the weight of {path} must be > 0")
    return sources


def _no_shards_error(data_dir: str, path: str) -> ConfigError:
    if _is_glob(path):
        return ConfigError(f"--data_dir={data_dir}: {path} matches no token shard files")
    if not file_system.exists(path):
        return ConfigError(
            f"--data_dir={data_dir}: {path} does not exist; pass a directory of token shards, "
            f"a glob of shards, {FAKE_DATA_DIR} or {BUILTIN_DATA_DIR}"
        )
    expected = " or ".join(_under(path, p) for p in (*TRAIN_SHARDS, UNSPLIT_SHARDS))
    return ConfigError(
        f"--data_dir={data_dir}: {path} holds no token shards: expected {expected}; build "
        f"them with `python -m axlearn.common.input_tokens build --output={_under(path, 'train')} "
        "FILES...`"
    )


def use_token_shards(
    cfg: ConfigBase, data_dir: str, sources: Sequence[tuple[ShardLayout, Optional[float]]]
) -> ConfigBase:
    """Replaces the training input with a TokenShardInput of the sources' training shards
    (a TokenShardMixtureInput of them, by weight, for several), and every evaler's input
    with a TokenShardInput of all their validation shards, in the inputs' batch shapes,
    checked against the model's vocab_size. A TokenShardInput the config had keeps its
    other fields (seed, shuffle, ...). Without validation shards, evaler inputs are left
    without paths: `check_evaler_shards` names them once the overrides are applied."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.input_mixture import token_shard_mixture

    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.input_tokens import TokenShardInput

    vocab_size = cfg.model.decoder.vocab_size
    validation = [pattern for layout, _ in sources for pattern in layout.validation]

    def shards_like(input_cfg: ConfigBase, paths: Sequence[str]) -> ConfigBase:
        batch, seq_len = _batch_shape(cfg, input_cfg, data_dir)
        is_token_input = getattr(input_cfg, "klass", None) is TokenShardInput
        shards = input_cfg.clone() if is_token_input else TokenShardInput.default_config()
        return shards.set(
            is_training=input_cfg.is_training,
            paths=list(paths) if paths else REQUIRED,
            global_batch_size=batch,
            max_sequence_length=seq_len,
            model_vocab_size=vocab_size,
        )

    if len(sources) == 1:
        cfg.input = shards_like(cfg.input, sources[0][0].train)
    else:
        batch, seq_len = _batch_shape(cfg, cfg.input, data_dir)
        source = TokenShardInput.default_config().set(model_vocab_size=vocab_size)
        cfg.input = token_shard_mixture(
            [(source.clone(paths=layout.train), weight) for layout, weight in sources],
            global_batch_size=batch,
            max_sequence_length=seq_len,
        )
    for evaler in cfg.evalers.values():
        evaler.input = shards_like(evaler.input, validation)
    log.info(
        "--data_dir=%s: training on %s; evaluating on %s",
        data_dir,
        ", ".join(p for layout, _ in sources for p in layout.train),
        ", ".join(validation) or "(no validation shards)",
    )
    return cfg


def check_evaler_shards(
    cfg: ConfigBase, config_name: str, data_dir: str, layouts: Sequence[ShardLayout]
) -> None:
    """Raises naming the evalers `use_token_shards` found no validation shards for, unless
    the overrides pointed them at shards or removed them."""
    missing = [
        name
        for name, evaler in cfg.evalers.items()
        if "paths" in evaler.input.keys() and evaler.input.paths is REQUIRED
    ]
    if not missing:
        return
    expected = "; ".join(
        f"expected {' or '.join(_under(layout.source, p) for p in VALIDATION_SHARDS)}"
        if file_system.isdir(layout.source)
        else f"{layout.source} names training shards only"
        for layout in layouts
    )
    raise ConfigError(
        f"--data_dir={data_dir} holds no validation shards for {config_name}'s evalers "
        f"{missing} ({expected}); build them, point the evalers at shards with "
        f"--config_override=evalers['{missing[0]}'].input.paths=\"['...']\", or train "
        "without evaluation: --config_override=evalers={}"
    )


def use_data_dir(
    cfg: ConfigBase, data_dir: str
) -> tuple[ConfigBase, Optional[list[ShardLayout]]]:
    """Points the inputs at `data_dir` and returns (cfg, the shard layouts read, or None
    for a TFDS data directory).

    Token shards, for every config: `data_dir` is a directory (local path or storage URL),
    a glob of shard files, or one `.tok` file. In a directory, training reads
    DIR/train-*.tok (the `build --output=DIR/train` names), else DIR/train/*.tok, else,
    without a split, every DIR/*.tok; the evalers read DIR/validation-*.tok, else
    DIR/validation/*.tok. Evalers without validation shards are an error (evaluating on
    training data would report a fit, not generalization), unless the overrides point
    them elsewhere or remove them (`check_evaler_shards`). `PATH:WEIGHT,PATH:WEIGHT,...`
    trains on a mixture of the paths' training shards, by weight, and evaluates on all
    their validation shards.

    A path that holds no shards is the TFDS data directory of the config's tf.data
    inputs (their `data_dir` fields); for a config without such inputs it is an error
    naming the path (missing, or holding no shards).
    """
    sources = parse_data_dir(data_dir)
    layouts = [find_token_shards(path) for path, _ in sources]
    if all(layouts):
        weighted = [(layout, weight) for layout, (_, weight) in zip(layouts, sources)]
        return use_token_shards(cfg, data_dir, weighted), layouts
    empty = next(path for (path, _), layout in zip(sources, layouts) if layout is None)
    if len(sources) == 1 and not _is_glob(data_dir) and _data_dir_inputs(cfg):
        log.info("--data_dir=%s holds no token shards: the TFDS data directory", data_dir)
        return set_data_dir(cfg, data_dir), None
    raise _no_shards_error(data_dir, empty)


# The tf.data input path imports these when it builds its datasets (the `tf` extra).
TF_DATA_MODULE = "axlearn.common.input_tf_data"
TF_DATA_PACKAGES = ("tensorflow", "tensorflow_datasets")


def missing_input_packages(cfg: ConfigBase) -> tuple[Optional[str], list[str]]:
    """(the first input config path on the tf.data path, the packages it needs that are not
    installed); (None, []) when no input takes that path."""
    found = []

    def visit(path: str, value: Any) -> None:
        if path.startswith(("input.", "evalers[")) and path.endswith((".klass", ".fn")):
            name = qualified_name(value)
            if name and name.startswith(f"{TF_DATA_MODULE}."):
                found.append(path)

    cfg.visit(visit)
    if not found:
        return None, []
    return found[0], [p for p in TF_DATA_PACKAGES if importlib.util.find_spec(p) is None]


def check_input_packages(cfg: ConfigBase, config_name: str) -> None:
    """Stops with one line, before anything is built, if the inputs need missing packages."""
    path, missing = missing_input_packages(cfg)
    if missing:
        raise ConfigError(
            f"{config_name} reads its data through tf.data ({path}), which needs "
            f"{' and '.join(missing)}, not installed here: pass --data_dir=DIR for token "
            f"shards in DIR, --data_dir={FAKE_DATA_DIR} for synthetic batches or "
            f"--data_dir={BUILTIN_DATA_DIR} for the built-in byte corpus, or pip install "
            "'axlearn[tf]'"
        )


# ----- the recipe -----


def use_hf_checkpoint(cfg: ConfigBase, path: str) -> ConfigBase:
    """Replaces the model with the Hugging Face Llama in directory `path` (its config.json,
    keeping the named model's sharding, remat, dtype and dropout settings) and makes the
    trainer start from its weights (`init_params`)."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common import hf_llama

    path = os.path.abspath(path)
    cfg.model = hf_llama.warm_start_model_config(cfg.model, path)
    cfg.init_params = hf_llama.HfLlamaWeights.default_config().set(path=path)
    decoder = cfg.model.decoder
    log.info(
        "--init_from_hf=%s: a Llama of %d layers, dim %d, vocab %d; weights read at step 0 "
        "of a fresh run",
        path, decoder.transformer.num_layers, decoder.dim, decoder.vocab_size,
    )
    return cfg


def build_trainer_config(
    *,
    config_name: str,
    module: Optional[str] = None,
    mesh_selector: Optional[str] = None,
    data_dir: Optional[str] = None,
    config_overrides: Sequence[str] = (),
    trainer_dir: Optional[str] = None,
    init_from_hf: Optional[str] = None,
) -> ConfigBase:
    """The whole launch-time recipe: name -> Hugging Face model and weights -> mesh rule
    -> data dir (which checks the model's vocabulary) -> overrides
    (max_step carrying the fields that held the step count with it, `follow_max_step`)."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.trainer_config_modifier import apply_mesh_rule

    cfg = get_named_trainer_config(config_name, module=module)
    if init_from_hf:  # Before the mesh rule, whose modifiers (remat, FP8) apply to its model.
        cfg = use_hf_checkpoint(cfg, init_from_hf)
    if mesh_selector and mesh_selector != NO_MESH_RULE:
        pattern, rule = _select_mesh_rule(cfg, config_name, mesh_selector)
        what = type(rule).__qualname__.split(".")[0] if hasattr(rule, "klass") else f"mesh {rule}"
        log.info(
            "Mesh selector %s: %s's rule %r, %s (see --print_config)",
            mesh_selector, config_name, pattern, what,
        )
        cfg = apply_mesh_rule(cfg, rule)
    layouts = None
    if data_dir == FAKE_DATA_DIR:
        cfg = use_fake_data(cfg)
    elif data_dir == BUILTIN_DATA_DIR:
        cfg = use_builtin_text(cfg)
    elif data_dir:
        cfg, layouts = use_data_dir(cfg, data_dir)
    old_max_step = cfg.max_step
    cfg = apply_overrides(cfg, config_overrides)
    pinned = [override.split("=", 1)[0].strip() for override in config_overrides]
    follow_max_step(cfg, old_max_step, pinned=pinned)
    if layouts:
        check_evaler_shards(cfg, config_name, data_dir, layouts)
    if trainer_dir:
        cfg.dir = trainer_dir
    return cfg


# ----- the run records its config -----

CONFIG_RECORD = "config.txt"  # The resolved config in golden text, in the trainer directory.
# Keys that may change between restarts of one run: its length, the cadences of logs,
# summaries, evals, checkpoints and traces, and the directory itself (should it move).
# Fields that follow max_step may change with it (`_follows_max_step`).
RESTARTABLE_KEYS = re.compile(
    r"max_step|dir|log_every_n_steps|start_trace_steps(\[\d+\])?|start_trace_num_steps"
    r"|(.+\.)?write_every_n_steps"
    r"|evalers\[.+\]\.eval_policy\.(n|min_step)"
    r"|checkpointer\.save_policy\.(n|min_step)|checkpointer\.keep_(last_n|every_n_steps)"
)


def _follows_max_step(key: str, old: dict[str, str], new: dict[str, str]) -> bool:
    """Whether `key` held the trainer's max_step in both configs, or is the warmup of a
    schedule whose max_step did and changed (`follow_max_step` may shorten it)."""
    if key.endswith(".warmup_steps"):
        schedule_key = key.removesuffix(".warmup_steps") + ".max_step"
        changed = old.get(schedule_key) != new.get(schedule_key)
        return changed and _follows_max_step(schedule_key, old, new)
    return key.endswith(".max_step") and all(
        d.get(key) is not None and d.get(key) == d.get("max_step") for d in (old, new)
    )


def config_changes(old_text: str, new_text: str) -> list[tuple[str, str, str, bool]]:
    """(key, old value, new value, whether it may change between restarts) for each key
    that differs between two golden texts; '(absent)' for a key only one has."""
    old, new = flat_lines(old_text), flat_lines(new_text)
    return [
        (
            key,
            old.get(key, "(absent)"),
            new.get(key, "(absent)"),
            bool(RESTARTABLE_KEYS.fullmatch(key)) or _follows_max_step(key, old, new),
        )
        for key in sorted(set(old) | set(new))
        if old.get(key) != new.get(key)
    ]


def check_trainer_dir(trainer_dir: str) -> None:
    """Raises ConfigError for a --trainer_dir URL that no storage driver accepts."""
    try:
        file_system.kvstore_spec(trainer_dir)
    except ValueError as e:
        raise ConfigError(f"--trainer_dir={trainer_dir}: {e}") from e


def record_config(
    trainer_dir: str,
    text: str,
    *,
    allow_change: bool,
    write: bool,
    all_have_read: Callable[[], None] = lambda: None,
) -> None:
    """Compares `text` with the config recorded by the run's last start, if any, and
    records it (`write`: process 0 only).

    Changed keys are logged; a change outside RESTARTABLE_KEYS and the fields that follow
    max_step is an error listing those keys, unless `allow_change`. `all_have_read` returns
    once every process has compared (a barrier), so that all compare with the same record.
    """
    path = file_system.join(trainer_dir, CONFIG_RECORD)
    if file_system.isfile(path):
        changes = config_changes(file_system.read_text(path), text)
        if changes:
            log.info(
                "%s: %d key(s) changed since the run's last start: %s",
                path, len(changes), "; ".join(f"{k}: {a} -> {b}" for k, a, b, _ in changes),
            )
        refused = [f"{k}: {a} -> {b}" for k, a, b, allowed in changes if not allowed]
        if refused and not allow_change:
            raise ConfigError(
                f"{path}: the config changed since the run's last start in {len(refused)} "
                f"key(s) that may not change between restarts: {'; '.join(refused)}. Resume "
                "anyway with --allow_config_change, or start a new run in another --trainer_dir"
            )
    all_have_read()
    if write:
        file_system.makedirs(trainer_dir)
        file_system.write_text(path, text)  # Readers see the old record or the whole new one.


# ----- the run -----


def _sync_processes() -> None:
    """Returns once every process of a multi-process run has called it."""
    import jax  # pylint: disable=import-outside-toplevel

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

        multihost_utils.sync_global_devices("launch_trainer.record_config")


def run_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> Optional[dict[str, Any]]:
    if flag_values.list_configs:
        print(list_configs_text(flag_values.module))
        return None
    if not flag_values.config:
        raise ConfigError(
            "--config is required (e.g. --config=gpt_test; --list_configs lists them)"
        )
    # The name is checked before JAX starts looking for devices.
    lookup_named_config(flag_values.config, module=flag_values.module)
    selector = flag_values.mesh_selector
    if not (flag_values.print_config and selector and selector != NO_MESH_RULE):
        # A run checks the selector against its devices; printing a config for other
        # hardware (e.g. a GPU host's, from a laptop, to review it) does not.
        selector = mesh_selector_from_devices(selector)
    cfg = build_trainer_config(
        config_name=flag_values.config,
        module=flag_values.module,
        mesh_selector=selector,
        data_dir=flag_values.data_dir,
        config_overrides=flag_values.config_override,
        trainer_dir=flag_values.trainer_dir,
        init_from_hf=flag_values.init_from_hf,
    )
    if flag_values.print_config:
        print(cfg.debug_string())
        return None
    if not flag_values.trainer_dir:
        raise ConfigError("--trainer_dir is required to train (or pass --print_config)")
    check_trainer_dir(flag_values.trainer_dir)
    check_input_packages(cfg, flag_values.config)
    import jax  # pylint: disable=import-outside-toplevel

    from axlearn.common import run_lock  # pylint: disable=import-outside-toplevel

    if flag_values.eval_only:
        return evaluate_only(cfg, flag_values.trainer_dir, restore_step=flag_values.restore_step)
    # Locked before the config is recorded: a second run on the directory fails before it
    # writes anything there. The trainer holds the lock again while it trains (re-entrant).
    with run_lock.hold_on_process_0(flag_values.trainer_dir):
        record_config(
            flag_values.trainer_dir,
            cfg.debug_string(),
            allow_change=flag_values.allow_config_change,
            write=jax.process_index() == 0,
            all_have_read=_sync_processes,
        )
        trainer = cfg.instantiate(parent=None)
        # Raises preemption.Preempted on SIGTERM or SIGINT, once the step it reached is
        # saved; launch_trainer_main turns that into preemption.PREEMPTED_EXIT_CODE.
        return trainer.run(restore_step=flag_values.restore_step)


# The metrics --eval_only prints (the evalers' summary writers record all of them).
EVAL_ONLY_METRICS = ("loss", "perplexity", "bits_per_byte", "accuracy")


def evaluate_only(
    cfg: ConfigBase, trainer_dir: str, *, restore_step: Optional[int] = None
) -> dict[str, Any]:
    """--eval_only: every evaler once on the run's latest checkpoint, or `restore_step` (a
    fresh run: its initial weights); prints one JSON line of metrics per evaler (loss, perplexity, bits
    per byte where the input counts bytes, accuracy) and returns them all. Records no config: the
    evaluation is no start of the run."""
    import jax  # pylint: disable=import-outside-toplevel

    from axlearn.common import run_lock  # pylint: disable=import-outside-toplevel

    if not cfg.evalers:
        raise ConfigError("--eval_only: the config has no evalers")
    with run_lock.hold_on_process_0(trainer_dir):
        trainer = cfg.instantiate(parent=None)
        results = trainer.evaluate(restore_step=restore_step)
    if jax.process_index() == 0:
        for name, metrics in results.items():
            headline = {k: v for k, v in metrics.items() if k in EVAL_ONLY_METRICS}
            print(json.dumps({"evaler": name, "step": trainer.step, **headline}, sort_keys=True))
    return results
