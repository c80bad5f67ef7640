"""Mixture-of-experts GPTs: moe_test (CPU, built-in data) and moe_8x1b.

A GPT of `experiments/gpt.py` whose feed-forward layers are each replaced by
`TransformerFeedForwardDropFreeMoE` (top-k routing, no capacity, grouped matmuls): same
attention, norms, activation and per-expert hidden size as the dense layer it replaces.
The loss adds the layers' load-balancing losses (`AuxLossMetrics` over their `aux_loss`
module outputs) to the cross entropy.

`moe_8x1b` has gpt_1b's dims with 8 experts of gpt_1b's MLP each, 2 per token: 6.7B
parameters, 1.9B used per token; its model FLOPs (MFU) count those only. On one GPU host
of 4 or 8 GPUs (or two H200s) the experts are split over the GPUs ('expert' axis, expert parallelism);
`moe_8x1b_fsdp` keeps every expert on every GPU, split along the model dim as FSDP
splits a dense weight, so that no token moves (the data-parallel layout).
"""

import functools
from collections.abc import Callable
from typing import Any, Optional


from axlearn.common.attention import StackedTransformerLayer, TransformerFeedForwardLayer
from axlearn.common.causal_lm import metrics_config
from axlearn.common.mixture_of_experts import (
    DROP_ALL_BUT_AUX_LOSS,
    TopKDropFreeGating,
    TransformerFeedForwardDropFreeMoE,
)
from axlearn.common.trainer import SpmdTrainer
from axlearn.common.trainer_config_modifier import (
    ChainConfigModifier,
    MeshShapeModifier,
    ModuleConfigModifier,
    RematSpecModifier,
    ReplaceLayerConfigModifier,
    TrainerFieldsModifier,
)
from axlearn.experiments.text.gpt import common
from experiments import gpt

# The MoE layers' weights and tokens: experts over 'expert', the model dim over the other
# FSDP axes (gathered before use), tokens over the batch axes ('expert' among them).
MOE_FSDP_AXES = ("fsdp", "seq")
MOE_DIM_TO_MESH_AXIS_MAP = {
    "me": (None, None),
    "emh": ("expert", MOE_FSDP_AXES, "model"),
    "ehm": ("expert", "model", MOE_FSDP_AXES),
}
MOE_TOKEN_PARTITION_SPEC = (common.MODEL_BATCH_AXIS_NAMES, "seq", None)
# The expert weights as the grouped matmuls take them: their model dim gathered.
MOE_OUTPUT_DIM_TO_PARTITION_SPEC = {
    "bsm": MOE_TOKEN_PARTITION_SPEC,
    "emh": ("expert", None, "model"),
    "ehm": ("expert", "model", None),
}
# With experts over n GPUs, each sends another at most 1.25 times its even share of rows
# (the rest is dropped and counted): the grouped matmuls also run over a buffer's slack.
EXPERT_PARALLEL_CAPACITY = 1.25


def moe_layer(
    *, num_experts: int, num_experts_per_token: int, grouped_matmul: str
) -> TransformerFeedForwardDropFreeMoE.Config:
    """The MoE layer that replaces each dense feed-forward layer (other fields kept)."""
    return TransformerFeedForwardDropFreeMoE.default_config().set(
        num_experts=num_experts,
        grouped_matmul=grouped_matmul,
        gating=TopKDropFreeGating.default_config().set(num_experts_per_token=num_experts_per_token),
        load_balance_loss_weight=0.01,
        router_z_loss_weight=0.001,
        num_groups=1,
        dim_to_mesh_axis_map=dict(MOE_DIM_TO_MESH_AXIS_MAP),
        input_dim_to_partition_spec={"bsm": MOE_TOKEN_PARTITION_SPEC},
        output_dim_to_partition_spec=dict(MOE_OUTPUT_DIM_TO_PARTITION_SPEC),
    )


def with_moe_layers(
    cfg: SpmdTrainer.Config,
    *,
    num_experts: int,
    num_experts_per_token: int,
    grouped_matmul: str = "ragged_dot",
) -> SpmdTrainer.Config:
    """`cfg` (a GPT trainer) with MoE feed-forward layers and their auxiliary losses in the
    loss. `grouped_matmul`: see TransformerFeedForwardDropFreeMoE.Config."""
    cfg = ReplaceLayerConfigModifier.default_config().set(
        target_cls=TransformerFeedForwardLayer,
        source_config=moe_layer(
            num_experts=num_experts,
            num_experts_per_token=num_experts_per_token,
            grouped_matmul=grouped_matmul,
        ),
        exclude_keys=["dim_to_mesh_axis_map"],
    ).instantiate()(cfg)
    transformer = cfg.model.decoder.transformer
    if "repeat" in transformer.keys():
        transformer.repeat.drop_output.rules = [DROP_ALL_BUT_AUX_LOSS]
    cfg.model.metrics = metrics_config(aux_loss_regex=".*/aux_loss")
    return cfg


