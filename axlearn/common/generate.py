"""Generates text with a trained model: from a trainer directory or a Hugging Face
directory (Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral: `hf_models.FAMILIES`), over one device
or several (tensor parallel).

    python -m axlearn.common.generate --trainer_dir=T [--step=N] --prompt="Once upon a time"
    python -m axlearn.common.generate --hf_dir=D --prompt_file=prompts.txt --max_new_tokens=128 \\
        [--temperature=0.8 --top_k=50 --top_p=0.95] [--batch_size=8] [--devices=4]
    python -m axlearn.common.generate --artifact=model.axq [--quantize=int8] --prompt=...

Prompts (`--prompt`, repeatable, or `--prompt_file`, one a line) are encoded with the
model's tokenizer: a trainer directory's is the one recorded with its data
(`trainer_dir.recorded_tokenizer`), a Hugging Face directory's its tokenizer.json or
tokenizer.model; `--tokenizer` names another (a file, or `bytes`). The vocabulary's bos
id, if it has one, starts each prompt. Prompts run in batches of `--batch_size`.

Each batch runs as jitted programs over the decoder's KV cache (`Decoder.extend_step`):
one prefill of the whole prompt that also chooses the first token, then chunks of
`--chunk_size` tokens, each chunk a `lax.scan` of one token per step whose cache buffers
are donated from chunk to chunk (updated in place). The host dispatches the next chunk
before reading the last one's tokens, so it never stalls the device; it stops once every
row reached one of the EOS ids (at most one chunk later) or `--max_new_tokens`. Tokens
are greedy (`--temperature=0`, the default) or sampled with temperature, top-k and top-p.

`--devices=N` shards the model over N devices (default: every local device, or the most
that divide the model's heads): attention over its heads (a fused q/k/v projection is
decoded as three, `decoding_config`), the MLP over its hidden units, the LM head over the
vocabulary, the KV cache over its key/value heads; XLA places the collectives, one
all-reduce after each layer's attention and one after its MLP. A Hugging Face
directory's weights load straight into their shards.

`--artifact` reads a quantized artifact (`axlearn.common.quantize`: the model's config,
its weights, its tokenizer's name), dequantized. `--quantize=int8` decodes with int8
weights and per-row scales (`quantize_for_decoding`; an int8 artifact's own), on one
device: each matmul converts the int8 values inside the dot and scales its product, so a
token reads half the bytes of bf16 weights.

Prints each completion on stdout, the text alone (at batch size 1, `--stream` prints the
tokens of each chunk as it arrives), and on stderr the time to the first token and the
decoding speed in generated tokens per second (compiling and one warm-up run of each
program apart), for the prompts given: a batch short of `--batch_size` prompts is padded
with rows of one token, so that every batch runs the same compiled programs, and the line
says so ('1 prompt, batch padded to 8'). Nothing in a call compiles but its two programs:
the prompts reach the device as plain transfers and the PRNG key is made inside the
prefill. The command keeps
its compiled programs (`--jax_compilation_cache_dir`, `compilation_cache`): a later run with the same model and
shapes loads them instead of compiling.
"""

import dataclasses
import functools
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from axlearn.common import (
    compilation_cache,
    hf_checkpoint,
    hf_models,
    lora,
    quantization,
    trainer_dir,
)
from axlearn.common.attention import FusedGroupedQKVLinear, GroupedQKVLinear
from axlearn.common.base_layer import QuantizedWeight
from axlearn.common.causal_lm import language_model_config
from axlearn.common.command_flags import parse_command_flags
from axlearn.common.config import ConfigBase, ConfigError
from axlearn.common.decoder import greedy_choice, sampling_choice, token_id_list
from axlearn.common.input_vocab import (
    BYTES_VOCAB_NAME,
    NO_ID,
    ByteVocabulary,
    Vocabulary,
    VocabularyError,
    load_vocabulary,
)
from axlearn.common.module import functional
from axlearn.common.utils import cast_floats, flatten_with_paths

log = logging.getLogger(__name__)

# Prompt lengths are rounded up to a multiple of this, so that batches of similar
# prompts share one compiled program.
PROMPT_LENGTH_MULTIPLE = 32
# Tokens decoded per jitted call unless told otherwise.
DEFAULT_CHUNK_SIZE = 16
# The mesh axis that tensor parallelism splits heads, MLP units and the vocabulary over.
MODEL_AXIS = "model"


@dataclasses.dataclass
class Sampling:
    """How the next token is chosen: greedy at temperature 0, else sampled."""

    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: int = 0


@dataclasses.dataclass
class GenerationStats:
    """What a `Generator.generate` call did."""

    new_tokens: int = 0  # Tokens generated for the prompts (EOS included).
    decode_seconds: float = 0.0  # Wall time of the jitted calls (prefill included).
    prefill_seconds: float = 0.0  # Of which prefill, up to each batch's first token.
    compile_seconds: float = 0.0  # Compiling and one warm-up run per program.
    batches: int = 0  # Batches run (each has one prefill).
    new_tokens_after_first: int = 0  # new_tokens less each generating row's first token.
    prompts: int = 0  # Prompts decoded: the rows that hold one.
    # Rows of every batch: batch_size, the rows past the prompts padding (one token each),
    # so that every batch, and the next run through the compilation cache, runs the same
    # two compiled programs.
    batch_rows: int = 0

    def rows_text(self) -> str:
        """The prompts and, where the batches hold padding rows, the batch size: '1 prompt,
        batch padded to 8', '16 prompts in 2 batches of 8', '10 prompts in 2 batches of 8,
        the last padded from 2'."""
        text = f"{self.prompts:,} prompt" + ("" if self.prompts == 1 else "s")
        last = self.prompts - (self.batches - 1) * self.batch_rows
        if self.batches > 1:
            text += f" in {self.batches:,} batches of {self.batch_rows:,}"
            return text if last == self.batch_rows else f"{text}, the last padded from {last:,}"
        return text if last == self.batch_rows else f"{text}, batch padded to {self.batch_rows:,}"

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens over all the jitted calls' time."""
        return self.new_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def first_token_seconds(self) -> float:
        """Mean time from a batch's start to its first token (the prompt's prefill)."""
        return self.prefill_seconds / self.batches if self.batches else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after each row's first over the time after the prefills."""
        seconds = self.decode_seconds - self.prefill_seconds
        rows_first = self.new_tokens_after_first
        return rows_first / seconds if seconds > 0 else 0.0


