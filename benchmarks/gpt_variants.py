r"""Measures named variants of a trainer config on the local accelerator, each in a
fresh process, and prints one table (the standard columns) plus GPU-kernel profiles.

    PYTHONPATH=. python benchmarks/gpt_variants.py --config=gpt_1b --mesh_selector=gpu-h100-1 \
        --variants=base,across,unrolled --config_override=input.global_batch_size=4

Variants are small, named edits of the config (see VARIANTS); they are how remat,
scan-vs-unrolled, chunked loss and attention choices were measured for docs/benchmarks.md.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from axlearn import bench
from axlearn.common.attention import StackedTransformerLayer, build_remat_spec


def _set(path):
    def apply(cfg, value):
        node = cfg
        parts = path.split(".")
        for part in parts[:-1]:
            node = getattr(node, part)
        setattr(node, parts[-1], value)
        return cfg

    return apply


def unrolled(cfg):
    """The same layers without jax.lax.scan (one HLO per layer)."""
    repeated = cfg.model.decoder.transformer
    cfg.model.decoder.transformer = StackedTransformerLayer.default_config().set(
        num_layers=repeated.num_layers, layer=repeated.layer
    )
    return cfg


def across(cfg):
    cfg.model.attend_across_documents = True
    return cfg


def remat(names_which_can_be_saved):
    def apply(cfg):
        # Outside a scan, XLA's CSE would undo the recomputation unless prevented.
        unrolled_layers = isinstance(cfg.model.decoder.transformer, StackedTransformerLayer.Config)
        cfg.model.decoder.transformer.layer.remat_spec = build_remat_spec(
            names_which_can_be_saved=names_which_can_be_saved, prevent_cse=unrolled_layers
        )
        return cfg

    return apply


def no_remat(cfg):
    cfg.model.decoder.transformer.layer.remat_spec = None
    return cfg


def no_qk_norm(cfg):
    """Llama-style attention: no RMS norm on queries and keys."""
    attention = cfg.model.decoder.transformer.layer.self_attention.attention
    attention.query_scale.norm = None
    attention.key_scale.norm = None
    return cfg


def no_ffn_summaries(cfg):
    """Drops the dead-neuron and value-RMS summaries (reductions over the MLP activations)."""
    cfg.model.decoder.transformer.layer.feed_forward.set(
        add_dead_neuron_summary=None, add_value_rms_norm_summary=None
    )
    return cfg


def chain(*fns):
    def apply(cfg):
        for fn in fns:
            cfg = fn(cfg)
        return cfg

    return apply


def chunk(size):
    def apply(cfg):
        cfg.model.loss_chunk_size = size
        return cfg

    return apply


VARIANTS = {
    "base": lambda cfg: cfg,
    "no_qk_norm": no_qk_norm,
    "no_ffn_summaries": no_ffn_summaries,
    "no_qk_norm_no_ffn_summaries": chain(no_qk_norm, no_ffn_summaries),
    "across": across,
    "unrolled": unrolled,
    "across_unrolled": chain(across, unrolled),
    "across_chunk": chain(across, chunk(1024)),
    "across_remat_proj": chain(across, remat(".*([qkvo]_proj|context)")),
    "across_remat_all": chain(across, remat(".*([qkvo]_proj|context|linear1_[01]|linear2)")),
    "across_unrolled_remat_proj": chain(across, unrolled, remat(".*([qkvo]_proj|context)")),
    "across_unrolled_remat_none_saved": chain(across, unrolled, remat(None)),
    "across_unrolled_b8": chain(across, unrolled, lambda cfg: _set("input.global_batch_size")(cfg, 8)),
    "across_unrolled_chunk": chain(across, unrolled, chunk(1024)),
    "across_noremat": chain(across, no_remat),
    "across_unrolled_noremat": chain(across, unrolled, no_remat),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--mesh_selector", default=None)
    parser.add_argument("--variants", default="base")
    parser.add_argument("--config_override", action="append", default=[])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup_steps", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out_dir", default=os.environ.get("OUT", tempfile.gettempdir()))
    parser.add_argument("--tag", default="", help="Appended to result names (e.g. an XLA flag set).")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        result = bench.run_benchmark(
            config=args.config, module=None, mesh_selector=args.mesh_selector, data_dir="FAKE",
            overrides=args.config_override, steps=args.steps, warmup_steps=args.warmup_steps,
            profile_dir=os.path.join(tempfile.gettempdir(), f"prof_{args.one}") if args.profile else None,
            modify=VARIANTS[args.one],
        )
        with open(os.path.join(args.out_dir, f"{args.config}_{args.one}{args.tag}.json"), "w", encoding="utf-8") as f:
            json.dump(result, f)
        return
    results = {}
    for name in args.variants.split(","):
        cmd = [sys.executable, __file__, f"--one={name}", *sys.argv[1:]]
        print(f"=== {name}", flush=True)
        proc = subprocess.run(cmd, check=False)
        path = os.path.join(args.out_dir, f"{args.config}_{name}{args.tag}.json")
        if proc.returncode == 0 and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                results[name + args.tag] = json.load(f)
        else:
            results[name + args.tag] = {"final_loss": None, "device": f"failed (exit {proc.returncode})"}
    print(bench.format_table(results))


if __name__ == "__main__":
    main()
