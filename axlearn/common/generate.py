"""Generates text with a trained model: from a trainer directory or a Hugging Face Llama
directory, through the decoder's KV-cache loop (`decoder.DecodingLayer`).

    python -m axlearn.common.generate --trainer_dir=T [--step=N] --prompt="Once upon a time"
    python -m axlearn.common.generate --hf_dir=D --prompt_file=prompts.txt --max_new_tokens=128 \\
        [--temperature=0.8 --top_k=50 --top_p=0.95] [--batch_size=8]

Prompts (`--prompt`, repeatable, or `--prompt_file`, one a line) are encoded with the
model's tokenizer: a trainer directory's is the one recorded with its data
(`trainer_dir.recorded_tokenizer`), a Hugging Face directory's its tokenizer.json or
tokenizer.model; `--tokenizer` names another (a file, or `bytes`). The vocabulary's bos
id, if it has one, starts each prompt. Prompts run in batches of `--batch_size`, each
batch one jitted call: the prompt prefilled in one step, then a `lax.while_loop` of one
token per step, greedy (`--temperature=0`, the default) or sampled with temperature,
top-k and top-p, until every row reached one of the EOS ids or `--max_new_tokens`.
Prints each completion and the decoding speed in generated tokens per second (compiling
and one warm-up run of each program apart).
"""

import argparse
import dataclasses
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from axlearn.common import hf_checkpoint, hf_llama, trainer_dir
from axlearn.common.base_layer import is_parameter_spec
from axlearn.common.config import ConfigBase, ConfigError
from axlearn.common.decoder import token_id_list
from axlearn.common.input_vocab import (
    BYTES_VOCAB_NAME,
    NO_ID,
    ByteVocabulary,
    Vocabulary,
    VocabularyError,
    load_vocabulary,
)
from axlearn.common.module import functional
from axlearn.common.utils import cast_floats

log = logging.getLogger(__name__)

# Prompt lengths are rounded up to a multiple of this, so that batches of similar
# prompts share one compiled program.
PROMPT_LENGTH_MULTIPLE = 32


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
    decode_seconds: float = 0.0  # Wall time of the jitted calls, compile excluded.
    compile_seconds: float = 0.0  # Compiling and one warm-up run per program.

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.decode_seconds if self.decode_seconds else 0.0


class Generator:
    """A model, its parameters and EOS ids, generating from token-id prompts."""

    def __init__(self, model_config: ConfigBase, params: Any):
        self.model_config = model_config
        self.model = model_config.clone(name="model").instantiate(parent=None)
        self.params = params
        self.eos_ids = token_id_list(model_config.decoder.eos_token_id)
        self._compiled: dict[tuple, Any] = {}

    def _program(self, batch_size: int, prompt_len: int, max_len: int, sampling: Sampling):
        """The jitted decode of [batch_size, prompt_len] prompts to max_len, compiled once
        per shape and sampling setting."""
        key = (batch_size, prompt_len, max_len, dataclasses.astuple(sampling)[:3])
        if key in self._compiled:
            return self._compiled[key], 0.0
        greedy = sampling.temperature == 0

        def run(params, prompt_ids, prompt_lengths, prng_key):
            inputs = dict(prompt_ids=prompt_ids, max_len=max_len, prompt_lengths=prompt_lengths)
            if not greedy:
                inputs.update(
                    prng_key=prng_key,
                    temperature=sampling.temperature,
                    top_k=sampling.top_k,
                    top_p=sampling.top_p,
                )
            out, _ = functional(
                self.model,
                state=params,
                inputs=inputs,
                prng_key=None,
                is_training=False,
                method="greedy_decode" if greedy else "sample_decode",
            )
            sequences, lengths = out["sequences"], out["lengths"]
            if not greedy:  # [B, 1, max_len] -> [B, max_len].
                sequences, lengths = sequences[:, 0], lengths[:, 0]
            return sequences, lengths

        start = time.perf_counter()
        args = (
            self.params,
            jax.ShapeDtypeStruct((batch_size, prompt_len), jnp.int32),
            jax.ShapeDtypeStruct((batch_size,), jnp.int32),
            jax.ShapeDtypeStruct((2,), jnp.uint32),
        )
        compiled = jax.jit(run).lower(*args).compile()
        # One run on dummy prompts: the first execution sets up what the program keeps
        # (CUDA graphs, workspaces), which is compile cost, not decoding speed.
        jax.block_until_ready(
            compiled(
                self.params,
                jnp.ones((batch_size, prompt_len), jnp.int32),
                jnp.ones((batch_size,), jnp.int32),
                jax.random.PRNGKey(0),
            )
        )
        self._compiled[key] = compiled
        return compiled, time.perf_counter() - start

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        sampling: Optional[Sampling] = None,
        batch_size: int = 8,
    ) -> tuple[list[list[int]], GenerationStats]:
        """The generated ids of each prompt (up to and including an EOS id, at most
        `max_new_tokens`) and the stats of the run. `sampling` None: greedy."""
        sampling = sampling or Sampling()
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("Every prompt needs at least one token")
        stats = GenerationStats()
        outputs: list[list[int]] = []
        for start in range(0, len(prompts), batch_size):
            batch = [list(p) for p in prompts[start : start + batch_size]]
            longest = max(len(p) for p in batch)
            prompt_len = -(-longest // PROMPT_LENGTH_MULTIPLE) * PROMPT_LENGTH_MULTIPLE
            max_len = prompt_len + max_new_tokens
            ids = np.zeros((batch_size, prompt_len), np.int32)
            lengths = np.ones((batch_size,), np.int32)  # Rows past the prompts: 1 token.
            for i, prompt in enumerate(batch):
                ids[i, : len(prompt)] = prompt
                lengths[i] = len(prompt)
            program, compile_seconds = self._program(batch_size, prompt_len, max_len, sampling)
            stats.compile_seconds += compile_seconds
            key = jax.random.fold_in(jax.random.PRNGKey(sampling.seed), start)
            began = time.perf_counter()
            sequences, ends = jax.block_until_ready(
                program(self.params, jnp.asarray(ids), jnp.asarray(lengths), key)
            )
            stats.decode_seconds += time.perf_counter() - began
            sequences, ends = np.asarray(sequences), np.asarray(ends)
            for i, prompt in enumerate(batch):
                end = min(int(ends[i]), len(prompt) + max_new_tokens)
                new = sequences[i, len(prompt) : end].tolist()
                for j, token in enumerate(new):
                    if token in self.eos_ids:
                        new = new[: j + 1]
                        break
                outputs.append(new)
                stats.new_tokens += len(new)
        return outputs, stats


def _decode_dtype(name: str) -> Optional[jnp.dtype]:
    """The dtype to decode in: 'auto' is bfloat16 on accelerators, float32 on a CPU."""
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def _on_one_device(specs: Any) -> Any:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: device, specs, is_leaf=is_parameter_spec)


