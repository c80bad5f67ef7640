"""Hugging Face model directories: config.json, generation_config.json, safetensors
weights (one file, or shards listed by an index) and tokenizer files.

Reading is lazy. `SafetensorsReader` opens the weight files with safetensors' `safe_open`
and reads a tensor, or any slice of it, only when asked; `TensorView`s describe one of
our parameters as a composition of checkpoint tensors (transposed, reshaped, concatenated,
stacked) and read any slice of it by reading only the matching slices of those tensors.
A loader can thus fill each device's shard of each parameter straight from the files,
never holding the whole model in host memory.

Writing (`write_safetensors`) cuts the tensors into files of at most `max_shard_size`
bytes: one `model.safetensors`, or `model-0000i-of-0000n.safetensors` files with the
`model.safetensors.index.json` that transformers reads.
"""

import json
import os
import re
import shutil
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np

from axlearn.common.config import ConfigError

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
# The tokenizer files a model directory may hold, copied together.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)
DEFAULT_MAX_SHARD_SIZE = "5GB"
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10,
               "MIB": 2**20, "GIB": 2**30}

Index = tuple[slice, ...]


def _safetensors() -> Any:
    try:
        import safetensors  # pylint: disable=import-outside-toplevel
    except ImportError:
        raise ConfigError(
            "Hugging Face checkpoints need the 'safetensors' package: pip install 'axlearn[hf]'"
        ) from None
    return safetensors


# ----- JSON files -----


def read_json(path: str) -> dict[str, Any]:
    """The JSON object in `path`; a ConfigError naming the file if missing or unreadable."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return value


def write_json(path: str, value: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")


def read_config(directory: str) -> dict[str, Any]:
    """The model's config.json in `directory`."""
    if not os.path.isdir(directory):
        raise ConfigError(f"{directory}: not a directory (expected a Hugging Face model directory)")
    return read_json(os.path.join(directory, CONFIG_FILE))


def read_generation_config(directory: str) -> dict[str, Any]:
    """generation_config.json in `directory`, or {} where there is none."""
    path = os.path.join(directory, GENERATION_CONFIG_FILE)
    return read_json(path) if os.path.isfile(path) else {}


# ----- reading safetensors lazily -----


