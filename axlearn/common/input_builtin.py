"""The built-in default corpus: the Python standard library's source, no download needed.

Every machine that runs axlearn has it. The corpus is the `*.py` files under the
running interpreter's stdlib directory (`sysconfig.get_paths()['stdlib']`), skipping
`site-packages`/`dist-packages`, test directories (`test`, `tests`, `idle_test`) and
`__pycache__`; one file is one document, tokenized with the byte vocabulary (model
vocab size `padded_vocab_size(259) == 384`). A file belongs to the validation split when
the SHA-256 of its path relative to the stdlib directory, read as a fraction of 2**64,
is below `validation_fraction` (2% by default), so the split is stable across machines
and Python versions.

The tokenized splits are cached as token shards (one per split) under
`<cache_dir>/builtin_stdlib/<key>/`, where the key hashes the file list (paths, sizes,
mtimes) and the split settings; later runs only check the key and memory-map.
`cache_dir` defaults to `$AXLEARN_CACHE_DIR` or `~/.cache/axlearn`.
"""

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from typing import Optional

from axlearn.common.config import REQUIRED, ConfigError, Required, config_class
from axlearn.common.input_base import BaseInput, Batch, InputError
from axlearn.common.input_token_format import write_shard
from axlearn.common.input_tokens import TokenShardInput
from axlearn.common.input_vocab import BYTES_VOCAB_NAME, ByteVocabulary
from axlearn.common.module import Module

SPLITS = ("train", "validation")
CACHE_DIR_ENV = "AXLEARN_CACHE_DIR"
_SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
_CACHE_FORMAT = 1  # Bump when the corpus selection or tokenization changes.


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_source_files(root: Optional[str] = None) -> list[str]:
    """Relative paths of the corpus files under `root` (default: the stdlib), sorted."""
    root = root or stdlib_dir()
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS]
        for name in files:
            if name.endswith(".py"):
                found.append(os.path.relpath(os.path.join(directory, name), root))
    return sorted(found)


def split_of(relative_path: str, validation_fraction: float) -> str:
    """'validation' or 'train', from a stable hash of the relative path."""
    digest = hashlib.sha256(relative_path.replace(os.sep, "/").encode("utf-8")).digest()
    fraction = int.from_bytes(digest[:8], "big") / 2.0**64
    return "validation" if fraction < validation_fraction else "train"


def default_cache_dir() -> str:
    default = os.path.join(os.path.expanduser("~"), ".cache", "axlearn")
    return os.environ.get(CACHE_DIR_ENV) or default


def build_corpus_shards(
    *, cache_dir: str, validation_fraction: float, root: Optional[str] = None
) -> dict[str, str]:
    """Tokenizes the corpus into one shard per split (reusing a valid cache); split -> path."""
    root = root or stdlib_dir()
    files = stdlib_source_files(root)
    if not files:
        raise InputError(f"{root}: no Python source files found for the built-in corpus")
    key = hashlib.sha256(repr((_CACHE_FORMAT, validation_fraction)).encode())
    for relative in files:
        stat = os.stat(os.path.join(root, relative))
        key.update(f"{relative}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode("utf-8"))
    directory = os.path.join(cache_dir, "builtin_stdlib", key.hexdigest()[:16])
    paths = {split: os.path.join(directory, f"{split}.tok") for split in SPLITS}
    if all(os.path.isfile(path) for path in paths.values()):
        return paths
    vocab = ByteVocabulary()
    documents = {split: ([], []) for split in SPLITS}
    for relative in files:
        with open(os.path.join(root, relative), "rb") as f:
            data = f.read()
        tokens, sizes = documents[split_of(relative, validation_fraction)]
        tokens.append(vocab.encode_bytes(data))
        sizes.append(len(data))
    for split, (tokens, sizes) in documents.items():
        if not any(len(t) for t in tokens):
            raise InputError(
                f"{root}: the built-in corpus's '{split}' split is empty "
                f"(validation_fraction={validation_fraction})"
            )
        write_shard(
            paths[split],
            tokens,
            sizes,
            vocab_name=BYTES_VOCAB_NAME,
            vocab_size=vocab.vocab_size,
            eos_id=vocab.eos_id,
        )
    return paths


class BuiltinTextInput(BaseInput):
    """Packed byte-level LM batches of the stdlib corpus (see the module docstring)."""

    @config_class
    class Config(BaseInput.Config):
        """Configures BuiltinTextInput."""

        global_batch_size: Required[int] = REQUIRED  # Rows of a global batch, all processes.
        max_sequence_length: Required[int] = REQUIRED  # T: tokens (bytes) per row.
        split: str = "train"  # 'train' or 'validation'.
        validation_fraction: float = 0.02  # Share of files (by path hash) held out.
        seed: int = 0  # Seeds the per-epoch document order of training.
        cache_dir: Optional[str] = None  # None: $AXLEARN_CACHE_DIR or ~/.cache/axlearn.
        # The model's vocab_size; must be >= 259 (the byte vocabulary). None: not checked.
        model_vocab_size: Optional[int] = None
        prefetch_batches: int = 2  # Batches computed ahead in a background thread.

    def __init__(self, cfg: Config, *, parent: Optional[Module], **kwargs):
        super().__init__(cfg, parent=parent, **kwargs)
        cfg = self.config
        if cfg.split not in SPLITS:
            raise ConfigError(f"{self.path()}.split: '{cfg.split}' is not one of {SPLITS}")
        paths = build_corpus_shards(
            cache_dir=cfg.cache_dir or default_cache_dir(),
            validation_fraction=cfg.validation_fraction,
        )
        tokens_cfg = TokenShardInput.default_config().set(
            is_training=cfg.is_training,
            global_batch_size=cfg.global_batch_size,
            max_sequence_length=cfg.max_sequence_length,
            paths=[paths[cfg.split]],
            seed=cfg.seed,
            vocab_name=BYTES_VOCAB_NAME,
            model_vocab_size=cfg.model_vocab_size,
            prefetch_batches=cfg.prefetch_batches,
        )
        self._tokens: TokenShardInput = self._add_child(
            "tokens", tokens_cfg, **self._process_overrides()
        )

    def _host_batches(self, start: int) -> Iterator[Batch]:
        return self._tokens._host_batches(start)  # pylint: disable=protected-access
