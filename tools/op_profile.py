r"""Where a train step's GPU time goes: per-HLO-op time from a profiler trace.

Run it to find the ops worth optimizing (which matmuls, fusions and attention kernels of
the forward pass, the backward pass or the optimizer update take the time), after
changing a layer or a config, or on new hardware. First run a few steps with a trace
and an HLO dump, then read them with this tool:

    python -m axlearn.bench --config=gpt_1b --mesh_selector=gpu-h100-1 --steps=5 \
        --config_override=input.global_batch_size=4 --profile_dir=/tmp/prof --xla_dump_dir=/tmp/dump
    PYTHONPATH=. python tools/op_profile.py --profile_dir=/tmp/prof --xla_dump_dir=/tmp/dump \
        --steps=5 [--top=40] [--json_out=ops.json]

`--steps` is the number of traced steps (bench's `--steps`); times are per step. It prints
the GPU op time of a step, then that time split by (pass, kind), by (pass, kind, module
path), and the top ops with the same op of every layer summed into one row (ms per step,
launches per step, kind, HLO op, result shape, JAX name stack). Pass is forward,
backward, update/other or unknown; kind is gemm, attention, fusion, copy, custom-call or
other; module paths have layer numbers folded into 'layerN'. `--json_out` writes one row
per HLO op.

How a kernel finds its op: a fusion's kernel is named after its HLO instruction, whose
JAX name stack in the dump's optimized HLO (`metadata={op_name=...}`) says forward,
backward (`transpose(jvp(...))`) or update, and which module. Library kernels (cuBLAS,
cuDNN, copies) launched inside the step's CUDA graph are recorded under the graph only,
so they are grouped by library with pass 'unknown'. To see each of them under its own
HLO op (which matmul, its output shape), profile with CUDA graphs off (the step then runs
a little slower):

    XLA_FLAGS=--xla_gpu_enable_command_buffer= python -m axlearn.bench ... --profile_dir=...
"""

import collections
import glob
import json
import os
import re
from collections.abc import Sequence
from typing import NamedTuple, Optional

from absl import flags

from axlearn.bench import KernelEvent, gpu_kernel_events
from axlearn.common.command_flags import parse_command_flags, usage_error

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# The result of an instruction: the text up to its opcode, e.g. 'bf16[16384,2048]{1,0}'
# or a tuple '(bf16[16384,2048]{1,0}, s8[33554432]{0})'.
_RESULT = re.compile(r"^(\(.*?\)|\S+)\s")


class HloOp(NamedTuple):
    """What the optimized HLO says of one instruction."""

    op_name: str  # Its JAX name stack ('' if none).
    kind: str  # gemm / attention / fusion / custom-call / ''.
    result: str  # Its result shape(s), layouts dropped.


def _kind(instruction: str) -> str:
    """gemm / attention / fusion / custom-call / '' for the text right of an HLO '='."""
    if "cudnn" in instruction and "fmha" in instruction:
        return "attention"
    if "__cublas$gemm" in instruction or "__cublas$lt" in instruction:
        return "gemm"
    if " fusion(" in instruction:
        is_gemm = "gemm" in instruction or "triton" in instruction
        return "gemm" if "kind=kCustom" in instruction and is_gemm else "fusion"
    return "custom-call" if "custom-call(" in instruction else ""


def hlo_op_names(dump_dir: str) -> dict[str, HloOp]:
    """Kernel or instruction name -> its HloOp, from the dump's optimized train step (else
    its largest optimized module).

    XLA names a fusion's kernel after the fusion with '_' for '.', so both spellings are
    keys; library kernels (cuBLAS, cuDNN) keep their own names and are not here.
    """
    files = glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))
    steps = [f for f in files if "train_step" in os.path.basename(f)]
    if not files:
        return {}
    names = {}
    with open(max(steps or files, key=os.path.getsize), encoding="utf-8") as f:
        for line in f:
            match = _INSTRUCTION.match(line)
            if not match:
                continue
            name, instruction = match.groups()
            op_name = _OP_NAME.search(instruction)
            result = _RESULT.match(instruction)
            value = HloOp(
                op_name.group(1) if op_name else "",
                _kind(instruction),
                re.sub(r"\{[^}]*\}", "", result.group(1)) if result else "",
            )
            names[name] = names[name.replace(".", "_")] = value
    return names


def classify(op_name: str) -> tuple[str, str]:
    """(pass, module path) of a JAX name stack, layer numbers folded into 'layerN'."""
    if "transpose(" in op_name:
        phase = "backward"
    elif "jvp(" in op_name:
        phase = "forward"
    elif op_name:
        phase = "update/other"
    else:
        return "unknown", "?"
    parts = op_name.split("/")[1:-1]  # Drops jit(...) and the primitive.
    parts = [re.sub(r"^(transpose\()?(jvp\()?([^()]*)\)*$", r"\3", p) for p in parts]
    parts = [p for p in parts if p and "," not in p and "->" not in p and "(" not in p]
    path = "/".join(parts).replace("decoder/transformer/", "")
    return phase, re.sub(r"layer\d+", "layerN", path) or "-"


