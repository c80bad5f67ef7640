r"""Measures candidate settings of gpt_7b, gpt_7b_fp8 and moe_8x1b on one 4-GPU host, or of
gpt_7b and gpt_8b on one GPU (`--gpus=1`), in one call, within a wall-clock budget, and
prints one table to choose the mesh rules' settings from:

    PYTHONPATH=. python tools/sweep_7b.py [--gpus=4|1] [--budget_s=530] [--only=7b_rule,moe_ep] \
        [--json_out=sweep.json] [--dry_run]

Every run is `axlearn.bench`'s `run_benchmark` (synthetic batches, the host's mesh rule,
then the run's overrides) in a process of its own, so that XLA flags and memory do not
carry over. On the 4-GPU host (`gpu-h200-4`) each GPU runs 8 sequences of 4,096 tokens a
step (global batch 32, gradient accumulation over the rule's microbatches unless a run
sets its own); the gpt_7b_fp8 run takes the settings of the fastest gpt_7b run finished
before it (none yet: it waits for the next gpt_7b run). On one GPU (`gpu-h200-1`) a step
is 8 sequences accumulated one at a time, as the one-GPU rules run a configured batch; a
run may give the JAX allocator a larger share of the card than its default 75%
(XLA_PYTHON_CLIENT_MEM_FRACTION, shown in the settings).

The runs go in the order of the table below (most informative first); each stops at its
own cap or at what is left of `--budget_s`, whichever comes first, and a run that cannot
get `--min_run_s` is skipped. A row is printed as each run ends, and the whole table at
the end: bench's tokens/s/GPU, MFU and step time, the peak memory, the XLA compile time
(jax's trace, lowering and backend compile events, summed) and the run's wall time. A
run stopped at its cap prints its threads' Python stacks first (where it was: compiling
or stepping).
`--dry_run` builds every run's config on this machine (no device) and prints the plan.
"""

import dataclasses
import faulthandler
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, Optional

from absl import flags

from axlearn.common.command_flags import parse_command_flags, usage_error

# The host the sweep is for, and 8 sequences a GPU on it.
MESH_SELECTOR = "gpu-h200-4"
GLOBAL_BATCH = 32
# The one-GPU sweep (--gpus=1): its host, and 8 sequences a step, accumulated one at a time.
ONE_GPU_MESH_SELECTOR = "gpu-h200-1"
ONE_GPU_GLOBAL_BATCH = 8
STEPS, WARMUP_STEPS = 3, 2

_LAYER = "model.decoder.transformer.layer"
# jax's compile events (jax._src.dispatch): the step's trace, lowering and XLA compile.
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
# The collectives combined into chunks of 512 MiB instead of the preset's 128 MiB.
_LARGER_COMBINES = (
    "--xla_gpu_all_gather_combine_threshold_bytes=536870912 "
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=536870912"
)


@dataclasses.dataclass(frozen=True)
class Run:
    """One benchmark of the sweep."""

    name: str
    config: str
    settings: str  # What the run changes, for the table.
    overrides: tuple[str, ...] = ()  # After the mesh rule (launch_trainer.build_trainer_config).
    xla_flags: str = ""  # Added after the environment's XLA_FLAGS (the preset stays).
    cap_s: int = 200  # The run's own wall-clock limit.
    # Takes the overrides and XLA flags of the fastest finished run of this config.
    best_of: Optional[str] = None
    global_batch: int = GLOBAL_BATCH  # Sequences a step (input.global_batch_size).
    # The share of the card the JAX allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION);
    # None: jax's default, 75%.
    mem_fraction: Optional[float] = None


