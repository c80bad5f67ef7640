r"""Generation speed of the `generate` command's own code path, on random Llamas of the
project's shapes, over one device or several.

    PYTHONPATH=$PWD python tools/generate_bench.py --shapes=gpt_1b --batch_sizes=1,32 \
        --prompt_len=128 --new_tokens=128 --devices=1
    PYTHONPATH=$PWD python tools/generate_bench.py --shapes=gpt_7b,70B --batch_sizes=1 \
        --devices=1,4      # 70B is skipped where its weights do not fit the devices.

Each shape (`gpt_1b`, `gpt_7b`, `70B`: `experiments/gpt.py`'s sizes, 128-wide heads; or
DIMxLAYERSxHEADSxKV_HEADSxMLP_HIDDENxVOCAB, e.g. 64x2x4x2x128x256) is built as a Llama
whose weights are drawn at random on the devices, each device drawing its own shard
(`tensor_parallel_shardings`): a 70B model never exists whole on the host or on one
device. `--via_hf_dir` instead writes the weights as a Hugging Face directory
(our export) and loads it the way `generate --hf_dir` does. `--quantize=int8` decodes
with int8 weights and per-row scales, as `generate --quantize=int8` does.

The runs use `generate.Generator`, the command's decoding, with an EOS id the model
cannot produce (so every row decodes `--new_tokens`). Per (shape, devices, batch size):
one generate call as warm-up and compile, then `--repeats` timed calls; the table shows
their medians of
- first token: the prefill of `--prompt_len` tokens up to the first generated token;
- decode: tokens after each row's first, per second, after the prefill;
- overall: all generated tokens over the whole call (what the command prints).
The JSON rows also give the warm-up call's first token and overall speed (compiling
apart): what one `generate` command, which makes a single call, prints.

`--profile_top=N` also traces one more call per row and prints the GPU kernels launched
per generated token, their summed time per token, and the N kernels that take the most
(a kernel that XLA shares between identical layers counts once per layer).
"""

import functools
import gc
import json
import statistics
import tempfile
import time
import warnings
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from axlearn.bench import gpu_kernel_times
from axlearn.common import generate, hf_llama
from axlearn.common.command_flags import parse_command_flags
from axlearn.common.config import ConfigBase, ConfigError
from axlearn.common.utils import flatten_with_paths

# Shape name -> (dim, layers, heads, kv heads, MLP hidden, vocab), as experiments/gpt.py's.
SHAPES = {
    "gpt_1b": (2048, 16, 16, 8, 8192, 32768),
    "gpt_7b": (4096, 32, 32, 8, 14336, 49152),
    "70B": (8192, 80, 64, 8, 28672, 49152),
}
# Standard deviation of the random weight matrices (norm scales are ones).
WEIGHT_STD = 0.02

def define_flags(flag_values: flags.FlagValues) -> None:
    """The benchmark's flags."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_list("shapes", ["gpt_1b"], f"Model shapes among {sorted(SHAPES)}.", **fv)
    flags.DEFINE_list("batch_sizes", ["1", "32"], "Batch sizes.", **fv)
    flags.DEFINE_list("devices", ["1"], "Device counts to shard each model over.", **fv)
    flags.DEFINE_integer("prompt_len", 128, "Prompt tokens (a multiple of 32).", **fv)
    flags.DEFINE_integer("new_tokens", 128, "Tokens generated per row.", **fv)
    flags.DEFINE_integer("chunk_size", generate.DEFAULT_CHUNK_SIZE, "Tokens per jitted call.", **fv)
    flags.DEFINE_integer("repeats", 3, "Timed generate calls per row of the table.", **fv)
    flags.DEFINE_bool("via_hf_dir", False, "Load through a Hugging Face directory export.", **fv)
    flags.DEFINE_string(
        "keep_hf_dir", None, "With --via_hf_dir: write the export here and keep it (for "
        "`generate --hf_dir`), one shape only.", **fv
    )
    flags.DEFINE_string("json_out", None, "Also write the rows as JSON lines here.", **fv)
    flags.DEFINE_integer("profile_top", 0, "Trace a call per row; print its top N kernels.", **fv)
    flags.DEFINE_string(
        "quantize", None, "int8: decode with int8 weights (generate --quantize=int8).", **fv
    )


def _sizes(shape: str) -> tuple[int, ...]:
    """(dim, layers, heads, kv heads, MLP hidden, vocab) of a shape name or of DxLxNxKxFxV."""
    if shape in SHAPES:
        return SHAPES[shape]
    parts = shape.split("x")
    if len(parts) != 6 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(
            f"--shapes: '{shape}' is neither one of {sorted(SHAPES)} nor "
            "DIMxLAYERSxHEADSxKV_HEADSxMLP_HIDDENxVOCAB"
        )
    return tuple(int(p) for p in parts)


def llama_config(shape: str) -> ConfigBase:
    """A bfloat16 Llama of `shape` (fused q/k/v, as `hf_llama` makes it), whose EOS id is
    one past the vocabulary."""
    dim, layers, heads, kv_heads, hidden, vocab = _sizes(shape)
    cfg = hf_llama.llama_model_config(
        vocab_size=vocab, dim=dim, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        hidden_dim=hidden, rope_theta=500000.0, repeated=False, pad_token_id=0,
        eos_token_id=vocab,
    )
    cfg.dtype = jnp.bfloat16
    return cfg


def model_config(shape: str, num_devices: int) -> ConfigBase:
    """`llama_config(shape)` as `generate` decodes it on `num_devices` devices."""
    return generate.decoding_config(llama_config(shape), num_devices=num_devices)


def weight_bytes(cfg: ConfigBase) -> int:
    """Bytes of the model's parameters in its dtype."""
    specs = cfg.clone(name="model").instantiate(parent=None).create_parameter_specs_recursively()
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: hasattr(x, "shape"))
    return sum(int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize for s in leaves)


