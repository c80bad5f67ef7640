"""Quantized artifacts: a run's model in one compact file, and its round-trip evaluation.

    python -m axlearn.common.quantize export --trainer_dir=T [--step=N] --quantize=int8 \\
        --output=model.int8.axq [--compression=zlib|zstd] [--keep=REGEX] [--no_eval]

writes the model parameters of the run's checkpoint (latest, or --step) quantized per row
(`axlearn.common.quantization`: int8, or int6 packed four values to three bytes, float16
scales; tensors under --min_size=65,536 elements, and those --keep matches, as they are),
compressed; reads the file back, checks it holds exactly what was written, prints its
byte count
and, for each of the run's evalers, the validation loss and bits per byte of the original
model beside those of the dequantized one (one JSON line each). The artifact also holds
the model's config and the run's tokenizer name, so that

    python -m axlearn.common.generate --artifact=model.int8.axq --prompt=...
    python -m axlearn.common.launch_trainer_main --config=... --eval_only --artifact=...

decode and evaluate it without the run's directory. The file format is docs/quantization.md's.
"""

import hashlib
import json
import logging
import os
import re
import struct
import sys
import zlib
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
from absl import flags

from axlearn.common import file_system, quantization
from axlearn.common.command_flags import parse_command_flags
from axlearn.common.config import ConfigBase, ConfigError
from axlearn.common.quantization import QuantizationError

log = logging.getLogger(__name__)

MAGIC = b"AXLEARNQ"  # The file's first 8 bytes.
VERSION = 1
FORMAT = "axlearn.quantized"
COMPRESSIONS = ("zlib", "zstd")
_ZSTD_LEVEL = 19
_ZLIB_LEVEL = 9
PROGRAM = "axlearn.common.quantize"


class ArtifactError(ValueError):
    """A file that is not a readable artifact: another format, truncated or damaged."""


# ----- compression -----


def _zstd():
    try:
        import zstandard  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise ConfigError(
            "--compression=zstd needs the zstandard package (pip install zstandard); "
            "--compression=zlib needs nothing"
        ) from e
    return zstandard


def _compress(data: bytes, compression: str) -> bytes:
    if compression == "zlib":
        return zlib.compress(data, _ZLIB_LEVEL)
    if compression == "zstd":
        return _zstd().ZstdCompressor(level=_ZSTD_LEVEL).compress(data)
    raise ConfigError(f"--compression={compression!r}: choose one of {', '.join(COMPRESSIONS)}")


def _decompress(data: bytes, compression: str, size: int) -> bytes:
    if compression == "zlib":
        return zlib.decompress(data)
    return _zstd().ZstdDecompressor().decompress(data, max_output_size=size)


# ----- the artifact -----


def quantize_params(
    flat: dict[str, np.ndarray], quantize: str, *, keep: Optional[str] = None,
    min_size: int = quantization.MIN_QUANTIZED_SIZE,
) -> dict[str, dict[str, Any]]:
    """{path: entry} of flat model parameters: an entry is dict(encoding='raw', array=...)
    or dict(encoding='int8'|'int6', values=int8 array, scale=float16 array, dtype=name,
    axes=(...))."""
    bits = quantization.bits_of(quantize)
    entries = {}
    for path, array in flat.items():
        array = np.asarray(array)
        if quantization.is_quantized(path, array.shape, array.dtype, min_size=min_size, keep=keep):
            axes = quantization.contracted_axes(path, array.ndim)
            values, scale = quantization.quantize(array, bits, axes, name=path)
            entries[path] = dict(
                encoding=quantize, values=values, scale=scale, dtype=str(array.dtype), axes=axes
            )
        else:
            entries[path] = dict(encoding="raw", array=array)
    return entries


