r"""The peer of our LoRA figures: transformers + PEFT LoRA training at the same shapes and
settings, timed on the same card and printed in `axlearn.bench`'s columns:

    PYTHONPATH=. python tools/peft_bench.py --shape=llama2_7b --batch=2 --compile
    PYTHONPATH=. python tools/peft_bench.py --shape=llama3_8b --batch=2 --gradient_checkpointing

    # Ours and the peer side by side on one card in one shell command (each in its own
    # process, so neither holds memory while the other runs); the peer's table then has
    # ours beside it and a Diff column (ours - peer):
    python -m axlearn.bench --config=CONFIG ... --json_out=/tmp/ours.json && \
        PYTHONPATH=. python tools/peft_bench.py --shape=llama2_7b --batch=2 --compile \
        --compare_with=/tmp/ours.json

What runs: a `transformers.LlamaForCausalLM` of the shape with random weights in bfloat16,
frozen; PEFT LoRA of rank `--rank` (16; alpha twice the rank, no dropout) on all seven
linear maps of every layer (q, k, v, o, gate, up, down), its adapters in PEFT's default
float32 (`--adapter_dtype=bfloat16` keeps them in bf16); SDPA attention; torch's fused
AdamW on the adapters; each step a fresh batch of `--batch` sequences of `--seq_len`
(4,096) random tokens, the loss on every next token. `--compile`: the model under
`torch.compile`; `--gradient_checkpointing`: every decoder layer recomputed in the
backward pass (non-reentrant). `--warmup_steps` (3, which include compilation) run before
the `--steps` (10) timed ones; the timed steps run back to back and are timed together.

Columns as `axlearn.bench` prints them, with DESIGN.md's LoRA count of model FLOPs a
token (4 x frozen matmul parameters, the LM head included, + 6 x adapter parameters + 6 x
layers x seq_len x d_model for causal attention) and MFU against the card's dense bf16
peak (`perf.PEAK_TFLOPS_BY_DEVICE_KIND`); peak memory is the most torch's allocator held
(`torch.cuda.max_memory_allocated`; on a CPU the process's peak RSS), Memory % that of the
card. The shapes: Llama 2 7B (d 4,096, 32 layers, 32 heads, FFN 11,008, vocab 32,000),
Llama 3 8B (GQA 32/8, FFN 14,336, vocab 128,256, rope theta 500,000), and a tiny one for
checks on a CPU.
"""

import dataclasses
import json
import resource
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional

from absl import flags

from axlearn.bench import COLUMNS as BENCH_COLUMNS
from axlearn.bench import GpuSampler, format_table, write_json
from axlearn.common.command_flags import parse_command_flags, usage_error

PROGRAM = "tools/peft_bench.py"


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Llama's sizes."""

    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    hidden_dim: int  # The MLP's (gate and up projections' outputs).
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads


SHAPES = {
    "llama2_7b": Shape(32000, 4096, 32, 32, 32, 11008, 10000.0),
    "llama3_8b": Shape(128256, 4096, 32, 32, 8, 14336, 500000.0),
    "tiny": Shape(256, 64, 2, 4, 2, 128, 500000.0),  # For checks on a CPU.
}

# The seven linear maps of a Llama layer that carry adapters, as PEFT names them.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _layer_linears(shape: Shape) -> dict[str, tuple[int, int]]:
    """{name: (inputs, outputs)} of each of a layer's seven linear maps."""
    d, kv = shape.dim, shape.num_kv_heads * shape.head_dim
    return {
        "q_proj": (d, shape.num_heads * shape.head_dim),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (shape.num_heads * shape.head_dim, d),
        "gate_proj": (d, shape.hidden_dim),
        "up_proj": (d, shape.hidden_dim),
        "down_proj": (shape.hidden_dim, d),
    }


def adapter_params(shape: Shape, rank: int) -> int:
    """LoRA's parameters on every linear map: A [rank, inputs] and B [outputs, rank]."""
    per_layer = sum(rank * (i + o) for i, o in _layer_linears(shape).values())
    return shape.num_layers * per_layer


def frozen_matmul_params(shape: Shape) -> int:
    """The frozen weights that multiply activations: the layers' linear maps and the LM head
    (untied); the embedding lookup is no matmul."""
    per_layer = sum(i * o for i, o in _layer_linears(shape).values())
    return shape.num_layers * per_layer + shape.vocab_size * shape.dim