# ----- tensor parallelism -----


def make_mesh(num_devices: int) -> Mesh:
    """A one-axis ('model') mesh over the first `num_devices` local devices."""
    devices = jax.local_devices()
    if not 1 <= num_devices <= len(devices):
        raise ConfigError(
            f"--devices={num_devices}: this host has {len(devices)} "
            f"{devices[0].platform} device(s)"
        )
    return Mesh(np.asarray(devices[:num_devices]), (MODEL_AXIS,))


def _divisible_sizes(model_config: ConfigBase) -> dict[str, int]:
    """The sizes tensor parallelism splits: heads, key/value heads, MLP units (those a
    config states as numbers; a weight whose dim the device count does not divide stays
    whole, `tensor_parallel_shardings`)."""
    layer = getattr(model_config.decoder.transformer, "layer", None)
    attention = getattr(getattr(layer, "self_attention", None), "attention", None)
    if attention is None:  # Not one layer config repeated (e.g. a list of layers).
        return {}
    kv_heads, projection = attention.num_heads, attention.input_linear
    while projection is not None:
        kv_heads = getattr(projection, "num_kv_heads", kv_heads)
        projection = getattr(projection, "input_linear", None)
    sizes = {
        "attention heads": attention.num_heads,
        "key/value heads": kv_heads,
        "MLP hidden units": layer.feed_forward.hidden_dim,
    }
    return {name: size for name, size in sizes.items() if isinstance(size, int)}


def check_devices(model_config: ConfigBase, num_devices: int) -> None:
    """A ConfigError (one line) unless `num_devices` divides every size sharded."""
    sizes = _divisible_sizes(model_config)
    bad = {name: size for name, size in sizes.items() if size % num_devices}
    if bad:
        listed = ", ".join(f"{size} {name}" for name, size in bad.items())
        raise ConfigError(f"--devices={num_devices} does not divide the model's {listed}")


def default_num_devices(model_config: ConfigBase) -> int:
    """Every local device, or the most of them that divide the sizes sharded."""
    sizes = _divisible_sizes(model_config).values()
    count = len(jax.local_devices())
    while any(size % count for size in sizes):
        count -= 1
    return count


# Parameter path suffix -> the axis (counted from the end) that tensor parallelism splits.
# A fused qkv_proj [(L,) D, N + 2K, H] stays whole: split in N + 2K order, a device's part
# would hold some query heads and other key/value heads, and XLA regroups them with
# collectives at every layer. `decoding_config` separates the projections instead.
_SPLIT_AXIS = {
    "q_proj/weight": -2,
    "k_proj/weight": -2,
    "v_proj/weight": -2,
    "q_proj/bias": -2,  # [(L,) N, H] (Qwen's q/k/v biases).
    "k_proj/bias": -2,
    "v_proj/bias": -2,
    "o_proj/weight": -2,  # [(L,) D, N, H].
    "linear2/weight": -2,  # [(L,) F, D].
    "lm_head/weight": -1,  # [D, V].
}


def _split_axis(path: str) -> Optional[int]:
    if "/feed_forward/linear1" in path and path.endswith("/weight"):
        return -1  # [(L,) D, F].
    for suffix, axis in _SPLIT_AXIS.items():
        if path.endswith(suffix):
            return axis
    return None


def tensor_parallel_shardings(param_specs: Any, mesh: Mesh) -> Any:
    """NamedShardings of a Llama's parameters (a tree of specs or arrays) over `mesh`'s
    model axis: separate q/k/v and output projections by head, the MLP by hidden unit, the
    LM head by vocabulary entry where the axis divides; the rest replicated."""
    size = mesh.shape[MODEL_AXIS]

    def sharding(path: str, spec: Any) -> NamedSharding:
        shape = tuple(spec.shape)
        axis = _split_axis(path)
        entries = [None] * len(shape)
        if axis is not None and size > 1 and shape[axis] % size == 0:
            entries[axis] = MODEL_AXIS
        return NamedSharding(mesh, PartitionSpec(*entries))

    flat = flatten_with_paths(param_specs, is_leaf=lambda x: hasattr(x, "shape"))
    treedef = jax.tree_util.tree_structure(param_specs, is_leaf=lambda x: hasattr(x, "shape"))
    return jax.tree_util.tree_unflatten(treedef, [sharding(path, spec) for path, spec in flat])


# The fused projection's parameters, which `decoding_config` splits into q/k/v_proj's.
_FUSED_QKV_PARAMS = ("/qkv_proj/weight", "/qkv_proj/bias")


def _fused_qkv_parent(model_config: ConfigBase) -> Optional[ConfigBase]:
    """The config whose `input_linear` is the model's FusedGroupedQKVLinear, if any."""
    layer = getattr(model_config.decoder.transformer, "layer", None)
    attention = getattr(getattr(layer, "self_attention", None), "attention", None)
    parent = getattr(attention, "input_linear", None)
    while parent is not None and not isinstance(
        getattr(parent, "input_linear", None), FusedGroupedQKVLinear.Config
    ):
        parent = getattr(parent, "input_linear", None)
    return parent