RUNS = (
    Run("7b_rule", "gpt_7b", "rule: no remat, carried bf16 weights, 4 microbatches of 2"),
    Run("7b_fp8_best", "gpt_7b_fp8", "FP8 with the fastest gpt_7b run's settings", best_of="gpt_7b"),
    Run("moe_ep", "moe_8x1b", "rule: experts over 4 GPUs, 4 microbatches of 2", cap_s=150),
    # The grouped matmuls as XLA's ragged dot (dense over the 8 experts) beside the Mosaic
    # GPU kernels: whether the kernels are what keeps the FSDP layout compiling.
    Run(
        "moe_fsdp_ragged",
        "moe_8x1b_fsdp",
        "every expert on every GPU, XLA ragged dot",
        (f"{_LAYER}.feed_forward.grouped_matmul='ragged_dot'",),
        cap_s=150,
    ),
    Run("moe_fsdp", "moe_8x1b_fsdp", "rule: every expert on every GPU, Mosaic GPU kernels", cap_s=180),
    Run(
        "7b_dots",
        "gpt_7b",
        "remat saves every matmul output without batch dims, 4 microbatches of 2",
        (
            f"{_LAYER}.remat_spec={{'prevent_cse': True, "
            "'policy': 'dots_with_no_batch_dims_saveable'}",
            "carry_train_dtype_weights=False",
        ),
    ),
    Run(
        "7b_rule_combine512",
        "gpt_7b",
        "rule, all-gathers and reduce-scatters combined up to 512 MiB",
        xla_flags=_LARGER_COMBINES,
    ),
)


def _one_gpu(name: str, config: str, settings: str, *overrides: str, **kwargs) -> Run:
    kwargs.setdefault("cap_s", 240)  # An unrolled 32-layer step compiles in 1-2 minutes.
    kwargs.setdefault("global_batch", ONE_GPU_GLOBAL_BATCH)
    return Run(name, config, settings, overrides, **kwargs)


# The one-GPU candidates (--gpus=1). The rule's 12 bytes of state a parameter (86 GB for
# gpt_7b: split carried weights, bf16/fp16 EMAs, the float32 gradient sum) stay; what
# varies is how the activations of one 4,096-token sequence fit beside them.
ONE_GPU_RUNS = (
    _one_gpu("1gpu_rule", "gpt_7b", "rule: every matmul output saved, norms and activations recomputed"),
    _one_gpu(
        "1gpu_noremat",
        "gpt_7b",
        "no remat, allocator at 94% of the card",
        f"{_LAYER}.remat_spec=None",
        mem_fraction=0.94,
    ),
    _one_gpu(
        "8b_rule", "gpt_8b", "rule: matmul outputs saved, attention recomputed, allocator at 94%",
        mem_fraction=0.94,
    ),
    _one_gpu(
        "1gpu_dots",
        "gpt_7b",
        "matmul outputs saved, attention recomputed too",
        f"{_LAYER}.remat_spec={{'prevent_cse': True, 'policy': 'dots_with_no_batch_dims_saveable'}}",
    ),
    _one_gpu(
        "8b_rule_mem75", "gpt_8b", "rule, the allocator's default 75% of the card (too little)"
    ),
)

# LoRA r16 on the seven maps of a bf16 frozen base (llama_lora, llama3_lora): no weight
# gradients, so what varies is how many sequences a step holds and what is recomputed.
ONE_GPU_RUNS += (
    _one_gpu("lora_config", "llama_lora", "config: 4 sequences, nothing recomputed", global_batch=4, cap_s=150),
    _one_gpu(
        "lora_b8_ub4", "llama_lora", "8 sequences in 2 microbatches of 4, allocator at 94%",
        "per_device_microbatch_size=4", mem_fraction=0.94, cap_s=150,
    ),
    _one_gpu("lora3_config", "llama3_lora", "config: 4 sequences, nothing recomputed", global_batch=4, cap_s=150),
)

# The table: (title, result key, format).
TABLE = (
    ("run", "name", "{}"),
    ("config", "config", "{}"),
    ("tokens/s/GPU", "tokens_per_s_per_device", "{:,.0f}"),
    ("MFU", "mfu_percent", "{:.1f}%"),
    ("s/step", "avg_step_time_s", "{:.3f}"),
    ("peak GiB", "peak_memory_gib", "{:.1f}"),
    ("mem %", "memory_percent", "{:.0f}"),
    ("compile s", "compile_s", "{:.0f}"),
    ("wall s", "wall_s", "{:.0f}"),
    ("ubatches", "microbatches_per_step", "{:.0f}"),
    ("settings", "settings", "{}"),
)


def run_overrides(run: Run) -> list[str]:
    """The run's config overrides: its batch, then its own."""
    return [f"input.global_batch_size={run.global_batch}", *run.overrides]


