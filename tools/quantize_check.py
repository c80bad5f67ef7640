r"""int8 decoding against the same model's bf16 decoding: how far greedy text agrees, and
the largest logit error.

    PYTHONPATH=$PWD python tools/quantize_check.py --trainer_dir=T --prompt="def " \
        --prompt="import " --new_tokens=64 [--tokenizer=bytes]      # or --hf_dir=D

Loads the model twice with `generate`'s loaders (one device, --dtype, bf16 by default):
as it is, and with `--quantize=int8` weights. Each prompt is decoded greedily by both;
prints one JSON line per prompt with
- agree_tokens: the tokens both produce before they first differ (of new_tokens),
- teacher_forced_agreement: the share of positions of bf16's text (prompt and
  continuation) where the two models' top tokens are the same,
- max_logit_error: the largest |logit difference| over those positions (and the
  largest bf16 logit magnitude beside it, for scale),
then one line of the totals.
"""

import json
from collections.abc import Sequence
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from axlearn.common import generate
from axlearn.common.command_flags import parse_command_flags
from axlearn.common.config import ConfigError


def define_flags(flag_values: flags.FlagValues) -> None:
    """The check's flags."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_string("trainer_dir", None, "A run's directory.", **fv)
    flags.DEFINE_string("hf_dir", None, "A Hugging Face Llama directory.", **fv)
    flags.DEFINE_multi_string("prompt", ["The "], "A prompt (repeatable).", **fv)
    flags.DEFINE_string("tokenizer", None, "Tokenizer (default: the model's).", **fv)
    flags.DEFINE_integer("new_tokens", 64, "Greedy tokens per prompt.", **fv)
    flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "Decoding dtype.", **fv)


def _load(fv: flags.FlagValues, quantize: Optional[str]):
    if bool(fv.trainer_dir) == bool(fv.hf_dir):
        raise ConfigError("Pass exactly one of --trainer_dir and --hf_dir")
    kwargs = dict(dtype=fv.dtype, devices=1, quantize=quantize)
    if fv.trainer_dir:
        return generate.from_trainer_dir(fv.trainer_dir, **kwargs)
    return generate.from_hf_dir(fv.hf_dir, **kwargs)


def _logits(generator: generate.Generator, ids: list[int]) -> np.ndarray:
    forward = jax.jit(
        lambda params, x: generator._decoder_call(  # pylint: disable=protected-access
            params, "forward", input_ids=x
        )["logits"]
    )
    return np.asarray(forward(generator.params, jnp.asarray([ids])).astype(jnp.float32))[0]


def run(fv: flags.FlagValues) -> dict:
    """The check; returns the totals line."""
    bf16, tokenizer = _load(fv, None)
    int8, _ = _load(fv, "int8")
    vocab = generate.load_tokenizer(fv.tokenizer or tokenizer)
    prompts = generate.encode_prompts(vocab, fv.prompt, add_bos=True)
    kwargs = dict(max_new_tokens=fv.new_tokens, batch_size=len(prompts))
    ref, _ = bf16.generate(prompts, **kwargs)
    got, _ = int8.generate(prompts, **kwargs)
    rows = []
    for prompt, text, ref_new, got_new in zip(fv.prompt, prompts, ref, got):
        agree = next((i for i, (a, b) in enumerate(zip(ref_new, got_new)) if a != b),
                     min(len(ref_new), len(got_new)))
        ids = list(text) + list(ref_new)
        a, b = _logits(bf16, ids), _logits(int8, ids)
        rows.append(dict(
            prompt=prompt, new_tokens=len(ref_new), agree_tokens=agree,
            teacher_forced_agreement=float(np.mean(a.argmax(-1) == b.argmax(-1))),
            max_logit_error=float(np.abs(a - b).max()), max_abs_logit=float(np.abs(a).max()),
        ))
        print(json.dumps(rows[-1]), flush=True)
    totals = dict(
        prompts=len(rows), agree_tokens=sum(r["agree_tokens"] for r in rows),
        new_tokens=sum(r["new_tokens"] for r in rows),
        teacher_forced_agreement=float(np.mean([r["teacher_forced_agreement"] for r in rows])),
        max_logit_error=max(r["max_logit_error"] for r in rows),
    )
    print(json.dumps(totals), flush=True)
    return totals


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command line `argv` (None: sys.argv's) run."""
    flag_values, _ = parse_command_flags(
        define_flags, argv, program="tools/quantize_check.py",
        doc=f"usage: quantize_check.py [flags]\n\n{__doc__}", reads_config_text=True,
    )
    try:
        run(flag_values)
    except (ConfigError, ValueError) as e:
        raise SystemExit(f"quantize_check: {e}") from e


if __name__ == "__main__":
    main()
