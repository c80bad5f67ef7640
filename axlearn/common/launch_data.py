"""What `--data_dir` does to a trainer config's inputs: FAKE (synthetic batches),
BUILTIN (the built-in byte corpus), token shards (a directory, glob or weighted mixture of
them) or the TFDS data directory of tf.data inputs; the check that every evaler found
validation shards, and the check that the inputs' packages are installed.
"""

import dataclasses
import importlib.util
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Optional

from axlearn.common import file_system
from axlearn.common.config import REQUIRED, ConfigBase, ConfigError, qualified_name

log = logging.getLogger(__name__)

FAKE_DATA_DIR = "FAKE"
BUILTIN_DATA_DIR = "BUILTIN"


# ----- FAKE, BUILTIN and the TFDS data directory -----


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
    for evaler in _input_evalers(cfg):
        evaler.input = replacement(evaler.input)
    return cfg


def _input_evalers(cfg: ConfigBase) -> list[ConfigBase]:
    """The evalers that read an input (lm-eval's evaler reads its tasks instead)."""
    return [evaler for evaler in cfg.evalers.values() if "input" in evaler.keys()]


def use_fake_data(cfg: ConfigBase) -> ConfigBase:
    """Replaces the training input (and evaluation inputs) with synthetic batches."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.causal_lm import language_model_config, language_model_field
    from axlearn.common.input_fake import (  # pylint: disable=import-outside-toplevel
        FakeLmInput,
        FakePairInput,
    )

    # A model that wraps a language model (DPO) trains on pairs.
    fake = FakeLmInput if language_model_field(cfg.model) is None else FakePairInput

    def fake_like(input_cfg: ConfigBase) -> ConfigBase:
        batch, seq_len = _batch_shape(cfg, input_cfg, FAKE_DATA_DIR)
        return fake.default_config().set(
            global_batch_size=batch,
            max_sequence_length=seq_len,
            vocab_size=language_model_config(cfg.model).decoder.vocab_size,
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

    for input_cfg in [cfg.input, *(evaler.input for evaler in _input_evalers(cfg))]:
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
    other fields (seed, shuffle, ...), and a PreferencePairInput (DPO) stays one, reading
    the pair shards there. Without validation shards, evaler inputs are left without
    paths: `check_evaler_shards` names them once the overrides are applied."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.input_mixture import token_shard_mixture

    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.input_pairs import PreferencePairInput

    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.input_tokens import TokenShardInput

    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.causal_lm import language_model_config, language_model_field

    vocab_size = language_model_config(cfg.model).decoder.vocab_size
    validation = [pattern for layout, _ in sources for pattern in layout.validation]
    # A model that wraps the LM (DPO) trains on pairs: its input reads pair shards.
    shard_input = TokenShardInput if language_model_field(cfg.model) is None else PreferencePairInput

    def shards_like(input_cfg: ConfigBase, paths: Sequence[str]) -> ConfigBase:
        batch, seq_len = _batch_shape(cfg, input_cfg, data_dir)
        keeps = getattr(input_cfg, "klass", None) in (TokenShardInput, PreferencePairInput)
        shards = input_cfg.clone() if keeps else shard_input.default_config()
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
    for evaler in _input_evalers(cfg):
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
        if "input" in evaler.keys()
        and "paths" in evaler.input.keys()
        and evaler.input.paths is REQUIRED
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


# ----- the packages the inputs need -----

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