def resolve_best(run: Run, results: Sequence[dict[str, Any]]) -> Optional[Run]:
    """`run` with the overrides and XLA flags of the fastest finished run of `run.best_of`
    (None if none finished); a run without `best_of` as it is."""
    if run.best_of is None:
        return run
    finished = [
        r for r in results if r.get("config") == run.best_of and r.get("tokens_per_s_per_device")
    ]
    if not finished:
        return None
    best = max(finished, key=lambda r: r["tokens_per_s_per_device"])
    return dataclasses.replace(
        run,
        overrides=tuple(best["overrides"][1:]),  # Less the batch, which run_overrides adds.
        xla_flags=best["xla_flags"],
        settings=f"{run.settings}: {best['name']}",
    )


def format_row(result: dict[str, Any]) -> list[str]:
    cells = []
    for _, key, fmt in TABLE:
        value = result.get(key)
        try:
            cells.append("-" if value is None else fmt.format(value))
        except (ValueError, TypeError):
            cells.append(str(value))
    return cells


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """One line per run: the columns of TABLE, and a run's error in place of its numbers."""
    rows = [[title for title, _, _ in TABLE]] + [format_row(r) for r in results]
    widths = [max(len(r[i]) for r in rows) for i in range(len(TABLE))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    for result in results:
        if result.get("error"):
            lines.append(f"{result['name']}: {result['error']}")
    return "\n".join(lines)


def _child(spec_path: str, out_path: str) -> None:
    """Runs one benchmark in this process (the parent's child) and writes its result."""
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    # Stopped at its cap, the run first prints where each thread is (compiling, stepping).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # jax reads XLA_FLAGS when its backend starts, inside run_benchmark after the preset.
    import jax  # pylint: disable=import-outside-toplevel

    compile_s = [0.0]

    def on_event(event: str, duration_secs: float, **_):
        if event in _COMPILE_EVENTS:
            compile_s[0] += duration_secs

    jax.monitoring.register_event_duration_secs_listener(on_event)
    from axlearn.bench import run_benchmark  # pylint: disable=import-outside-toplevel

    result = run_benchmark(
        config=spec["config"], module=None, mesh_selector=spec["mesh_selector"],
        data_dir="FAKE", overrides=spec["overrides"], steps=spec["steps"],
        warmup_steps=spec["warmup_steps"],
    )
    result["compile_s"] = compile_s[0]
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f)


def run_one(run: Run, *, timeout_s: float, mesh_selector: str) -> dict[str, Any]:
    """Benchmarks `run` in a child process stopped after `timeout_s`; its result, or its
    error, with the run's name, settings and wall time."""
    overrides = run_overrides(run)
    record = {
        "name": run.name, "config": run.config, "settings": run.settings,
        "overrides": overrides, "xla_flags": run.xla_flags,
    }
    tmp = tempfile.mkdtemp(prefix="sweep-")
    spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(
            {"config": run.config, "mesh_selector": mesh_selector, "overrides": overrides,
             "steps": STEPS, "warmup_steps": WARMUP_STEPS},
            f,
        )
    env = dict(os.environ)
    if run.mem_fraction is not None:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(run.mem_fraction)
    if run.xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {run.xla_flags}".strip()
    start = time.perf_counter()
    # A session of its own, so that a timeout stops the child's own children too.
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), f"--_child={spec_path},{out_path}"],
        env=env, start_new_session=True,
    )
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGUSR1)  # Its threads' stacks, to its stderr.
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    record["wall_s"] = time.perf_counter() - start
    if code is None:
        record["error"] = f"stopped after {timeout_s:.0f} s (compile or steps did not finish)"
    elif code != 0 or not os.path.exists(out_path):
        record["error"] = f"exited with {code} (its log above)"
    else:
        with open(out_path, encoding="utf-8") as f:
            result = json.load(f)
        result.pop("losses", None)
        record = {**result, **record}
    return record