def decoding_config(model_config: ConfigBase, *, num_devices: int) -> ConfigBase:
    """`model_config` as decoded over `num_devices` devices: on several, a fused grouped
    q/k/v projection replaced by three separate ones (the same weights, split), so that
    tensor parallelism splits each by head; on one, fused (one matmul, not three)."""
    cfg = model_config.clone()
    parent = _fused_qkv_parent(cfg)
    if parent is not None and num_devices > 1:
        fused = parent.input_linear
        parent.input_linear = GroupedQKVLinear.default_config().set(
            num_kv_heads=fused.num_kv_heads, layer=fused.layer.clone(),
            cache_dtype=fused.cache_dtype,
        )
    return cfg


def _qkv_sizes(model_config: ConfigBase) -> tuple[int, int]:
    _, dims = hf_models.model_dims(model_config)
    return dims.num_heads, dims.num_kv_heads


def unfuse_qkv(params: Any, model_config: ConfigBase, decoding: ConfigBase) -> Any:
    """Parameters of `model_config` as those of `decoding` (its `decoding_config`)."""
    if _fused_qkv_parent(model_config) is None or _fused_qkv_parent(decoding) is not None:
        return params
    n, k = _qkv_sizes(model_config)

    def walk(tree: Any) -> Any:
        if not isinstance(tree, dict):
            return tree
        out = {}
        for key, value in tree.items():
            if key == "qkv_proj":  # Its weight [..., D, N + 2K, H], bias [..., N + 2K, H].
                for name, part in (("q_proj", slice(0, n)), ("k_proj", slice(n, n + k)),
                                   ("v_proj", slice(n + k, None))):
                    out[name] = {
                        param: array[..., part, :] for param, array in value.items()
                    }
            else:
                out[key] = walk(value)
        return out

    return walk(params)


class _AxisSlice(hf_checkpoint.TensorView):
    """Entries [start, start + size) of `view` along `axis`, read lazily."""

    def __init__(self, view: hf_checkpoint.TensorView, axis: int, start: int, size: int):
        self._view, self._axis, self._start = view, axis, start
        shape = list(view.shape)
        shape[axis] = size
        self.shape = tuple(shape)

    def read(self, index=()) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(tuple(index)))
        index = [slice(*item.indices(size)[:2]) for item, size in zip(index, self.shape)]
        axis = index[self._axis]
        index[self._axis] = slice(axis.start + self._start, axis.stop + self._start)
        return self._view.read(tuple(index))


def _load_hf_for_decoding(
    directory: str, fused: ConfigBase, model: ConfigBase, param_specs: Any, shardings: Any
) -> Any:
    """The parameters of `model` (`fused`'s `decoding_config`) from the Hugging Face
    directory, each device reading its own shard of each weight."""
    reader = hf_checkpoint.SafetensorsReader(directory)
    views = hf_models.param_views(reader, fused)
    is_view = lambda x: isinstance(x, hf_checkpoint.TensorView)  # noqa: E731
    flat_views = {}
    n, k = _qkv_sizes(fused)
    for path, view in flatten_with_paths(views, is_leaf=is_view):
        fused_param = next((p for p in _FUSED_QKV_PARAMS if path.endswith(p)), None)
        if fused_param is not None and _fused_qkv_parent(model) is None:
            base, param = path[: -len(fused_param)], fused_param.rsplit("/", 1)[1]
            for name, start, size in zip(("q_proj", "k_proj", "v_proj"), (0, n, n + k), (n, k, k)):
                flat_views[f"{base}/{name}/{param}"] = _AxisSlice(
                    view, len(view.shape) - 2, start, size
                )
        else:
            flat_views[path] = view
    is_spec = lambda x: hasattr(x, "shape")  # noqa: E731
    flat_specs = flatten_with_paths(param_specs, is_leaf=is_spec)
    missing = sorted(set(path for path, _ in flat_specs) - set(flat_views))
    if missing:
        raise ValueError(f"{directory}: parameters without a Hugging Face tensor: {missing}")
    flat_shardings = jax.tree.leaves(shardings, is_leaf=lambda x: hasattr(x, "device_set"))
    arrays = []
    for (path, spec), sharding in zip(flat_specs, flat_shardings):
        view, dtype = flat_views[path], np.dtype(spec.dtype)
        if tuple(view.shape) != tuple(spec.shape):
            raise ValueError(
                f"{directory}: parameter {path} has shape {tuple(spec.shape)}, the checkpoint "
                f"gives {tuple(view.shape)}"
            )
        arrays.append(jax.make_array_from_callback(
            tuple(spec.shape), sharding,
            lambda index, view=view, dtype=dtype: view.read(index).astype(dtype),
        ))
    treedef = jax.tree_util.tree_structure(param_specs, is_leaf=is_spec)
    return jax.tree_util.tree_unflatten(treedef, arrays)


# ----- decoding -----