def library_kind(kernel: str) -> str:
    """gemm / attention / copy / other for a kernel that is no HLO fusion (its library's
    name; the command buffer hides which HLO op launched it)."""
    name = kernel.lower()
    if name.startswith(("nvjet", "cutlass", "sm90_xmma", "ampere_", "gemm")):
        return "gemm"
    if "cudnn" in name or "fmha" in name or "flash" in name:
        return "attention"
    if name.startswith("memcpy") or name.startswith("memset"):
        return "copy"
    return "other"


def op_rows(events: Sequence[KernelEvent], names: dict[str, HloOp], steps: int) -> list[dict]:
    """One row per HLO op (or, where the trace names none, per kernel name) with its GPU
    time per step, launches, kind, pass, module path, JAX name stack and result shape."""
    totals: dict[str, list] = {}
    for event in events:
        # A kernel launched outside a CUDA graph carries its instruction; inside one, only
        # the graph's thunk: then a fusion is still known by its kernel's name.
        key = event.hlo_op if event.hlo_op in names else event.name
        total = totals.setdefault(key, [0.0, 0])
        total[0] += event.ms
        total[1] += 1
    rows = []
    for op, (ms, count) in totals.items():
        hlo = names.get(op, HloOp("", library_kind(op), ""))
        phase, part = classify(hlo.op_name)
        rows.append(dict(op=op, ms_per_step=ms / steps, count=count, kind=hlo.kind or "other",
                         phase=phase, part=part, op_name=hlo.op_name, result=hlo.result))
    return rows


def top_ops(rows: Sequence[dict]) -> list[dict]:
    """`rows` merged by (kind, JAX name stack with layer numbers folded, result shape), so
    that one matmul or fusion of all layers is one row; slowest first. A merged row keeps
    the first op's name."""
    merged: dict[tuple, dict] = {}
    for r in rows:
        op_name = re.sub(r"layer\d+", "layerN", r["op_name"])
        # Ops without a name stack (library kernels under a CUDA graph) stay apart.
        key = (r["kind"], op_name, r["result"]) if op_name else (r["op"],)
        if key in merged:
            merged[key]["ms_per_step"] += r["ms_per_step"]
            merged[key]["count"] += r["count"]
        else:
            merged[key] = dict(r, op_name=op_name)
    return sorted(merged.values(), key=lambda r: -r["ms_per_step"])


def define_flags(flag_values: flags.FlagValues) -> None:
    """The tool's flags."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_string("profile_dir", None, "bench's --profile_dir.", **fv)
    flags.DEFINE_string("xla_dump_dir", None, "bench's --xla_dump_dir.", **fv)
    flags.DEFINE_integer("steps", None, "How many steps the trace holds.", lower_bound=1, **fv)
    flags.DEFINE_string("json_out", None, "Write one row per HLO op as JSON.", **fv)
    flags.DEFINE_integer("top", 40, "Rows printed per listing.", **fv)
    for name in ("profile_dir", "xla_dump_dir", "steps"):
        flags.mark_flag_as_required(name, **fv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command line `argv` (None: sys.argv's) run."""
    program = "tools/op_profile.py"
    args, _ = parse_command_flags(
        define_flags, argv, program=program, doc=f"usage: op_profile.py [flags]\n\n{__doc__}"
    )
    events = gpu_kernel_events(args.profile_dir)
    if not events:
        usage_error(program, f"--profile_dir={args.profile_dir}: no GPU kernels in a trace there")
    names = hlo_op_names(args.xla_dump_dir)
    if not names:
        usage_error(
            program, f"--xla_dump_dir={args.xla_dump_dir}: no *after_optimizations.txt there"
        )
    rows = op_rows(events, names, args.steps)
    total = sum(r["ms_per_step"] for r in rows)
    groups = collections.defaultdict(float)
    for r in rows:
        groups[(r["phase"], r["kind"], r["part"])] += r["ms_per_step"]
    print(f"GPU op time {total:.2f} ms/step, {len(rows)} distinct ops")
    by_phase_kind = collections.defaultdict(float)
    for (phase, kind, _), ms in groups.items():
        by_phase_kind[(phase, kind)] += ms
    for (phase, kind), ms in sorted(by_phase_kind.items(), key=lambda kv: -kv[1]):
        print(f"{ms:9.2f} ms  {phase:14s} {kind}")
    print("--- by (pass, kind, part)")
    for (phase, kind, part), ms in sorted(groups.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{ms:9.2f} ms  {phase:14s} {kind:10s} {part}")
    print("--- top ops (the same op of every layer summed)")
    for r in top_ops(rows)[: args.top]:
        print(f"{r['ms_per_step']:8.3f} ms x{r['count'] // args.steps:<3d} {r['kind']:9s} "
              f"{r['op'][:28]:28s} {r['result'][:36]:36s} {r['op_name'][-80:]}")
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