@functools.lru_cache(maxsize=None)
def _drawer(shape: tuple, dtype: Any, sharding: Any, ones: bool):
    """A jitted draw of one parameter, shared by parameters of one shape and placement."""
    if ones:
        return jax.jit(lambda key: jnp.ones(shape, dtype), out_shardings=sharding)
    return jax.jit(
        lambda key: (jax.random.normal(key, shape, jnp.float32) * WEIGHT_STD).astype(dtype),
        out_shardings=sharding,
    )


def random_params(cfg: ConfigBase, mesh: jax.sharding.Mesh, *, seed: int = 0) -> Any:
    """Random parameters of `cfg`, each drawn shard by shard on the devices of `mesh`."""
    if hasattr(jax.config, "jax_threefry_partitionable"):  # The default in newer jax.
        jax.config.update("jax_threefry_partitionable", True)  # Each device draws its shard.
    specs = cfg.clone(name="model").instantiate(parent=None).create_parameter_specs_recursively()
    shardings = generate.tensor_parallel_shardings(specs, mesh)
    is_spec = lambda x: hasattr(x, "shape")  # pylint: disable=unnecessary-lambda-assignment
    flat = flatten_with_paths(specs, is_leaf=is_spec)
    flat_shardings = jax.tree.leaves(shardings, is_leaf=lambda x: hasattr(x, "device_set"))
    arrays = []
    for i, ((path, spec), sharding) in enumerate(zip(flat, flat_shardings)):
        draw = _drawer(tuple(spec.shape), jnp.dtype(spec.dtype), sharding, path.endswith("/scale"))
        arrays.append(draw(jax.random.fold_in(jax.random.PRNGKey(seed), i)))
    treedef = jax.tree_util.tree_structure(specs, is_leaf=is_spec)
    return jax.tree_util.tree_unflatten(treedef, arrays)


def build_generator(
    shape: str, num_devices: int, *, via_hf_dir: bool, quantize: Optional[str] = None,
    keep_hf_dir: Optional[str] = None,
) -> generate.Generator:
    """A Generator of a random `shape` model sharded over `num_devices` devices (with
    int8 weights if `quantize` says so)."""
    cfg = model_config(shape, num_devices)
    mesh = generate.make_mesh(num_devices)
    generate.check_devices(cfg, num_devices)
    if not via_hf_dir:
        params = random_params(cfg, mesh)
        if quantize:
            params = generate.quantize_for_decoding(params, cfg.dtype)
        return generate.Generator(cfg, params, mesh=mesh)
    fused = llama_config(shape)
    host = jax.sharding.Mesh(np.asarray(jax.local_devices()[:1]), (generate.MODEL_AXIS,))
    params = jax.device_get(random_params(fused, host))
    with tempfile.TemporaryDirectory() as temporary:
        directory = keep_hf_dir or temporary
        hf_llama.write_hf_model(params, fused, directory)
        del params
        generator, _ = generate.from_hf_dir(
            directory, dtype="bfloat16", devices=num_devices, quantize=quantize
        )
    generator.set_eos_ids([cfg.decoder.vocab_size])
    return generator


def _fits(cfg: ConfigBase, num_devices: int) -> bool:
    """Whether the weights take at most 85% of the devices' memory (True if unknown)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return limit is None or weight_bytes(cfg) / num_devices <= 0.85 * limit


def measure(
    generator: generate.Generator, *, batch_size: int, prompt_len: int, new_tokens: int,
    chunk_size: int, repeats: int, profile_top: int = 0,
) -> dict[str, float]:
    """Medians over `repeats` generate calls (after one warm-up call) of the first-token
    seconds, the decode and overall tokens/s; and the compile seconds. With `profile_top`,
    also `kernel_profile`'s figures (and its lines printed)."""
    vocab = generator.model_config.decoder.vocab_size
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, vocab, size=(batch_size, prompt_len)).tolist()
    kwargs = dict(max_new_tokens=new_tokens, batch_size=batch_size, chunk_size=chunk_size)
    _, warm = generator.generate(prompts, **kwargs)
    runs = [generator.generate(prompts, **kwargs)[1] for _ in range(repeats)]
    for stats in runs:
        if stats.new_tokens != batch_size * new_tokens:
            raise RuntimeError(f"Expected {batch_size * new_tokens} tokens, got {stats.new_tokens}")
    row = dict(
        first_token_ms=1000 * statistics.median(s.first_token_seconds for s in runs),
        decode_tokens_per_s=statistics.median(s.decode_tokens_per_second for s in runs),
        overall_tokens_per_s=statistics.median(s.tokens_per_second for s in runs),
        compile_s=warm.compile_seconds,
        # The warm-up call is what one `generate` command runs: its figures, compiling apart.
        first_call_first_token_ms=1000 * warm.first_token_seconds,
        first_call_overall_tokens_per_s=warm.tokens_per_second,
    )
    if profile_top:
        summary, lines = kernel_profile(generator, prompts, profile_top, **kwargs)
        print(f"batch {batch_size}: {summary['kernels_per_token']:.1f} kernels and "
              f"{summary['gpu_us_per_token']:.1f} us of GPU time per generated token", flush=True)
        print("\n".join(lines), flush=True)
        row.update(summary)
    return row