class Generator:
    """A model, its parameters and EOS ids, generating from token-id prompts.

    With a `mesh`, the parameters are expected placed over it (`tensor_parallel_shardings`)
    and the KV cache is sharded over its key/value heads to match.
    """

    def __init__(self, model_config: ConfigBase, params: Any, *, mesh: Optional[Mesh] = None):
        self.model_config = model_config
        self.model = model_config.clone(name="model").instantiate(parent=None)
        self.params = params
        self.mesh = mesh
        self.eos_ids = token_id_list(model_config.decoder.eos_token_id)
        self._programs: dict[tuple, Any] = {}

    def set_eos_ids(self, eos_ids: Sequence[int]) -> None:
        """Stops generation at any of `eos_ids` instead of the model's EOS ids."""
        self.eos_ids = list(eos_ids)
        self.model_config.decoder.eos_token_id = list(eos_ids)
        self.model = self.model_config.clone(name="model").instantiate(parent=None)
        self._programs.clear()

    @property
    def _fill_id(self) -> int:
        """The id emitted after a row's end (what `Decoder.fill_token_id` says)."""
        return self.model.decoder.fill_token_id

    def _decoder_call(self, params: Any, method: str, **inputs) -> Any:
        out, _ = functional(
            self.model.decoder,
            state=params["decoder"],
            inputs=inputs,
            prng_key=None,
            is_training=False,
            method=method,
        )
        return out

    def _shard_cache(self, cache: Any) -> Any:
        """Each [..., B, S, K, H] cache leaf split over K on the mesh's model axis."""
        if self.mesh is None or self.mesh.shape[MODEL_AXIS] == 1:
            return cache

        def constrain(x):
            spec = PartitionSpec(*([None] * (x.ndim - 2)), MODEL_AXIS, None)
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

        return jax.tree.map(constrain, cache)

    def _choose_fn(self, sampling: Sampling) -> Callable:
        if sampling.temperature == 0:
            return greedy_choice
        return sampling_choice(
            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p
        )

    def _prefill_fn(self, max_len: int, sampling: Sampling) -> Callable:
        """(params, prompt_ids [B, P], prompt_lengths [B], prng_key) -> decoding state:
        the cache holding the prompts and the first chosen token of each row."""
        choose = self._choose_fn(sampling)

        def prefill(params, prompt_ids, prompt_lengths, seed_and_offset):
            # The key is made here, not on the host: eager PRNG ops would each compile a
            # program of their own before the first token.
            prng_key = jax.random.fold_in(
                jax.random.PRNGKey(seed_and_offset[0]), seed_and_offset[1]
            )
            batch_size = prompt_ids.shape[0]
            cache = self._decoder_call(
                params, "init_states", batch_size=batch_size, max_len=max_len
            )
            # Pad slots beyond a short prompt are written too, but each is overwritten
            # before any query may attend to it.
            cache, outputs = self._decoder_call(
                params,
                "extend_step",
                cached_states=self._shard_cache(cache),
                input_ids=prompt_ids,
                time_step=jnp.zeros([batch_size], jnp.int32),
            )
            last = jnp.maximum(prompt_lengths - 1, 0)[:, None, None]
            logits = jnp.take_along_axis(outputs["logits"], last, axis=1)[:, 0]
            prng_key, choose_key = jax.random.split(prng_key)
            return dict(
                cache=self._shard_cache(cache),
                token=choose(logits.astype(jnp.float32), choose_key),
                time_step=prompt_lengths.astype(jnp.int32),
                done=prompt_lengths >= max_len,
                prng_key=prng_key,
            )

        return prefill

    def _chunk_fn(self, max_len: int, steps: int, sampling: Sampling) -> Callable:
        """(params, state) -> (state after `steps` tokens, tokens [B, steps], all done):
        each step writes the state's token (the last one emitted) into the cache at its
        position and emits the next one chosen from its logits (the fill id once a row
        has ended: at an EOS id or at max_len)."""
        choose = self._choose_fn(sampling)
        eos_ids = np.asarray(self.eos_ids, np.int32)  # A constant of the program.
        fill_id = self._fill_id

        def ended(state):
            token, time_step = state["token"], state["time_step"]
            is_eos = jnp.any(token[:, None] == eos_ids, axis=-1)
            return state["done"] | is_eos | (time_step + 1 >= max_len)

        greedy = sampling.temperature == 0
        quantized = self.quantized

        def step(params, state):
            if quantized:
                # Ties the int8 weights to the step, so that XLA converts them inside each
                # step's matmuls instead of once, to bf16 copies, before the loop.
                params, token = jax.lax.optimization_barrier((params, state["token"]))
                state = dict(state, token=token)
            done = ended(state)
            time_step = state["time_step"]
            # Finished rows re-write a slot at or past their end, which nothing reads.
            cache, outputs = self._decoder_call(
                params,
                "extend_step",
                cached_states=state["cache"],
                input_ids=state["token"][:, None],
                time_step=jnp.minimum(time_step, max_len - 1),
            )
            prng_key, choose_key = state["prng_key"], None
            if not greedy:  # Greedy choice needs no key: no PRNG kernels a token.
                prng_key, choose_key = jax.random.split(prng_key)
            token = choose(outputs["logits"][:, 0].astype(jnp.float32), choose_key)
            token = jnp.where(done, fill_id, token)
            state = dict(
                cache=self._shard_cache(cache),
                token=token,
                time_step=jnp.where(done, time_step, time_step + 1),
                done=done,
                prng_key=prng_key,
            )
            return state, token

        def chunk(params, state):
            state, tokens = jax.lax.scan(lambda s, _: step(params, s), state, None, length=steps)
            return state, tokens.T, jnp.all(ended(state))

        return chunk

    def _programs_for(
        self, batch_size: int, prompt_len: int, max_len: int, steps: int, sampling: Sampling
    ) -> tuple[Any, Any, float]:
        """(prefill, chunk) jitted for these shapes, compiled and run once on the first
        call, their tokens read back as a run reads them (the first execution sets up CUDA
        graphs and workspaces, the first reads their transfers: compile cost, not decoding
        speed), and the seconds that took."""
        key = (batch_size, prompt_len, max_len, steps, dataclasses.astuple(sampling)[:3])
        if key in self._programs:
            return (*self._programs[key], 0.0)
        start = time.perf_counter()
        prefill = jax.jit(self._prefill_fn(max_len, sampling))
        chunk = jax.jit(self._chunk_fn(max_len, steps, sampling), donate_argnums=(1,))
        state = prefill(
            self.params,
            *self._host_inputs(
                np.ones((batch_size, prompt_len), np.int32), np.ones((batch_size,), np.int32),
                seed=0, offset=0,
            ),
        )
        np.asarray(state["token"])
        if max_len > prompt_len + 1:  # Else no chunk follows the prefill.
            state, tokens, all_done = chunk(self.params, state)
            np.asarray(tokens), bool(all_done)
        jax.block_until_ready(state)
        self._programs[key] = (prefill, chunk)
        return prefill, chunk, time.perf_counter() - start

    @staticmethod
    def _host_inputs(ids: np.ndarray, lengths: np.ndarray, *, seed: int, offset: int) -> tuple:
        """The prefill's host inputs as device arrays: plain transfers (jnp.asarray of a
        NumPy array would run, and on first use compile, a conversion program each)."""
        seed_and_offset = np.asarray([seed, offset]).astype(np.int32)
        return tuple(jax.device_put(x) for x in (ids, lengths, seed_and_offset))

    @property
    def quantized(self) -> bool:
        """Whether the parameters hold int8 weights (`quantize_for_decoding`)."""
        return any(
            isinstance(x, QuantizedWeight)
            for x in jax.tree.leaves(self.params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        sampling: Optional[Sampling] = None,
        batch_size: int = 8,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        on_tokens: Optional[Callable[[int, list[int]], None]] = None,
    ) -> tuple[list[list[int]], GenerationStats]:
        """The generated ids of each prompt (up to and including an EOS id, at most
        `max_new_tokens`) and the stats of the run. `sampling` None: greedy.

        `on_tokens(prompt_index, ids)`, if given, is called with each prompt's new ids as
        each chunk of `chunk_size` tokens arrives (the first token alone, after prefill).
        """
        sampling = sampling or Sampling()
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("Every prompt needs at least one token")
        stats = GenerationStats(prompts=len(prompts), batch_rows=batch_size)
        outputs: list[list[int]] = []
        # The first token comes from prefill; the rest from chunks of equal size.
        num_chunks = math.ceil((max_new_tokens - 1) / chunk_size)
        steps = math.ceil((max_new_tokens - 1) / num_chunks) if num_chunks else 0
        for start in range(0, len(prompts), batch_size):
            batch = [list(p) for p in prompts[start : start + batch_size]]
            longest = max(len(p) for p in batch)
            prompt_len = -(-longest // PROMPT_LENGTH_MULTIPLE) * PROMPT_LENGTH_MULTIPLE
            max_len = prompt_len + 1 + num_chunks * steps
            ids = np.zeros((batch_size, prompt_len), np.int32)
            lengths = np.ones((batch_size,), np.int32)  # Rows past the prompts: 1 token.
            for i, prompt in enumerate(batch):
                ids[i, : len(prompt)] = prompt
                lengths[i] = len(prompt)
            prefill, chunk, compile_seconds = self._programs_for(
                batch_size, prompt_len, max_len, steps, sampling
            )
            stats.compile_seconds += compile_seconds
            new = [[] for _ in batch]
            ended = [False] * len(batch)

            def take(tokens: np.ndarray) -> None:
                for i, prompt in enumerate(batch):
                    room = max_new_tokens - len(new[i])
                    if ended[i] or room <= 0:
                        continue
                    row = tokens[i, :room].tolist()
                    for j, token in enumerate(row):
                        if token in self.eos_ids:
                            row, ended[i] = row[: j + 1], True
                            break
                    new[i] += row
                    if row and on_tokens is not None:
                        on_tokens(start + i, row)

            began = time.perf_counter()
            inputs = self._host_inputs(ids, lengths, seed=sampling.seed, offset=start)
            state = prefill(self.params, *inputs)
            first = np.asarray(state["token"])[:, None]
            stats.prefill_seconds += time.perf_counter() - began
            take(first)
            pending = None
            for _ in range(num_chunks):
                if all(ended[i] or len(new[i]) >= max_new_tokens for i in range(len(batch))):
                    break
                state, tokens, all_done = chunk(self.params, state)
                # The next chunk is queued before this one's tokens are read.
                if pending is not None:
                    previous, previous_done = pending
                    take(np.asarray(previous))
                    if bool(previous_done):
                        pending = None
                        break
                pending = (tokens, all_done)
            if pending is not None:
                take(np.asarray(pending[0]))
            jax.block_until_ready(state)
            stats.decode_seconds += time.perf_counter() - began
            stats.batches += 1
            for i in range(len(batch)):
                outputs.append(new[i])
                stats.new_tokens += len(new[i])
                stats.new_tokens_after_first += max(len(new[i]) - 1, 0)
        return outputs, stats


# ----- loading -----

# The --quantize values decoding takes (an int6 artifact decodes dequantized).
DECODING_QUANTIZATIONS = ("int8",)


def check_quantize(quantize: Optional[str]) -> None:
    """A ConfigError (one line) for a --quantize value decoding does not take."""
    if quantize and quantize not in DECODING_QUANTIZATIONS:
        raise ConfigError(
            f"--quantize={quantize!r} is not supported for decoding: choose "
            f"{' or '.join(DECODING_QUANTIZATIONS)} (an int6 --artifact decodes dequantized "
            "without --quantize)"
        )


@functools.lru_cache(maxsize=None)
def _quantizer(axes: tuple[int, ...]) -> Callable:
    return jax.jit(lambda w: quantization.jax_quantize(w, 8, axes))


def quantize_for_decoding(params: Any, dtype: Any) -> Any:
    """`params` with each weight that artifacts quantize (`quantization.is_quantized`) as
    a `QuantizedWeight`: int8 values and per-row scales, quantized on its device."""
    flat = flatten_with_paths(params)
    leaves = []
    for path, x in flat:
        if quantization.is_quantized(path, x.shape, x.dtype):
            values, scale = _quantizer(quantization.contracted_axes(path, x.ndim))(x)
            x = QuantizedWeight.rows_last_layout(values, scale.astype(jnp.float32), dtype)
        leaves.append(x)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), leaves)


