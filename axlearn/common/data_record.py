"""A run's record of its data: what every input reads (`data.json` in the trainer
directory), compared on every start with the last start's, so that a restart cannot
silently train on other data (shards rebuilt with another vocabulary under the same
--data_dir, say) unless --allow_data_change says so.

Each input source is described cheaply, without reading the data itself:
- token shards: the vocabulary from the first shard's manifest (name, kind, size, EOS id,
  SHA-256 of the vocabulary file), the number of shards and a fingerprint, the SHA-256 of
  every shard's header in order (each header holds its payload's CRC-32, token and
  document counts);
- BUILTIN: the same, of the built-in corpus's shard for its split;
- FAKE: its vocabulary size and seed;
- any other input: its class (its fields are in config.txt).
"""

import dataclasses
import hashlib
import json
import logging
from typing import Any

from axlearn.common import file_system, run_record
from axlearn.common.config import ConfigBase, ConfigError, qualified_name
from axlearn.common.run_dir import RunDir

log = logging.getLogger(__name__)

_TOKEN_SHARDS = "axlearn.common.input_tokens.TokenShardInput"
_BUILTIN = "axlearn.common.input_builtin.BuiltinTextInput"
_FAKE = "axlearn.common.input_fake.FakeLmInput"
_DESCRIBED = (_TOKEN_SHARDS, _BUILTIN, _FAKE)


# ----- describing the data -----


def _read_manifest(path: str, header: Any) -> Any:
    """The vocabulary record of the shard at `path`, from its manifest bytes alone."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.input_token_format import HEADER_SIZE, read_manifest

    end = HEADER_SIZE + header.payload_size()
    start = end - header.manifest_size
    if header.manifest_size == 0:
        data = b""
    elif file_system.is_local(path):
        with open(file_system.local_path(path), "rb") as f:
            f.seek(start)
            data = f.read(header.manifest_size)
    else:
        # pylint: disable-next=import-outside-toplevel,protected-access
        from axlearn.common.input_tokens import _url_store

        data = bytes(_url_store(path).read(b"", byte_range=slice(start, end)).result().value)
    return read_manifest(data, header, path=path)


def describe_token_shards(patterns: list[str]) -> dict[str, Any]:
    """The vocabulary, shard count and header fingerprint of the shards `patterns` name."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.input_tokens import expand_shard_paths, read_shard_headers

    paths = expand_shard_paths(patterns)
    headers = read_shard_headers(paths)
    fingerprint = hashlib.sha256()
    for header in headers:
        fingerprint.update(json.dumps(dataclasses.astuple(header)).encode("utf-8"))
    vocabulary = _read_manifest(paths[0], headers[0])
    return {
        "kind": "token_shards",
        "vocabulary": {
            "name": vocabulary.name,
            "kind": vocabulary.kind,
            "size": vocabulary.size,
            "eos_id": vocabulary.eos_id,
            "sha256": vocabulary.sha256,
        },
        "shards": len(paths),
        "tokens": sum(header.num_tokens for header in headers),
        "fingerprint": fingerprint.hexdigest(),
    }


def _describe_builtin(cfg: ConfigBase) -> dict[str, Any]:
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common import input_builtin

    paths = input_builtin.build_corpus_shards(
        cache_dir=cfg.cache_dir or input_builtin.default_cache_dir(),
        validation_fraction=cfg.validation_fraction,
    )
    return {**describe_token_shards([paths[cfg.split]]), "kind": "builtin", "split": cfg.split}


def describe_source(cfg: ConfigBase) -> dict[str, Any]:
    """The description of one input config (see the module docstring)."""
    name = qualified_name(getattr(cfg, "klass", None))
    if name == _TOKEN_SHARDS:
        return describe_token_shards(list(cfg.paths))
    if name == _BUILTIN:
        return _describe_builtin(cfg)
    if name == _FAKE:
        return {"kind": "fake", "vocabulary": {"size": cfg.vocab_size}, "seed": cfg.seed}
    return {"kind": name or type(cfg).__qualname__}