def kernel_profile(
    generator: generate.Generator, prompts: list[list[int]], top: int, **kwargs
) -> tuple[dict[str, float], list[str]]:
    """GPU kernels per generated token and their time per token (µs) in a traced generate
    call, and lines for the `top` kernels by time (empty where the trace has no GPU)."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            _, stats = generator.generate(prompts, **kwargs)
        totals = gpu_kernel_times(trace_dir)
    steps = stats.new_tokens / len(prompts)  # Decoding steps (each row one token a step).
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    lines = [
        f"  {1000 * ms / steps:8.2f} us/token {count / steps:6.2f}/token  {name[:100]}"
        for name, (ms, count) in ranked
    ]
    summary = dict(
        kernels_per_token=sum(count for _, count in totals.values()) / steps,
        gpu_us_per_token=1000 * sum(ms for ms, _ in totals.values()) / steps,
    )
    return summary, lines


def _table(rows: list[dict[str, Any]]) -> str:
    header = ("shape", "devices", "batch", "prompt", "new", "first token (ms)", "decode tok/s",
              "overall tok/s", "compile (s)")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        if "skipped" in r:
            cells = (r["shape"], r["devices"], r["batch"], "", "", r["skipped"], "", "", "")
        else:
            cells = (
                r["shape"], r["devices"], r["batch"], r["prompt_len"], r["new_tokens"],
                f"{r['first_token_ms']:,.1f}", f"{r['decode_tokens_per_s']:,.0f}",
                f"{r['overall_tokens_per_s']:,.0f}", f"{r['compile_s']:.1f}",
            )
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def run(fv: flags.FlagValues) -> list[dict[str, Any]]:
    """Every (shape, devices, batch size) of the flags; prints each row and the table."""
    generate.check_quantize(fv.quantize)
    if fv.keep_hf_dir and (not fv.via_hf_dir or len(fv.shapes) > 1):
        raise ConfigError("--keep_hf_dir applies to --via_hf_dir with one shape")
    if fv.quantize and any(int(d) > 1 for d in fv.devices):
        raise ConfigError(f"--quantize={fv.quantize} decodes on one device: pass --devices=1")
    batch_sizes = [int(b) for b in fv.batch_sizes]
    device_counts = [int(d) for d in fv.devices]
    device = jax.local_devices()[0]
    print(f"jax {jax.__version__}, {len(jax.local_devices())} x {device.device_kind}", flush=True)
    rows = []
    for shape in fv.shapes:
        cfg = llama_config(shape)
        for num_devices in device_counts:
            base = dict(shape=shape, devices=num_devices, weights=fv.quantize or "bf16")
            if num_devices > len(jax.local_devices()) or not _fits(cfg, num_devices):
                for batch in batch_sizes:
                    rows.append(dict(base, batch=batch, skipped="does not fit / too few devices"))
                continue
            began = time.perf_counter()
            generator = build_generator(
                shape, num_devices, via_hf_dir=fv.via_hf_dir, quantize=fv.quantize,
                keep_hf_dir=fv.keep_hf_dir,
            )
            print(f"{shape} on {num_devices} device(s): weights ready in "
                  f"{time.perf_counter() - began:.1f} s", flush=True)
            for batch in batch_sizes:
                row = dict(base, batch=batch, prompt_len=fv.prompt_len, new_tokens=fv.new_tokens)
                row.update(measure(
                    generator, batch_size=batch, prompt_len=fv.prompt_len,
                    new_tokens=fv.new_tokens, chunk_size=fv.chunk_size, repeats=fv.repeats,
                    profile_top=fv.profile_top,
                ))
                print(json.dumps(row), flush=True)
                rows.append(row)
            del generator
            gc.collect()
    print(_table(rows), flush=True)
    if fv.json_out:
        with open(fv.json_out, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command line `argv` (None: sys.argv's) run."""
    flag_values, _ = parse_command_flags(
        define_flags, argv, program="tools/generate_bench.py",
        doc=f"usage: generate_bench.py [flags]\n\n{__doc__}",
    )
    # Donation is what lets a chunk update the cache in place; a CPU ignores it.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    try:
        run(flag_values)
    except ConfigError as e:
        raise SystemExit(f"generate_bench: {e}") from e


if __name__ == "__main__":
    main()