def _check_quantized_devices(mesh: Mesh) -> None:
    if mesh.size > 1:
        raise ConfigError(
            f"--quantize=int8 decodes on one device; pass --devices=1 (got {mesh.size})"
        )


def _decode_dtype(name: str) -> Optional[jnp.dtype]:
    """The dtype to decode in: 'auto' is bfloat16 on accelerators, float32 on a CPU."""
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def _mesh_for(model_config: ConfigBase, devices: Optional[int]) -> tuple[Mesh, ConfigBase]:
    """The mesh of `devices` devices (None: the default) and the model as decoded on it."""
    num_devices = default_num_devices(model_config) if devices is None else devices
    mesh = make_mesh(num_devices)
    check_devices(model_config, num_devices)
    return mesh, decoding_config(model_config, num_devices=num_devices)


def _generator(model: ConfigBase, params: Any, mesh: Mesh, quantize: Optional[str]) -> Generator:
    if quantize:
        _check_quantized_devices(mesh)
        params = quantize_for_decoding(params, model.dtype)
    return Generator(model, params, mesh=mesh)


def from_trainer_dir(
    directory: str, *, step: Optional[int] = None, dtype: str = "auto",
    devices: Optional[int] = None, quantize: Optional[str] = None,
) -> tuple[Generator, Optional[str]]:
    """(a Generator of the run's model at `step` over `devices` devices (None: the
    default), the tokenizer recorded with its data). The checkpoint is restored to host
    memory and then placed in its shards; `quantize='int8'` decodes with int8 weights."""
    check_quantize(quantize)
    cfg = trainer_dir.read_trainer_config(directory)
    decode_dtype = _decode_dtype(dtype)
    lm_config = language_model_config(cfg.model)  # A DPO run's policy.
    model_cfg, lora_model = lm_config, None
    if lora.lora_layer_configs(model_cfg):  # A LoRA run decodes with its adapters merged.
        lora_model = model_cfg.clone(name="model").instantiate(parent=None)
        model_cfg = lora.base_model_config(model_cfg)
    mesh, model = _mesh_for(model_cfg.clone(dtype=decode_dtype), devices)
    _, _, params = trainer_dir.restore_language_model(directory, step=step)
    if lora_model is not None:
        params = lora.merged_params(lora_model, params)
    params = cast_floats(unfuse_qkv(params, model_cfg, model), decode_dtype)
    params = jax.device_put(params, tensor_parallel_shardings(params, mesh))
    return _generator(model, params, mesh, quantize), trainer_dir.recorded_tokenizer(cfg)