def model_flops_per_token(shape: Shape, *, seq_len: int, rank: int) -> float:
    """DESIGN.md's LoRA count: frozen matmuls forward and input gradient (4 x), adapters
    forward and both gradients (6 x), causal attention 6 x layers x seq_len x d_model."""
    return (
        4 * frozen_matmul_params(shape)
        + 6 * adapter_params(shape, rank)
        + 6 * shape.num_layers * seq_len * shape.dim
    )


def _peak_tflops(device_name: str) -> Optional[float]:
    from axlearn.common.perf import PEAK_TFLOPS_BY_DEVICE_KIND  # pylint: disable=import-outside-toplevel

    for name, tflops in PEAK_TFLOPS_BY_DEVICE_KIND:
        if name.lower() in device_name.lower():
            return tflops
    return None


def build_model(args: flags.FlagValues, device: Any) -> tuple[Any, list[Any]]:
    """(The PEFT model on `device`, its trainable parameters) for the flags."""
    # pylint: disable=import-outside-toplevel
    import peft
    import torch
    import transformers

    shape = SHAPES[args.shape]
    config = transformers.LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.dim, intermediate_size=shape.hidden_dim,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, rope_theta=shape.rope_theta,
        max_position_embeddings=max(args.seq_len, 4096), rms_norm_eps=1e-5,
        tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # The weights are drawn in bf16, on the device.
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = peft.LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, bias="none",
        target_modules=list(TARGET_MODULES), task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(
        model, lora, autocast_adapter_dtype=args.adapter_dtype == "float32"
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    if args.adapter_dtype == "bfloat16":
        for p in trainable:
            p.data = p.data.to(torch.bfloat16)
    model.train()
    return model, trainable


def run(args: flags.FlagValues) -> dict[str, Any]:
    """Trains `warmup_steps + steps` steps; returns bench's columns for the timed ones."""
    # pylint: disable=import-outside-toplevel
    import peft
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shape = SHAPES[args.shape]
    model, trainable = build_model(args, device)
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=True)
    step_model = torch.compile(model) if args.compile else model
    generator = torch.Generator(device=device).manual_seed(0)

    def step() -> Any:
        ids = torch.randint(
            0, shape.vocab_size, (args.batch, args.seq_len), device=device, generator=generator
        )
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def wait():
        if cuda:
            torch.cuda.synchronize()

    losses = []
    for _ in range(args.warmup_steps):
        losses.append(step())
    wait()
    sampler = GpuSampler() if cuda else None
    if sampler is not None:
        sampler.start()
    start = time.perf_counter()
    try:
        for _ in range(args.steps):
            losses.append(step())
        wait()
    finally:
        gpu_samples = sampler.stop() if sampler is not None else {}
    avg = (time.perf_counter() - start) / args.steps
    tokens = args.batch * args.seq_len
    flops = model_flops_per_token(shape, seq_len=args.seq_len, rank=args.rank) * tokens / avg
    if cuda:
        device_name = torch.cuda.get_device_name(0)
        peak_bytes = torch.cuda.max_memory_allocated()
        card_bytes = torch.cuda.get_device_properties(0).total_memory
    else:
        device_name = "cpu"
        peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        card_bytes = None
    peak = _peak_tflops(device_name)
    tflops = flops / 1e12
    settings = [f"batch {args.batch}"]
    settings += ["torch.compile"] if args.compile else []
    settings += ["gradient checkpointing"] if args.gradient_checkpointing else []
    return {
        "config": f"peft {args.shape}",
        "settings": ", ".join(settings),
        "num_params": sum(p.numel() for p in model.parameters()),
        "num_trainable_params": sum(p.numel() for p in trainable),
        "final_loss": float(losses[-1]),
        "losses": [float(loss) for loss in losses],
        "avg_step_time_s": avg,
        "tflops_per_device": tflops,
        "tokens_per_s_per_device": tokens / avg,
        "mfu_percent": 100 * tflops / peak if peak else float("nan"),
        "memory_percent": 100 * peak_bytes / card_bytes if card_bytes else float("nan"),
        "peak_memory_gib": peak_bytes / 2**30,
        "sm_clock_mhz": gpu_samples.get("sm_clock_mhz"),
        "gpu_power_w": gpu_samples.get("gpu_power_w"),
        "tokens_per_step": tokens,
        "microbatches_per_step": 1,
        "versions": f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"peft {peft.__version__}",
        "device": f"1x {device_name}",
    }