def _sources(root_path: str, root: ConfigBase) -> dict[str, ConfigBase]:
    """{config path: config} of the token shard, BUILTIN and FAKE inputs in `root` (itself,
    or a mixture's sources), or {root_path: root} where it holds none of them."""
    found: dict[str, ConfigBase] = {}

    def enter(path: str, value: Any) -> bool:
        if not isinstance(value, ConfigBase):
            return True
        if qualified_name(getattr(value, "klass", None)) not in _DESCRIBED:
            return True
        found[f"{root_path}.{path}" if path else root_path] = value
        return False

    if enter("", root):
        root.visit(lambda path, value: None, enter)
    return found or {root_path: root}


def describe_data(cfg: ConfigBase) -> dict[str, dict[str, Any]]:
    """{config path of an input source: its description}, for the training input and
    every evaler's (see `_sources`)."""
    roots = {"input": cfg.input}
    roots.update({f"evalers['{name}'].input": e.input for name, e in cfg.evalers.items()
                  if "input" in e.keys()})  # lm-eval's evaler reads its tasks, not an input.
    return {
        path: describe_source(source)
        for root_path, root in roots.items()
        for path, source in _sources(root_path, root).items()
    }


# ----- comparing with the last start's -----


def _vocabulary_text(description: dict[str, Any]) -> str:
    vocab = description.get("vocabulary") or {}
    name = f"'{vocab['name']}' " if vocab.get("name") else ""
    kind = f"{vocab['kind']}, " if vocab.get("kind") else ""
    sha = f", sha256 {vocab['sha256'][:12]}" if vocab.get("sha256") else ""
    return f"{name}({kind}{vocab.get('size')} ids{sha})"


def source_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two descriptions of one source, one phrase each."""
    if old.get("kind") != new.get("kind"):
        return [f"{old.get('kind')} -> {new.get('kind')}"]
    changes = []
    if old.get("vocabulary") != new.get("vocabulary"):
        changes.append(f"vocabulary {_vocabulary_text(old)} -> {_vocabulary_text(new)}")
    for key in ("split", "seed", "shards", "tokens"):
        if old.get(key) != new.get(key):
            changes.append(f"{key} {old.get(key)} -> {new.get(key)}")
    if old.get("fingerprint") != new.get("fingerprint") and not changes:
        changes.append(
            f"contents (header fingerprint {str(old.get('fingerprint'))[:12]} -> "
            f"{str(new.get('fingerprint'))[:12]})"
        )
    return changes


def data_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """'source: change; change' for each source whose description differs."""
    changes = []
    for path in sorted(set(old) | set(new)):
        if path not in old:
            changes.append(f"{path}: new source ({new[path].get('kind')})")
        elif path not in new:
            changes.append(f"{path}: source gone ({old[path].get('kind')})")
        elif old[path] != new[path]:
            changes.append(f"{path}: {'; '.join(source_changes(old[path], new[path]))}")
    return changes


def check_data_record(
    run: RunDir, description: dict[str, Any], *, allow_change: bool
) -> None:
    """Compares `description` with the data recorded by the run's last start, if any:
    once the run has a checkpoint, a change is an error naming it, unless `allow_change`
    (then a warning); before (a start that failed), the record is simply replaced."""
    path = run.data_record
    if not file_system.isfile(path) or not run_record.has_checkpoint(run):
        return
    try:
        old = json.loads(file_system.read_text(path))["sources"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{path} is not a data record this version can read ({e}); delete it to record "
            "the data afresh"
        ) from e
    changes = data_changes(old, description)
    if not changes:
        return
    summary = " | ".join(changes)
    if allow_change:
        log.warning("%s: the data changed since the run's last start (allowed): %s", path, summary)
        return
    raise ConfigError(
        f"{path}: the data changed since the run's last start: {summary}. Resume on it anyway "
        "with --allow_data_change, or start a new run in another --trainer_dir"
    )


def write_data_record(run: RunDir, description: dict[str, Any]) -> None:
    """Records `description` as the run's data (process 0 only)."""
    file_system.makedirs(run.root)
    text = json.dumps({"sources": description}, indent=1, sort_keys=True) + "\n"
    file_system.write_text(run.data_record, text)