def from_trainer_dir(
    directory: str, *, step: Optional[int] = None, dtype: str = "auto"
) -> tuple[Generator, Optional[str]]:
    """(a Generator of the run's model at `step`, the tokenizer recorded with its data)."""
    cfg = trainer_dir.read_trainer_config(directory)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    _, params = trainer_dir.restore_model_params(
        directory, step=step, model_config=cfg.model, sharding=device
    )
    decode_dtype = _decode_dtype(dtype)
    model = cfg.model.clone(dtype=decode_dtype)
    return Generator(model, cast_floats(params, decode_dtype)), trainer_dir.recorded_tokenizer(cfg)


def from_hf_dir(directory: str, *, dtype: str = "auto") -> tuple[Generator, Optional[str]]:
    """(a Generator of the Hugging Face Llama in `directory`, its tokenizer file)."""
    model = hf_llama.llama_config_from_hf(
        hf_checkpoint.read_config(directory),
        generation_config=hf_checkpoint.read_generation_config(directory),
    )
    model.dtype = _decode_dtype(dtype)
    specs = model.clone(name="model").instantiate(parent=None).create_parameter_specs_recursively()
    weights = hf_llama.HfLlamaWeights.default_config().set(path=directory).instantiate()
    params = weights.load(model_config=model, param_specs=specs, shardings=_on_one_device(specs))
    files = hf_checkpoint.tokenizer_files_in(directory)
    tokenizer = next(
        (path for name in ("tokenizer.json", "tokenizer.model") for path in files
         if path.endswith(name)),
        None,
    )
    return Generator(model, params), tokenizer


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


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ConfigError("No prompt: pass --prompt=TEXT (repeatable) or --prompt_file=FILE")
    return prompts


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m axlearn.common.generate")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trainer_dir", help="A run's directory: its latest (or --step) model.")
    source.add_argument("--hf_dir", help="A local Hugging Face Llama directory.")
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--prompt", action="append", help="A prompt (repeatable).")
    parser.add_argument("--prompt_file", help="A file of prompts, one a line.")
    parser.add_argument("--tokenizer", help="A tokenizer.json, SentencePiece .model or bytes.")
    parser.add_argument("--no_bos", action="store_true", help="Do not start prompts with bos.")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy.")
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--top_p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument(
        "--eos_id", type=int, action="append", help="Stop at this id (repeatable); default: "
        "the model's EOS ids."
    )
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    args = parser.parse_args(argv)
    if args.step is not None and not args.trainer_dir:
        parser.error("--step applies to --trainer_dir")
    if args.temperature < 0:
        parser.error("--temperature must be >= 0")
    return args


def run(args: argparse.Namespace) -> GenerationStats:
    """The command: loads the model, generates, prints completions and tokens/s."""
    prompts = _read_prompts(args)
    if args.trainer_dir:
        generator, tokenizer = from_trainer_dir(args.trainer_dir, step=args.step, dtype=args.dtype)
    else:
        generator, tokenizer = from_hf_dir(args.hf_dir, dtype=args.dtype)
    if args.eos_id:
        generator.eos_ids = list(args.eos_id)
        generator.model_config.decoder.eos_token_id = list(args.eos_id)
        generator.model = generator.model_config.clone(name="model").instantiate(parent=None)
    vocab = load_tokenizer(args.tokenizer or tokenizer)
    ids = encode_prompts(vocab, prompts, add_bos=not args.no_bos)
    sampling = Sampling(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )
    outputs, stats = generator.generate(
        ids, max_new_tokens=args.max_new_tokens, sampling=sampling, batch_size=args.batch_size
    )
    for prompt_ids, new in zip(ids, outputs):
        print(decode_completion(vocab, prompt_ids, new, generator.eos_ids))
        print()
    print(
        f"{stats.new_tokens} tokens generated in {stats.decode_seconds:.2f} s: "
        f"{stats.tokens_per_second:,.1f} tokens/s (batch {args.batch_size}; compile and warm-up "
        f"{stats.compile_seconds:.1f} s apart)"
    )
    return stats


def main(argv: Sequence[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # Its backend probes.
    try:
        run(_parse_args(argv))
    except (ConfigError, ValueError, KeyError) as e:
        raise SystemExit(f"generate: {e}") from e


if __name__ == "__main__":
    main(sys.argv[1:])