def check_runs(runs: Sequence[Run], mesh_selector: str) -> None:
    """Builds every run's config (no device): a bad name or override fails before any run."""
    from axlearn.bench import build_benchmark_config  # pylint: disable=import-outside-toplevel

    for run in runs:
        if run.best_of is not None:
            run = dataclasses.replace(run, config=run.best_of)  # Checked with those overrides.
        try:
            build_benchmark_config(run.config, mesh_selector=mesh_selector, overrides=run_overrides(run))
        except ValueError as e:
            raise SystemExit(f"sweep_7b: run {run.name!r}: {e}") from e
    for run in runs:
        if run.best_of is not None:  # The same overrides on the FP8 config.
            for other in runs:
                if other.config == run.best_of:
                    try:
                        build_benchmark_config(
                            run.config, mesh_selector=mesh_selector, overrides=run_overrides(other)
                        )
                    except ValueError as e:
                        raise SystemExit(
                            f"sweep_7b: run {run.name!r} with {other.name!r}'s settings: {e}"
                        ) from e


def define_flags(flag_values: flags.FlagValues) -> None:
    """The sweep's flags."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_enum(
        "gpus", "4", ["4", "1"], "The host: 4 GPUs (RUNS) or one (ONE_GPU_RUNS).", **fv
    )
    flags.DEFINE_float("budget_s", 530, "Wall-clock budget of all runs.", **fv)
    flags.DEFINE_float("min_run_s", 90, "Skip a run with less left.", **fv)
    flags.DEFINE_list("only", None, "Comma-separated run names (default: all).", **fv)
    flags.DEFINE_string(
        "mesh_selector", None,
        f"The mesh rule the runs take (default: {MESH_SELECTOR}, or {ONE_GPU_MESH_SELECTOR} "
        "with --gpus=1).", **fv,
    )
    flags.DEFINE_string("json_out", None, "Write every run's result here.", **fv)
    flags.DEFINE_bool("dry_run", False, "Check the configs; run nothing.", **fv)
    flags.DEFINE_string(
        "_child", None, "Internal: 'spec_path,out_path' of one run, run in this process.", **fv
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line `argv` (None: sys.argv's) run; returns the exit status."""
    program = "tools/sweep_7b.py"
    args, _ = parse_command_flags(
        define_flags, argv, program=program, doc=f"usage: sweep_7b.py [flags]\n\n{__doc__}"
    )
    if args._child:  # pylint: disable=protected-access
        _child(*args._child.split(","))  # pylint: disable=protected-access
        return 0
    planned = RUNS if args.gpus == "4" else ONE_GPU_RUNS
    mesh_selector = args.mesh_selector or (
        MESH_SELECTOR if args.gpus == "4" else ONE_GPU_MESH_SELECTOR
    )
    runs = list(planned)
    if args.only:
        names = args.only
        unknown = sorted(set(names) - {r.name for r in planned})
        if unknown:
            usage_error(
                program,
                f"--only: unknown runs {unknown} for --gpus={args.gpus}; known: "
                f"{[r.name for r in planned]}",
            )
        runs = [r for r in planned if r.name in names]
    check_runs(runs, mesh_selector)
    if args.dry_run:
        for run in runs:
            xla_flags = f" XLA_FLAGS+={run.xla_flags}" if run.xla_flags else ""
            if run.mem_fraction is not None:
                xla_flags += f" XLA_PYTHON_CLIENT_MEM_FRACTION={run.mem_fraction}"
            best = f" (settings of the fastest {run.best_of} run)" if run.best_of else ""
            print(f"{run.name}: {run.config} {' '.join(run_overrides(run))}{xla_flags}{best}, cap {run.cap_s} s")
        return 0
    deadline = time.perf_counter() + args.budget_s
    results: list[dict[str, Any]] = []
    queue = list(runs)
    while queue:
        run = queue.pop(0)
        left = deadline - time.perf_counter()
        resolved = resolve_best(run, results)
        skipped = None
        if resolved is None:
            later = [i for i, other in enumerate(queue) if other.config == run.best_of]
            if later:  # Waits for the next run of its base config.
                queue.insert(later[0] + 1, run)
                continue
            skipped = f"skipped: no {run.best_of} run finished"
        elif left < args.min_run_s:
            skipped = f"skipped: {left:.0f} s of the budget left"
        if skipped:
            results.append(
                {"name": run.name, "config": run.config, "settings": run.settings, "error": skipped}
            )
        else:
            results.append(
                run_one(resolved, timeout_s=min(run.cap_s, left), mesh_selector=mesh_selector)
            )
        print("SWEEP " + " | ".join(format_row(results[-1])), flush=True)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