def single_host_rule(
    *, layout: str, microbatch: int, remat_spec: Optional[dict[str, Any]]
) -> ChainConfigModifier.Config:
    """One GPU host: layers unrolled; 'expert' layout: experts split over the GPUs;
    'fsdp' layout: experts split along the model dim."""
    if layout == "expert":
        mesh = common.mesh_shape_from_axes(expert=-1)
    elif layout == "fsdp":
        mesh = common.mesh_shape_from_axes(fsdp=-1)
    else:
        raise ValueError(f"layout must be 'expert' or 'fsdp', got {layout!r}")
    if remat_spec is not None:
        remat_spec = dict(remat_spec, prevent_cse=True)  # Unrolled: keep XLA's CSE off it.
    modifiers = [
        MeshShapeModifier.default_config().set(mesh_shape=mesh),
        ModuleConfigModifier.default_config().set(
            target_config="model.decoder.transformer",
            modification=StackedTransformerLayer.default_config(),
        ),
        RematSpecModifier.default_config().set(
            remat_policies={"model.decoder.transformer.layer": remat_spec}
        ),
        TrainerFieldsModifier.default_config().set(
            fields={"per_device_microbatch_size": microbatch}
        ),
    ]
    return ChainConfigModifier.default_config().set(config_modifiers=modifiers)


def moe_8x1b_trainer(layout: str) -> SpmdTrainer.Config:
    """gpt_1b with 8 experts, 2 per token, on the reference corpora; `layout` names where
    the experts live on a single GPU host ('expert' or 'fsdp')."""
    # On Hopper GPUs the experts multiply with grouped-GEMM kernels (XLA's ragged dot would
    # multiply by all 8 experts).
    cfg = with_moe_layers(
        gpt.gpt_trainer("1B"), num_experts=8, num_experts_per_token=2, grouped_matmul="mosaic_gpu"
    )
    cfg.model.decoder.transformer.layer.feed_forward.expert_parallel_capacity = (
        EXPERT_PARALLEL_CAPACITY
    )
    cfg.name = "moe_trainer"
    # 107 GB of float32 weights and Adam moments: a host of 4 or 8 80 GB GPUs holds them.
    # Two sequences a GPU at a time keep every activation (no recomputation) in memory.
    cluster = common.mesh_shape_from_axes(data=-1, expert=8)
    rules = [
        common.fleet_mesh_rule(fleet, cluster, global_batch_size=gpt.SIZES["1B"].global_batch_size)
        for fleet in (common.GPU_H100_CLUSTER, common.GPU_A100_CLUSTER)
    ]
    # Two H200s hold half the state each (53.5 GB) beside two sequences' activations; two
    # 80 GB H100s do not, and no single GPU holds the state.
    rules.append(
        (
            "gpu-h200-2",
            single_host_rule(layout=layout, microbatch=2, remat_spec=None),
        )
    )
    rules.append(
        (
            common.GPU_SINGLE_HOST.selector((4, 8)),
            single_host_rule(layout=layout, microbatch=2, remat_spec=None),
        )
    )
    rules.append((common.CPU, common.mesh_shape_from_axes(fsdp=-1)))
    cfg.mesh_rules = [rule for rule in rules if rule is not None]
    return cfg


def moe_test_trainer() -> SpmdTrainer.Config:
    """gpt_test with 4 experts of half its MLP width, 2 per token: trains on the Python
    standard library on the CPU in about a minute. Its batch is half gpt_test's: on the
    CPU a grouped matmul costs as much as a dense one over all the experts."""
    cfg = gpt.gpt_test_trainer().set(name="moe_test")
    for input_cfg in (cfg.input, cfg.evalers["validation"].input):
        input_cfg.global_batch_size = 8
    cfg.model.decoder.transformer.layer.feed_forward.set(
        hidden_dim=192, add_dead_neuron_summary=None, add_value_rms_norm_summary=None
    )
    return with_moe_layers(cfg, num_experts=4, num_experts_per_token=2)


def named_trainer_configs() -> dict[str, Callable[[], SpmdTrainer.Config]]:
    return {
        "moe_test": moe_test_trainer,
        "moe_8x1b": functools.partial(moe_8x1b_trainer, "expert"),
        "moe_8x1b_fsdp": functools.partial(moe_8x1b_trainer, "fsdp"),
    }


# One line each for `--list_configs`, which prints it beside the parameter count.
DESCRIPTIONS = {
    "moe_test": "A tiny byte-level mixture of experts (4 experts, 2 a token) that trains on "
    "the Python standard library in about a minute on the CPU.",
    "moe_8x1b": "gpt_1b with 8 experts, 2 a token (1.9B of 6.7B parameters active); on one host "
    "(two H200s, 4 or 8 GPUs) the experts are split over the GPUs.",
    "moe_8x1b_fsdp": "moe_8x1b with every expert on every GPU of a host, split along the "
    "model dim (FSDP): no token moves between GPUs.",
}