def _raw_bytes(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()


def encode_artifact(
    entries: dict[str, dict[str, Any]], *, quantize: str, compression: str = "zlib",
    meta: Optional[dict[str, Any]] = None,
) -> bytes:
    """The artifact's bytes: MAGIC, the header's length (8 bytes, little-endian), the JSON
    header, then the compressed payload of every tensor's bytes in header order."""
    pieces, tensors, offset = [], [], 0

    def add(data: bytes) -> dict[str, int]:
        nonlocal offset
        pieces.append(data)
        span = dict(offset=offset, size=len(data))
        offset += len(data)
        return span

    for path, entry in entries.items():
        if entry["encoding"] == "raw":
            array = entry["array"]
            if array.dtype.kind not in "fiub" or array.dtype.itemsize > 8:
                raise QuantizationError(f"{path}: dtype {array.dtype} cannot be stored")
            tensors.append(dict(
                path=path, encoding="raw", shape=list(array.shape), dtype=str(array.dtype),
                data=add(_raw_bytes(array)),
            ))
            continue
        values = entry["values"]
        data = (
            quantization.pack_int6(values) if entry["encoding"] == "int6" else values.tobytes()
        )
        tensors.append(dict(
            path=path, encoding=entry["encoding"], shape=list(values.shape),
            dtype=entry["dtype"], axes=list(entry["axes"]), data=add(data),
            scale=add(_raw_bytes(entry["scale"].astype(np.float16))),
        ))
    raw = b"".join(pieces)
    payload = _compress(raw, compression)
    header = dict(
        format=FORMAT, version=VERSION, quantize=quantize, compression=compression,
        raw_size=len(raw), payload_size=len(payload),
        payload_sha256=hashlib.sha256(payload).hexdigest(), meta=meta or {}, tensors=tensors,
    )
    header_bytes = json.dumps(header, sort_keys=True).encode("utf-8")
    return MAGIC + struct.pack("<Q", len(header_bytes)) + header_bytes + payload


def decode_artifact(data: bytes, *, source: str = "<artifact>") -> tuple[dict, dict]:
    """(header, {path: entry}) of an artifact's bytes; an ArtifactError (one line naming
    `source`) for another format, a truncated or damaged file."""
    if data[: len(MAGIC)] != MAGIC:
        raise ArtifactError(
            f"{source}: not a quantized artifact (it starts with {data[:8]!r}, not {MAGIC!r})"
        )
    start = len(MAGIC) + 8
    if len(data) < start:
        raise ArtifactError(f"{source}: truncated ({len(data)} bytes, in its header)")
    (header_size,) = struct.unpack("<Q", data[len(MAGIC) : start])
    if len(data) < start + header_size:
        raise ArtifactError(
            f"{source}: truncated ({len(data)} bytes; its header alone needs {start + header_size})"
        )
    try:
        header = json.loads(data[start : start + header_size].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{source}: damaged header ({e})") from e
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise ArtifactError(
            f"{source}: format {header.get('format')!r} version {header.get('version')!r}; "
            f"this reader reads {FORMAT!r} version {VERSION}"
        )
    payload = data[start + header_size :]
    expected = start + header_size + header["payload_size"]
    if len(data) != expected:
        state = "truncated" if len(data) < expected else "longer than its header says"
        raise ArtifactError(f"{source}: {state} ({len(data)} bytes, expected {expected})")
    if hashlib.sha256(payload).hexdigest() != header["payload_sha256"]:
        raise ArtifactError(f"{source}: damaged (its payload's sha256 differs from the header's)")
    if header["compression"] not in COMPRESSIONS:
        raise ArtifactError(f"{source}: unknown compression {header['compression']!r}")
    raw = _decompress(payload, header["compression"], header["raw_size"])
    entries = {}
    for tensor in header["tensors"]:
        shape, span = tuple(tensor["shape"]), tensor["data"]
        data_bytes = raw[span["offset"] : span["offset"] + span["size"]]
        count = int(np.prod(shape))
        if tensor["encoding"] == "raw":
            dtype = np.dtype(tensor["dtype"]).newbyteorder("<")
            array = np.frombuffer(data_bytes, dtype).astype(np.dtype(tensor["dtype"]))
            entries[tensor["path"]] = dict(encoding="raw", array=array.reshape(shape))
            continue
        if tensor["encoding"] == "int6":
            values = quantization.unpack_int6(data_bytes, count)
        else:
            values = np.frombuffer(data_bytes, np.int8).copy()
        axes = tuple(tensor["axes"])
        scale_shape = tuple(1 if i - len(shape) in axes else n for i, n in enumerate(shape))
        scale_span = tensor["scale"]
        scale = np.frombuffer(
            raw[scale_span["offset"] : scale_span["offset"] + scale_span["size"]], "<f2"
        ).astype(np.float16)
        entries[tensor["path"]] = dict(
            encoding=tensor["encoding"], values=values.reshape(shape),
            scale=scale.reshape(scale_shape), dtype=tensor["dtype"], axes=axes,
        )
    return header, entries


def read_artifact(path: str) -> tuple[dict, dict]:
    """`decode_artifact` of the file at `path`."""
    if not file_system.exists(path):
        raise ArtifactError(f"{path}: no such file")
    return decode_artifact(file_system.read_bytes(path), source=path)


def dequantized_params(entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The nested parameter tree (NumPy arrays in their original dtypes) of the entries."""
    from axlearn.common.utils import unflatten_paths  # pylint: disable=import-outside-toplevel

    flat = {}
    for path, entry in entries.items():
        if entry["encoding"] == "raw":
            flat[path] = entry["array"]
        else:
            flat[path] = quantization.dequantize(entry["values"], entry["scale"], entry["dtype"])
    return unflatten_paths(flat)


def model_config_of(header: dict, *, source: str) -> ConfigBase:
    """The model config an artifact recorded."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.golden_text import parse_flat_text

    text = header.get("meta", {}).get("model_config")
    if not text:
        raise ArtifactError(f"{source}: records no model config")
    return parse_flat_text(text, source=f"{source} (model_config)")


def check_matches(entries: dict[str, Any], param_specs: Any, *, source: str) -> None:
    """A ConfigError (one line) unless the entries are exactly the specs' paths and shapes."""
    from axlearn.common.utils import flatten_with_paths  # pylint: disable=import-outside-toplevel

    specs = dict(flatten_with_paths(param_specs, is_leaf=lambda x: hasattr(x, "shape")))
    missing, extra = sorted(set(specs) - set(entries)), sorted(set(entries) - set(specs))
    if missing or extra:
        raise ConfigError(
            f"{source}: does not fit the model (missing {missing[:3]}, extra {extra[:3]})"
        )
    for path, spec in specs.items():
        entry = entries[path]
        shape = (entry["array"] if entry["encoding"] == "raw" else entry["values"]).shape
        if tuple(shape) != tuple(spec.shape):
            raise ConfigError(
                f"{source}: {path} has shape {tuple(shape)}, the model's is {tuple(spec.shape)}"
            )


def params_for_specs(entries: dict[str, Any], param_specs: Any, *, source: str) -> Any:
    """The entries' parameters, dequantized, as the tree and dtypes of `param_specs` (host
    arrays); a ConfigError where they do not fit the model."""
    import jax  # pylint: disable=import-outside-toplevel

    check_matches(entries, param_specs, source=source)
    return jax.tree.map(
        lambda x, spec: np.asarray(x, spec.dtype), dequantized_params(entries), param_specs,
        is_leaf=lambda x: hasattr(x, "shape"),
    )


# ----- the export command -----


def define_flags(flag_values: flags.FlagValues) -> None:
    """The export command's flags."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_string("trainer_dir", None, "The run's directory.", **fv)
    flags.DEFINE_integer("step", None, "Its checkpoint step (default: the latest).", **fv)
    flags.DEFINE_string(
        "quantize", "int8", "int8 or int6, or both (int8,int6: one artifact each).", **fv
    )
    flags.DEFINE_string(
        "output", None, "The artifact's path; with several --quantize values, '{quantize}' "
        "in it stands for each.", **fv
    )
    flags.DEFINE_string("compression", "zlib", "zlib or zstd (the zstandard package).", **fv)
    flags.DEFINE_string(
        "keep", None, "A regex (re.search) of parameter paths stored as they are.", **fv
    )
    flags.DEFINE_integer(
        "min_size", quantization.MIN_QUANTIZED_SIZE,
        "Tensors with fewer elements are stored as they are.", **fv
    )
    flags.DEFINE_bool("no_eval", False, "Skip the round-trip evaluation.", **fv)


def _round_trip_eval(
    cfg: ConfigBase, original: Any, dequantized: dict[str, Any], step: int
) -> list[dict]:
    """Each evaler's metrics of the original parameters beside those of each dequantized
    tree (the run's trainer without a directory: nothing is written into the run)."""
    trainer = cfg.clone(dir=None).instantiate(parent=None)
    before = trainer.evaluate_params(original, step=step)
    after = {
        kind: trainer.evaluate_params(params, step=step) for kind, params in dequantized.items()
    }
    rows = []
    for kind, results in after.items():
        for name in before:
            row = dict(evaler=name, step=step, quantize=kind)
            for metric in ("loss", "bits_per_byte"):
                if metric in before[name]:
                    row[metric] = before[name][metric]
                    row[f"quantized_{metric}"] = results[name][metric]
            rows.append(row)
    return rows


def output_paths(output: str, kinds: Sequence[str]) -> dict[str, str]:
    """{quantization: artifact path}: `output` itself for one, with '{quantize}' filled in
    for several (a ConfigError if it lacks it)."""
    if len(kinds) > 1 and "{quantize}" not in output:
        raise ConfigError(
            f"--output={output}: several --quantize values need '{{quantize}}' in the path"
        )
    return {kind: output.replace("{quantize}", kind) for kind in kinds}


def export(fv: flags.FlagValues, out=None) -> dict[str, Any]:
    """The export command; returns what it printed (one summary per artifact, the
    evaluation rows)."""
    # pylint: disable=import-outside-toplevel
    import jax

    from axlearn.common import trainer_dir
    from axlearn.common.utils import flatten_with_paths

    out = out or sys.stdout
    kinds = [kind.strip() for kind in fv.quantize.split(",")]
    for kind in kinds:
        quantization.bits_of(kind)
    paths = output_paths(fv.output, kinds)
    for path in paths.values():
        parent = os.path.dirname(path)
        if file_system.is_local(path) and parent and not os.path.isdir(parent):
            raise ConfigError(f"--output={path}: no directory {parent}")
    if fv.compression not in COMPRESSIONS:
        raise ConfigError(
            f"--compression={fv.compression!r}: choose one of {', '.join(COMPRESSIONS)}"
        )
    if fv.compression == "zstd":
        _zstd()
    if fv.keep:
        try:
            re.compile(fv.keep)
        except re.error as e:
            raise ConfigError(f"--keep={fv.keep!r}: {e}") from e
    cfg = trainer_dir.read_trainer_config(fv.trainer_dir)
    step, params = trainer_dir.restore_model_params(
        fv.trainer_dir, step=fv.step, model_config=cfg.model
    )
    params = jax.device_get(params)
    flat = {path: np.asarray(x) for path, x in flatten_with_paths(params)}
    meta = dict(
        step=step, model_config=cfg.model.debug_string(),
        tokenizer=trainer_dir.recorded_tokenizer(cfg), source=fv.trainer_dir,
    )
    summaries, dequantized = [], {}
    for kind, path in paths.items():
        entries = quantize_params(flat, kind, keep=fv.keep, min_size=fv.min_size)
        data = encode_artifact(entries, quantize=kind, compression=fv.compression, meta=meta)
        _, read_back = decode_artifact(data, source=path)
        _check_identical(entries, read_back, source=path)
        file_system.write_bytes(path, data)
        quantized = sum(1 for e in entries.values() if e["encoding"] != "raw")
        summaries.append(dict(
            artifact=path, bytes=len(data), quantize=kind, compression=fv.compression,
            quantized_tensors=quantized, kept_tensors=len(entries) - quantized, step=step,
        ))
        out.write(json.dumps(summaries[-1]) + "\n")
        out.flush()
        dequantized[kind] = dequantized_params(read_back)
    rows = []
    if not fv.no_eval and cfg.evalers:
        rows = _round_trip_eval(cfg, params, dequantized, step)
        for row in rows:
            out.write(json.dumps(row, sort_keys=True) + "\n")
        out.flush()
    return dict(artifacts=summaries, evaluation=rows)


def _check_identical(written: dict, read: dict, *, source: str) -> None:
    """An ArtifactError unless `read` holds exactly `written`'s arrays."""
    for path, entry in written.items():
        other = read.get(path)
        fields = ("array",) if entry["encoding"] == "raw" else ("values", "scale")
        if other is None or not all(
            np.array_equal(entry[f], other[f]) and entry[f].dtype == other[f].dtype
            for f in fields
        ):
            raise ArtifactError(f"{source}: {path} does not read back as written")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """`export` and its flags (argv without the program name; None: sys.argv's)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    doc = f"usage: python -m {PROGRAM} export [flags]\n\n{__doc__}"
    if argv and argv[0] in ("-h", "--help", "-help", "--helpfull"):
        parse_command_flags(define_flags, argv, program=PROGRAM, doc=doc)
    if not argv or argv[0] != "export":
        raise SystemExit(f"{PROGRAM}: the command is `export` (python -m {PROGRAM} export --help)")
    fv, _ = parse_command_flags(
        define_flags, argv[1:], program=f"{PROGRAM} export", doc=doc, reads_config_text=True
    )
    missing = [name for name in ("trainer_dir", "output") if not fv[name].value]
    if missing:
        raise SystemExit(f"{PROGRAM} export: pass {' and '.join('--' + m for m in missing)}")
    try:
        export(fv)
    except (ConfigError, ValueError, OSError) as e:
        raise SystemExit(f"{PROGRAM} export: {e}") from e


if __name__ == "__main__":
    main()