def from_artifact(
    path: str, *, dtype: str = "auto", devices: Optional[int] = None,
    quantize: Optional[str] = None,
) -> tuple[Generator, Optional[str]]:
    """(a Generator of a quantized artifact's model (`axlearn.common.quantize`), the
    tokenizer it records). With `quantize='int8'` an int8 artifact's own values and scales
    are decoded; otherwise its weights are dequantized to the decoding dtype."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common.quantize import ArtifactError, model_config_of, read_artifact
    from axlearn.common.utils import unflatten_paths  # pylint: disable=import-outside-toplevel

    check_quantize(quantize)
    try:
        header, entries = read_artifact(path)
    except ArtifactError as e:
        raise ConfigError(str(e)) from e
    fused = model_config_of(header, source=path)
    decode_dtype = _decode_dtype(dtype)
    mesh, model = _mesh_for(fused.clone(dtype=decode_dtype), devices)
    specs = fused.clone(name="model").instantiate(parent=None).create_parameter_specs_recursively()
    from axlearn.common.quantize import check_matches, dequantized_params  # pylint: disable=C0415

    check_matches(entries, specs, source=path)
    tokenizer = header.get("meta", {}).get("tokenizer")
    if quantize and header["quantize"] == "int8":
        _check_quantized_devices(mesh)
        flat = {}
        for name, entry in entries.items():
            if entry["encoding"] == "raw":
                flat[name] = jnp.asarray(entry["array"], decode_dtype)
            else:
                flat[name] = QuantizedWeight.rows_last_layout(
                    jax.device_put(entry["values"]),
                    jax.device_put(entry["scale"].astype(np.float32)), decode_dtype,
                )
        return Generator(model, unflatten_paths(flat), mesh=mesh), tokenizer
    params = cast_floats(unfuse_qkv(dequantized_params(entries), fused, model), decode_dtype)
    params = jax.device_put(params, tensor_parallel_shardings(params, mesh))
    return _generator(model, params, mesh, quantize), tokenizer


def from_hf_dir(
    directory: str, *, dtype: str = "auto", devices: Optional[int] = None,
    quantize: Optional[str] = None,
) -> tuple[Generator, Optional[str]]:
    """(a Generator of the Hugging Face model in `directory` over `devices` devices
    (None: the default), its tokenizer file). Each device reads its own shard of each
    weight from the safetensors files; `quantize='int8'` decodes with int8 weights."""
    check_quantize(quantize)
    # Layers unrolled (not a scan over stacked weights): each decoding step then reads
    # every weight matrix in place, with no per-layer slice of the stack.
    model = hf_models.model_config_from_hf(
        hf_checkpoint.read_config(directory),
        generation_config=hf_checkpoint.read_generation_config(directory),
        repeated=False,
    )
    model.dtype = _decode_dtype(dtype)
    fused = model
    mesh, model = _mesh_for(fused, devices)
    specs = model.clone(name="model").instantiate(parent=None).create_parameter_specs_recursively()
    params = _load_hf_for_decoding(
        directory, fused, model, specs, tensor_parallel_shardings(specs, mesh)
    )
    files = hf_checkpoint.tokenizer_files_in(directory)
    tokenizer = next(
        (path for name in ("tokenizer.json", "tokenizer.model") for path in files
         if path.endswith(name)),
        None,
    )
    return _generator(model, params, mesh, quantize), tokenizer


# ----- text -----


def load_tokenizer(path: Optional[str]) -> Vocabulary:
    """The vocabulary of a tokenizer file (or 'bytes'); an error saying what to pass
    where there is none."""
    if path is None:
        raise ConfigError(
            "No tokenizer is recorded with this model: pass --tokenizer=PATH (a tokenizer.json, "
            "a SentencePiece .model, or bytes)"
        )
    if path == BYTES_VOCAB_NAME:
        return ByteVocabulary()
    try:
        return load_vocabulary(path, any_special_ids=True)
    except VocabularyError as e:
        raise ConfigError(f"--tokenizer={path}: {e}") from e


def encode_prompts(vocab: Vocabulary, texts: Sequence[str], *, add_bos: bool) -> list[list[int]]:
    """Token ids of each prompt, after the vocabulary's bos id if `add_bos` and it has one."""
    prefix = [vocab.bos_id] if add_bos and vocab.bos_id != NO_ID else []
    return [prefix + list(vocab.encode(text)) for text in texts]