def _normalize(index: Index, shape: Sequence[int]) -> tuple[slice, ...]:
    """`index` (slices, possibly open-ended, one per axis or fewer) as bounded slices."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for item, size in zip(index, shape):
        start, stop, step = item.indices(size)
        if step != 1:
            raise ValueError(f"Strided slices are not supported: {item}")
        out.append(slice(start, stop))
    return tuple(out)


def _cpu_device() -> Optional[Any]:
    """JAX's CPU device, where safetensors' jax reader should put what it reads; None
    where this process has no CPU backend."""
    import jax  # pylint: disable=import-outside-toplevel

    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None


class SafetensorsReader:
    """The tensors of a Hugging Face directory's safetensors files, read slice by slice.

    The files are `model.safetensors.index.json`'s, else `model.safetensors`, else the
    directory's only `*.safetensors` file. Tensors are read through safetensors' jax
    reader on the CPU (numpy has no bfloat16) and returned as numpy float32.
    """

    def __init__(self, directory: str):
        self._directory = directory
        index_path = os.path.join(directory, SAFETENSORS_INDEX_FILE)
        self._handles: dict[str, Any] = {}
        self._device = _cpu_device()
        if os.path.isfile(index_path):
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConfigError(f"{index_path}: no weight_map")
            self._files = dict(weight_map)
        else:
            filename = self._single_file()
            self._files = {name: filename for name in self._open(filename).keys()}

    def _single_file(self) -> str:
        if os.path.isfile(os.path.join(self._directory, SAFETENSORS_FILE)):
            return SAFETENSORS_FILE
        found = sorted(f for f in os.listdir(self._directory) if f.endswith(".safetensors"))
        if len(found) != 1:
            raise ConfigError(
                f"{self._directory}: expected {SAFETENSORS_INDEX_FILE}, {SAFETENSORS_FILE} or "
                f"one *.safetensors file; found {found or 'none'}"
            )
        return found[0]

    def _open(self, filename: str) -> Any:
        if filename not in self._handles:
            path = os.path.join(self._directory, filename)
            if not os.path.isfile(path):
                raise ConfigError(f"{path}: missing (listed in {SAFETENSORS_INDEX_FILE})")
            self._handles[filename] = _safetensors().safe_open(path, framework="flax")
        return self._handles[filename]

    @property
    def directory(self) -> str:
        return self._directory

    def names(self) -> set[str]:
        return set(self._files)

    def _slice(self, name: str) -> Any:
        if name not in self._files:
            raise KeyError(f"{self._directory} holds no tensor '{name}'")
        return self._open(self._files[name]).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, index: Index = ()) -> np.ndarray:
        """`tensor[index]` of tensor `name` as float32, reading only that region."""
        import jax  # pylint: disable=import-outside-toplevel

        tensor = self._slice(name)
        index = _normalize(index, tensor.get_shape())
        if self._device is None:
            value = tensor[index]
        else:
            with jax.default_device(self._device):
                value = tensor[index]
        return np.asarray(value).astype(np.float32)


class ArrayReader:
    """The `SafetensorsReader` interface over in-memory arrays (numpy or torch)."""

    def __init__(self, arrays: dict[str, Any]):
        self._arrays = {name: to_float32(value) for name, value in arrays.items()}

    def names(self) -> set[str]:
        return set(self._arrays)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._arrays[name].shape)

    def read(self, name: str, index: Index = ()) -> np.ndarray:
        array = self._arrays[name]
        return array[_normalize(index, array.shape)]


def to_float32(value: Any) -> np.ndarray:
    """A float32 numpy copy of a torch tensor, jax array or numpy array."""
    if hasattr(value, "detach"):  # torch.Tensor (bfloat16 has no numpy dtype: go via float).
        value = value.detach().to("cpu").float().numpy()
    return np.asarray(value, dtype=np.float32)


# ----- views: our parameters in terms of checkpoint tensors -----


class TensorView:
    """A lazily read array of `shape`: `read(index)` returns `array[index]` (float32)."""

    shape: tuple[int, ...]

    def read(self, index: Index = ()) -> np.ndarray:
        raise NotImplementedError(type(self))


class Tensor(TensorView):
    """A checkpoint tensor as it is stored."""

    def __init__(self, reader: Any, name: str):
        self._reader, self.name = reader, name
        self.shape = reader.shape(name)

    def read(self, index: Index = ()) -> np.ndarray:
        return self._reader.read(self.name, _normalize(index, self.shape))


class Transpose(TensorView):
    """A 2-D view transposed ([in, out] for a torch Linear's [out, in])."""

    def __init__(self, source: TensorView):
        if len(source.shape) != 2:
            raise ValueError(f"Transpose needs a 2-D tensor, got shape {source.shape}")
        self._source = source
        self.shape = source.shape[::-1]

    def read(self, index: Index = ()) -> np.ndarray:
        rows, cols = _normalize(index, self.shape)
        return self._source.read((cols, rows)).T


class SplitAxis(TensorView):
    """`source` with axis `axis` of size a*b seen as two axes (a, b), row-major."""

    def __init__(self, source: TensorView, axis: int, sizes: tuple[int, int]):
        if source.shape[axis] != sizes[0] * sizes[1]:
            raise ValueError(f"Cannot split axis {axis} of {source.shape} into {sizes}")
        self._source, self._axis, self._sizes = source, axis, sizes
        self.shape = source.shape[:axis] + tuple(sizes) + source.shape[axis + 1 :]

    def read(self, index: Index = ()) -> np.ndarray:
        index = _normalize(index, self.shape)
        axis, inner = self._axis, self._sizes[1]
        outer_slice, inner_slice = index[axis], index[axis + 1]
        # Whole rows of the outer axis are read, then the inner axis is cut.
        merged = slice(outer_slice.start * inner, outer_slice.stop * inner)
        value = self._source.read(index[:axis] + (merged,) + index[axis + 2 :])
        value = value.reshape(value.shape[:axis] + (-1, inner) + value.shape[axis + 1 :])
        cut = (slice(None),) * (axis + 1) + (inner_slice,)
        return value[cut]


class Concat(TensorView):
    """Views joined along `axis`."""

    def __init__(self, parts: Sequence[TensorView], axis: int):
        self._parts, self._axis = list(parts), axis
        first = self._parts[0].shape
        total = sum(part.shape[axis] for part in self._parts)
        self.shape = first[:axis] + (total,) + first[axis + 1 :]

    def read(self, index: Index = ()) -> np.ndarray:
        index = _normalize(index, self.shape)
        want = index[self._axis]
        pieces, offset = [], 0
        for part in self._parts:
            size = part.shape[self._axis]
            start, stop = max(want.start, offset), min(want.stop, offset + size)
            if start < stop:
                local = slice(start - offset, stop - offset)
                pieces.append(part.read(index[: self._axis] + (local,) + index[self._axis + 1 :]))
            offset += size
        if not pieces:
            empty = [s.stop - s.start for s in index]
            return np.zeros(empty, np.float32)
        return np.concatenate(pieces, axis=self._axis)


class Stack(TensorView):
    """Views of one shape stacked on a new leading axis (layers of a scanned stack)."""

    def __init__(self, parts: Sequence[TensorView]):
        self._parts = list(parts)
        shapes = {part.shape for part in self._parts}
        if len(shapes) != 1:
            raise ValueError(f"Stack needs views of one shape, got {sorted(shapes)}")
        self.shape = (len(self._parts),) + self._parts[0].shape

    def read(self, index: Index = ()) -> np.ndarray:
        index = _normalize(index, self.shape)
        layers = range(index[0].start, index[0].stop)
        return np.stack([self._parts[i].read(index[1:]) for i in layers])


class Zeros(TensorView):
    """Zeros of `shape`: a parameter no checkpoint tensor holds (e.g. FP8 scaling state)."""

    def __init__(self, shape: tuple[int, ...]):
        self.shape = tuple(shape)

    def read(self, index: Index = ()) -> np.ndarray:
        return np.zeros([s.stop - s.start for s in _normalize(index, self.shape)], np.float32)


def map_views(fn: Callable[[TensorView], Any], tree: Any) -> Any:
    """`fn` applied to every view of a nested dict of views."""
    if isinstance(tree, dict):
        return {key: map_views(fn, value) for key, value in tree.items()}
    return fn(tree)


# ----- writing -----


def parse_size(text: str) -> int:
    """Bytes of a size such as '5GB', '500MB', '2GiB' or '1000000'."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMG]I?B|B)?\s*", str(text).upper())
    if not match:
        raise ConfigError(f"Cannot read size {text!r}: expected e.g. 5GB, 500MB, 2GiB or bytes")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or ""])


def _shards(tensors: dict[str, np.ndarray], max_bytes: int) -> list[list[str]]:
    """Tensor names in files of at most `max_bytes` (a larger tensor gets a file alone)."""
    files: list[list[str]] = []
    size = 0
    for name, value in tensors.items():
        if not files or size + value.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += value.nbytes
    return files


def write_safetensors(
    tensors: dict[str, np.ndarray], directory: str, *, max_shard_size: int
) -> list[str]:
    """Writes `tensors` (in their order) into `directory` as safetensors files of at most
    `max_shard_size` bytes each, with an index when there are several; returns the
    names of the files written."""
    from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

    _safetensors()
    os.makedirs(directory, exist_ok=True)
    groups = _shards(tensors, max_shard_size)
    if len(groups) == 1:
        names = [SAFETENSORS_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for filename, group in zip(names, groups):
        # 'pt': the format transformers expects of a PyTorch model's weights.
        save_file(
            {name: np.ascontiguousarray(tensors[name]) for name in group},
            os.path.join(directory, filename),
            metadata={"format": "pt"},
        )
        weight_map.update({name: filename for name in group})
    if len(names) > 1:
        total = sum(value.nbytes for value in tensors.values())
        write_json(
            os.path.join(directory, SAFETENSORS_INDEX_FILE),
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )
        names.append(SAFETENSORS_INDEX_FILE)
    return names


def tokenizer_files_in(directory: str) -> list[str]:
    """The paths of the tokenizer files `directory` holds."""
    return [
        os.path.join(directory, name)
        for name in TOKENIZER_FILES
        if os.path.isfile(os.path.join(directory, name))
    ]


def copy_tokenizer(tokenizer_file: str, directory: str) -> list[str]:
    """Copies a tokenizer into model directory `directory`; returns the names written.

    A Hugging Face `tokenizer.json` comes with the tokenizer files beside it
    (tokenizer_config.json, special_tokens_map.json); a SentencePiece model is written as
    `tokenizer.model`, the name Llama tokenizers look for.
    """
    if not os.path.isfile(tokenizer_file):
        raise ConfigError(f"{tokenizer_file}: tokenizer file not found")
    os.makedirs(directory, exist_ok=True)
    if tokenizer_file.endswith(".json"):
        sources = [tokenizer_file] + [
            path
            for path in tokenizer_files_in(os.path.dirname(os.path.abspath(tokenizer_file)))
            if path.endswith(("tokenizer_config.json", "special_tokens_map.json"))
        ]
        targets = ["tokenizer.json"] + [os.path.basename(path) for path in sources[1:]]
    else:
        sources, targets = [tokenizer_file], ["tokenizer.model"]
    for source, target in zip(sources, targets):
        shutil.copyfile(source, os.path.join(directory, target))
    return targets
