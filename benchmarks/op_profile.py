"""Per-HLO-op GPU time from a profiler trace, grouped by where the op comes from.

    python -m axlearn.bench --config=gpt_1b --mesh_selector=gpu-h100-1 --steps=5 \
        --config_override=input.global_batch_size=4 --profile_dir=/tmp/prof --xla_dump_dir=/tmp/dump
    PYTHONPATH=. python benchmarks/op_profile.py --profile_dir=/tmp/prof --xla_dump_dir=/tmp/dump \
        --steps=5 --json_out=ops.json

The trace names each op by its HLO instruction; the optimized HLO of the dump gives each
instruction its JAX name stack (`metadata={op_name=...}`), which says forward, backward
(`transpose(jvp(...))`) or optimizer, and which layer part. Ops are grouped by
(pass, kind, part): kind is gemm / attention / fusion / other, part the last
module-path component that is not a primitive (e.g. `feed_forward`, `norm`).
"""

import argparse
import collections
import glob
import json
import os
import re

from axlearn.bench import gpu_kernel_times

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def hlo_op_names(dump_dir: str) -> dict[str, str]:
    """instruction name -> op_name metadata, from the largest optimized module in the dump."""
    files = glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))
    steps = [f for f in files if "train_step" in os.path.basename(f)]
    if not files:
        return {}
    path = max(steps or files, key=os.path.getsize)
    names = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            match = _INSTRUCTION.match(line)
            if not match:
                continue
            op_name = _OP_NAME.search(match.group(2))
            kind = "custom-call" if "custom-call(" in match.group(2) else ""
            if "__cudnn$fmha" in match.group(2) or "cudnn" in match.group(2) and "fmha" in match.group(2):
                kind = "attention"
            elif "__cublas$gemm" in match.group(2) or "__cublas$lt" in match.group(2):
                kind = "gemm"
            elif " fusion(" in match.group(2):
                if "kind=kCustom" in match.group(2) and ("gemm" in match.group(2) or "triton" in match.group(2)):
                    kind = "gemm"
                else:
                    kind = "fusion"
            names[match.group(1)] = (op_name.group(1) if op_name else "", kind)
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


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--profile_dir", required=True)
    parser.add_argument("--xla_dump_dir", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--json_out", default=None)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    # XLA names a fusion's kernel after the fusion ('_' for '.'); library kernels (cuBLAS,
    # cuDNN) keep their own names.
    times = gpu_kernel_times(args.profile_dir)
    names = hlo_op_names(args.xla_dump_dir)
    names.update({k.replace(".", "_"): v for k, v in list(names.items())})
    rows = []
    for op, (ms, count) in times.items():
        op_name, kind = names.get(op, ("", library_kind(op)))
        phase, part = classify(op_name)
        rows.append(dict(op=op, ms_per_step=ms / args.steps, count=count, kind=kind or "other",
                         phase=phase, part=part, op_name=op_name))
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
    print("--- top ops")
    for r in sorted(rows, key=lambda r: -r["ms_per_step"])[: args.top]:
        print(f"{r['ms_per_step']:8.3f} ms x{r['count'] // args.steps:<3d} {r['kind']:9s} {r['op'][:28]:28s} {r['op_name'][-90:]}")
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