def decode_completion(
    vocab: Vocabulary, prompt: Sequence[int], new: Sequence[int], eos_ids: Sequence[int]
) -> str:
    """The text of a prompt and the ids generated after it, without the bos that starts
    it and the EOS id that ended them (decoded together: a piece's leading space shows
    only in context)."""
    ids = list(prompt) + list(new)
    if ids and ids[0] == vocab.bos_id:
        ids = ids[1:]
    if new and ids[-1] in eos_ids:
        ids = ids[:-1]
    return vocab.decode(ids)


class TextStream:
    """Prints a completion as its ids arrive: the text decoded so far, less what was
    printed, holding back an unfinished character (a replacement character at the end)."""

    def __init__(self, vocab: Vocabulary, prompt: Sequence[int], eos_ids: Sequence[int], out):
        self._vocab, self._prompt, self._eos_ids, self._out = vocab, list(prompt), eos_ids, out
        self._new: list[int] = []
        self._printed = ""

    def add(self, ids: Sequence[int]) -> None:
        """Takes the next generated ids and prints the text they complete."""
        self._new += list(ids)
        text = decode_completion(self._vocab, self._prompt, self._new, self._eos_ids)
        self._write(text.rstrip("\ufffd"))

    def finish(self) -> None:
        """Prints the rest of the completion and ends its line."""
        self._write(decode_completion(self._vocab, self._prompt, self._new, self._eos_ids))
        self._out.write("\n")
        self._out.flush()

    def _write(self, text: str) -> None:
        if text.startswith(self._printed) and len(text) > len(self._printed):
            self._out.write(text[len(self._printed) :])
            self._out.flush()
            self._printed = text


# ----- the command -----

PROGRAM = "axlearn.common.generate"