def _columns() -> tuple[tuple, ...]:
    """bench's columns, with the peak memory in GiB, the trainable parameters and the
    libraries' versions beside its JAX version (no DPO reference row: LoRA has none)."""
    columns = []
    for column in BENCH_COLUMNS:
        title = column[0]
        if column[1] == "reference_params":
            continue
        if title == "JAX version":
            columns.append(("Versions", "versions", "{}", 0))
            continue
        columns.append(column)
        if title == "Parameters":
            columns.append(("Trainable parameters", "num_trainable_params", "{:,.0f}", 0))
        elif title == "Memory %":
            columns.append(("Peak memory (GiB)", "peak_memory_gib", "{:.1f}", -1))
    return (("Settings", "settings", "{}", 0), *columns)


COLUMNS = _columns()


def report(peer: dict[str, Any], ours: Optional[dict[str, Any]] = None) -> str:
    """The peer's table; with `ours` (axlearn.bench's --json_out), both side by side, a Diff
    column (ours - peer) and the ratio of the rates."""
    if ours is None:
        return format_table({peer["config"]: peer}, columns=COLUMNS)
    ours = dict(ours, versions=ours.get("versions") or f"jax {ours.get('jax_version')}")
    ours.setdefault("settings", f"axlearn {ours.get('config')}")
    table = format_table({"peer": peer, "ours": ours}, columns=COLUMNS)
    ratio = ours["tokens_per_s_per_device"] / peer["tokens_per_s_per_device"]
    return f"{table}\nours / peer tokens/s/device: {ratio:.2f}x"


def define_flags(flag_values: flags.FlagValues) -> None:
    """The peer benchmark's flags."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_enum("shape", "llama2_7b", list(SHAPES), "The Llama shape.", **fv)
    flags.DEFINE_integer("batch", 2, "Sequences a step.", **fv)
    flags.DEFINE_integer("seq_len", 4096, "Tokens a sequence.", **fv)
    flags.DEFINE_integer("rank", 16, "LoRA rank (alpha is twice it).", **fv)
    flags.DEFINE_bool("compile", False, "Run the model under torch.compile.", **fv)
    flags.DEFINE_bool(
        "gradient_checkpointing", False, "Recompute every decoder layer in the backward pass.", **fv
    )
    flags.DEFINE_enum(
        "adapter_dtype", "float32", ["float32", "bfloat16"],
        "The adapters' dtype (float32: PEFT's default over a bf16 base).", **fv,
    )
    flags.DEFINE_integer("steps", 10, "Timed steps.", **fv)
    flags.DEFINE_integer("warmup_steps", 3, "Steps before the timed ones (compilation).", **fv)
    flags.DEFINE_string(
        "compare_with", None, "An axlearn.bench --json_out file: print ours beside the peer.", **fv
    )
    flags.DEFINE_string("json_out", None, "Write the peer's result as JSON to this file.", **fv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line `argv` (None: sys.argv's) run; returns the exit status."""
    args, _ = parse_command_flags(
        define_flags, argv, program=PROGRAM, doc=f"usage: peft_bench.py [flags]\n\n{__doc__}"
    )
    for name in ("batch", "seq_len", "rank", "steps"):
        if getattr(args, name) < 1:
            usage_error(PROGRAM, f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup_steps < 0:
        usage_error(PROGRAM, f"--warmup_steps must be at least 0, got {args.warmup_steps}")
    ours = None
    if args.compare_with:  # Read before the run, so that a bad file costs no GPU time.
        try:
            with open(args.compare_with, encoding="utf-8") as f:
                ours = json.load(f)
            ours["tokens_per_s_per_device"] = float(ours["tokens_per_s_per_device"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            usage_error(
                PROGRAM,
                f"--compare_with={args.compare_with}: not an axlearn.bench --json_out result "
                f"({type(e).__name__}: {e})",
            )
    result = run(args)
    write_json(args.json_out, result)
    print(report(result, ours))
    return 0


if __name__ == "__main__":
    sys.exit(main())