def define_flags(flag_values: flags.FlagValues) -> None:
    """The command's flags."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_string(
        "trainer_dir", None, "A run's directory: its latest (or --step) model.", **fv
    )
    flags.DEFINE_string(
        "hf_dir", None, "A local Hugging Face directory (Llama, Qwen2, Qwen3, Qwen3-MoE, "
        "Mistral).", **fv
    )
    flags.DEFINE_string(
        "artifact", None, "A quantized artifact (python -m axlearn.common.quantize export).",
        **fv,
    )
    flags.DEFINE_string(
        "quantize", None, "int8: decode with int8 weights (per-row scales), dequantized "
        "inside the matmuls; on one device.", **fv
    )
    flags.DEFINE_integer(
        "step", None, "The checkpoint step of --trainer_dir (default: latest).", **fv
    )
    flags.DEFINE_multi_string("prompt", [], "A prompt (repeatable).", **fv)
    flags.DEFINE_string("prompt_file", None, "A file of prompts, one a line.", **fv)
    flags.DEFINE_string("tokenizer", None, "A tokenizer.json, SentencePiece .model or bytes.", **fv)
    flags.DEFINE_bool("no_bos", False, "Do not start prompts with bos.", **fv)
    flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most per prompt.", **fv)
    flags.DEFINE_float("temperature", 0.0, "0: greedy.", **fv)
    flags.DEFINE_integer("top_k", None, "Sample among the k most likely tokens.", **fv)
    flags.DEFINE_float("top_p", None, "Sample among the most likely tokens of this mass.", **fv)
    flags.DEFINE_integer("seed", 0, "Sampling seed.", **fv)
    flags.DEFINE_integer("batch_size", 8, "Prompts decoded together.", **fv)
    flags.DEFINE_multi_integer(
        "eos_id", [], "Stop at this id (repeatable); default: the model's EOS ids.", **fv
    )
    flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16"],
                      "auto: bfloat16 on accelerators, float32 on a CPU.", **fv)
    flags.DEFINE_integer(
        "devices", None, "Devices to shard the model over (tensor parallel); default: every "
        "local device, or the most that divide the model's heads and MLP units.", **fv
    )
    flags.DEFINE_integer(
        "chunk_size", DEFAULT_CHUNK_SIZE, "Tokens decoded per jitted call (and per streamed "
        "piece of text).", **fv
    )
    flags.DEFINE_string(
        "jax_compilation_cache_dir", None, "Where the command keeps its compiled programs "
        "for its next run with the same shapes, as the launcher's flag (local, gs://, "
        "s3://; default: $JAX_COMPILATION_CACHE_DIR, else ~/.cache/axlearn/jax; none: off).",
        **fv,
    )
    flags.DEFINE_bool(
        "stream", None, "Print tokens as they are produced (default: at batch size 1 with "
        "one prompt).", **fv
    )


def parse_flags(argv: Optional[Sequence[str]]) -> flags.FlagValues:
    """Flags of the command line `argv` (without the program name; None: sys.argv's) in
    a FlagValues of their own, checked: `--help` exits 0, a wrong flag is a usage error
    (exit 2), a wrong combination a ConfigError."""
    flag_values, _ = parse_command_flags(
        define_flags, argv, program=PROGRAM, doc=__doc__, reads_config_text=True
    )
    check_flags(flag_values)
    return flag_values


def check_flags(fv: flags.FlagValues) -> None:
    """A ConfigError (one line) for flags that contradict each other."""
    if sum(bool(x) for x in (fv.trainer_dir, fv.hf_dir, fv.artifact)) != 1:
        raise ConfigError("Pass exactly one of --trainer_dir, --hf_dir and --artifact")
    check_quantize(fv.quantize)
    if fv.step is not None and not fv.trainer_dir:
        raise ConfigError("--step applies to --trainer_dir")
    if fv.temperature < 0:
        raise ConfigError("--temperature must be >= 0")
    if fv.batch_size < 1:
        raise ConfigError(f"--batch_size must be >= 1, got {fv.batch_size}")


def _read_prompts(fv: flags.FlagValues) -> list[str]:
    prompts = list(fv.prompt or [])
    if fv.prompt_file:
        with open(fv.prompt_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ConfigError("No prompt: pass --prompt=TEXT (repeatable) or --prompt_file=FILE")
    return prompts


def run(fv: flags.FlagValues, out=None, err=None) -> GenerationStats:
    """The command: loads the model, generates, prints completions (streamed if asked) to
    `out` (stdout: the text alone, for a pipe), and the time to the first token and
    tokens/s to `err` (stderr)."""
    out = out or sys.stdout
    err = err or sys.stderr
    prompts = _read_prompts(fv)
    load = dict(dtype=fv.dtype, devices=fv.devices, quantize=fv.quantize)
    if fv.trainer_dir:
        generator, tokenizer = from_trainer_dir(fv.trainer_dir, step=fv.step, **load)
    elif fv.artifact:
        generator, tokenizer = from_artifact(fv.artifact, **load)
    else:
        generator, tokenizer = from_hf_dir(fv.hf_dir, **load)
    if fv.eos_id:
        generator.set_eos_ids(fv.eos_id)
    vocab = load_tokenizer(fv.tokenizer or tokenizer)
    ids = encode_prompts(vocab, prompts, add_bos=not fv.no_bos)
    sampling = Sampling(temperature=fv.temperature, top_k=fv.top_k, top_p=fv.top_p, seed=fv.seed)
    stream = fv.stream if fv.stream is not None else (fv.batch_size == 1 and len(ids) == 1)
    streams: dict[int, TextStream] = {}

    def on_tokens(index: int, new: list[int]) -> None:
        if index not in streams:
            if streams:  # Batch size 1: the previous prompt is complete.
                streams.pop(max(streams)).finish()
                out.write("\n")
            streams[index] = TextStream(vocab, ids[index], generator.eos_ids, out)
        streams[index].add(new)

    outputs, stats = generator.generate(
        ids, max_new_tokens=fv.max_new_tokens, sampling=sampling, batch_size=fv.batch_size,
        chunk_size=fv.chunk_size, on_tokens=on_tokens if stream else None,
    )
    if stream:
        for index in sorted(streams):
            streams[index].finish()
            out.write("\n")
    else:
        for prompt_ids, new in zip(ids, outputs):
            out.write(decode_completion(vocab, prompt_ids, new, generator.eos_ids) + "\n\n")
    out.flush()
    devices = 1 if generator.mesh is None else generator.mesh.size
    out.flush()
    err.write(
        f"{stats.new_tokens} tokens generated in {stats.decode_seconds:.2f} s: "
        f"{stats.tokens_per_second:,.1f} tokens/s ({stats.rows_text()}; {devices} device(s); "
        f"first token after {stats.first_token_seconds * 1000:,.1f} ms, then "
        f"{stats.decode_tokens_per_second:,.1f} tokens/s; compile and warm-up "
        f"{stats.compile_seconds:.1f} s apart)\n"
    )
    err.flush()
    return stats


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command line `argv` (None: sys.argv's) run; errors a user can cause are one
    line and a non-zero exit."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # Its backend probes.
    # Donation is what lets a chunk update the cache in place; a CPU ignores it.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    try:
        fv = parse_flags(argv)
        compilation_cache.configure(fv.jax_compilation_cache_dir)
        run(fv)
    except (ConfigError, ValueError, KeyError) as e:
        raise SystemExit(f"generate: {e}") from e


if __name__ == "__main__":
    main()
