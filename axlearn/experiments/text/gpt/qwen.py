"""Qwen3 trainer configs under AXLearn's names (`qwen3-30B-A3B-bs8m-seq8k`, ...).

AXLearn's `experiments/text/gpt/qwen.py` trains Qwen3's architecture (Yang et al., 2025)
on C4 through its `c4_trainer` layout (`c4.py` here): RoPE (theta 1e6) grouped-query
FlashAttention with QK-norm (RMSNorm on each head's queries and keys), pre-norm RMSNorm
(eps 1e-6, in float32) layers whose feed-forward layers are all drop-free mixtures of
experts (`TransformerFeedForwardDropFreeMoE`, top-8 of 128 SwiGLU experts), untied
input and output embeddings, and AdamW with muP-simple update scales under a cosine
schedule. Each config's golden file equals AXLearn's own (tests/test_experiments_qwen.py).

The sizes are AXLearn's: one, 30B-A3B (Qwen3-30B-A3B's dims: 48 layers of width 2048,
32 query and 4 key/value heads of 128, 128 experts of hidden size 768, 8 a token: 30.5B
parameters, 3.3B active), at two batch shapes (`CONFIGS`).

As published, these configs add no load-balancing loss to the training loss: the 'aux'
loss metric has no `aux_loss_regex` and the scanned stack drops its module outputs (the
MoE layers' `aux_loss`). `with_aux_loss` turns it on where wanted.
"""

import functools
from collections.abc import Callable
from typing import Any, Union

import jax.numpy as jnp
from jax.sharding import PartitionSpec

from axlearn.common.attention import RepeatedTransformerLayer, TransformerLayer
from axlearn.common.causal_lm import Model
from axlearn.common.config import ConfigBase, ConfigError, config_for_function
from axlearn.common.decoder import LmHead
from axlearn.common.flash_attention import remat as flash_remat
from axlearn.common.layers import RMSNorm
from axlearn.common.mixture_of_experts import (
    DROP_ALL_BUT_AUX_LOSS,
    GMMBackend,
    TopKDropFreeGating,
    TransformerFeedForwardDropFreeMoE,
)
from axlearn.common.optimizers import per_param_scale_by_path, scale_update_per_param
from axlearn.common.trainer import SpmdTrainer
from axlearn.common.trainer_config_modifier import (
    ChainConfigModifier,
    MeshShapeModifier,
    RematSpecModifier,
    ReplaceLayerConfigModifier,
)
from axlearn.common.utils import HybridMeshShape, save_and_offload_only_these_names_regex
from axlearn.experiments.text.gpt import c4
from axlearn.experiments.text.gpt.common import (
    FSDP_AXIS_NAMES,
    MODEL_BATCH_AXIS_NAMES,
    MUP_BASE_DIM,
    MUP_SCALED_WEIGHTS,
    mesh_shape_from_axes,
)

VOCAB_SIZE = 151936
EOS_TOKEN_ID = 151645  # <|im_end|>; Qwen3 pads with it too.
PAD_TOKEN_ID = 151645
NORM_EPS = 1e-6
ROPE_THETA = 1_000_000.0
HEAD_DIM = 128
SENTENCEPIECE_MODEL = "spm_qwen3_150k.model"

# (tokens a step, sequence length) of each size's configs: 16M tokens of 32k sequences
# and 8M tokens of 8k sequences.
CONFIGS = {"30B-A3B": ((16 * 1024 * 1024, 32 * 1024), (8 * 1024 * 1024, 8 * 1024))}

# Activation names the remat policies of the mesh rules save or offload (AXLearn's
# RematRegexSavePatterns): the flash kernel's outputs, q/k/v and o projections, the
# feed-forward projections and the router's outputs.
_FLASH_CONTEXT = ".*flash_residuals"
_QKV_PROJ = ".*[kqv]_proj"
_O_PROJ = ".*o_proj"
_LINEAR1_X = ".*linear1_[01]"
_LINEAR2_X = ".*linear2(_[01])?"
_MOE_GATING = ".*gate_weights|.*gate_assignment"
_LAYER = "model.decoder.transformer.layer"


def _save_and_offload_remat(*, saved: list[str], offloaded: list[str]) -> RematSpecModifier.Config:
    policy = config_for_function(save_and_offload_only_these_names_regex).set(
        names_which_can_be_saved="|".join(saved),
        names_which_can_be_offloaded="|".join(offloaded),
        offload_src="device",
        offload_dst="pinned_host",
    )
    return RematSpecModifier.default_config().set(
        remat_policies={_LAYER: {"prevent_cse": False, "policy": policy}}
    )


def _mesh_rules() -> list[tuple[str, Any]]:
    """AXLearn's rules for 30B-A3B: TPU v5p pods (FSDP over 8, offloading to the host),
    and 64-host GPU clusters (FSDP over the 8 GPUs of a host, data across hosts;
    tokamax's grouped matmuls, which need the tokamax package)."""
    tpu = ChainConfigModifier.default_config().set(
        config_modifiers=[
            MeshShapeModifier.default_config().set(
                mesh_shape=mesh_shape_from_axes(fsdp=8, data=-1)
            ),
            _save_and_offload_remat(
                saved=[_FLASH_CONTEXT], offloaded=[_QKV_PROJ, _LINEAR1_X, _MOE_GATING]
            ),
        ]
    )
    gpu = ChainConfigModifier.default_config().set(
        config_modifiers=[
            MeshShapeModifier.default_config().set(
                mesh_shape=HybridMeshShape(
                    ici_mesh_shape=mesh_shape_from_axes(fsdp=8),
                    dcn_mesh_shape=mesh_shape_from_axes(data=-1),
                )
            ),
            _save_and_offload_remat(
                saved=[_FLASH_CONTEXT, _QKV_PROJ, _O_PROJ, _LINEAR1_X, _LINEAR2_X, _MOE_GATING],
                offloaded=[],
            ),
            ReplaceLayerConfigModifier.default_config().set(
                target_cls=TransformerFeedForwardDropFreeMoE,
                source_config=TransformerFeedForwardDropFreeMoE.default_config().set(
                    gmm_backend=GMMBackend.TOKAMAX, tokamax_implementation=["triton", "xla"]
                ),
                exclude_keys=["gmm_backend", "tokamax_implementation"],
            ),
        ]
    )
    return [
        ("tpu-v5p-(1024|2048)", tpu),
        ("gpu-(p6-b200.48xlarge|p5.48xlarge|p4de.24xlarge|a3-highgpu-8g)-512", gpu),
    ]


def _norm() -> RMSNorm.Config:
    return RMSNorm.default_config().set(eps=NORM_EPS, forward_dtype=jnp.float32)


def _batch_spec(*trailing: Any) -> PartitionSpec:
    return PartitionSpec(MODEL_BATCH_AXIS_NAMES, *trailing)


def moe_layer(
    *, dim: int, hidden_dim: int, num_experts: int, num_experts_per_token: int
) -> TransformerFeedForwardDropFreeMoE.Config:
    """Qwen3's expert layer: SwiGLU experts, top-k softmax routing renormalized over the
    chosen experts, experts over 'expert' and their model dim over FSDP."""
    return TransformerFeedForwardDropFreeMoE.default_config().set(
        input_dim=dim,
        hidden_dim=hidden_dim,
        num_experts=num_experts,
        num_groups=1,
        activation=("nn.silu", "linear"),
        norm=_norm(),
        structure="prenorm",
        residual_weight=1.0,
        dim_to_mesh_axis_map={
            "me": PartitionSpec(None, None),
            "emh": PartitionSpec("expert", ("fsdp", "seq"), "model"),
            "ehm": PartitionSpec("expert", "model", ("fsdp", "seq")),
        },
        input_dim_to_partition_spec={"bsm": _batch_spec("seq", None)},
        output_dim_to_partition_spec={
            "bsm": _batch_spec("seq", "model"),
            "emh": PartitionSpec("expert", None, "model"),
            "ehm": PartitionSpec("expert", "model", None),
        },
        gating=TopKDropFreeGating.default_config().set(
            num_experts_per_token=num_experts_per_token, train_capacity_factor=0
        ),
        load_balance_loss_weight=1e-3,
        tiling=(128, 512, 512),
    )


def attention_config(*, num_heads: int, num_kv_heads: int) -> ConfigBase:
    """Qwen3's attention: grouped-query FlashAttention of 128-wide heads with RoPE and
    QK-norm, its inputs, output and projection sharded over the batch, 'seq' and 'model'."""
    attention = c4.attention_config(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        rope_theta=ROPE_THETA,
        flash_attention=True,
    )
    attention.set(
        hidden_dim=num_heads * HEAD_DIM,
        o_partition_spec=(MODEL_BATCH_AXIS_NAMES, "seq", "model"),
        tpu_block_size=2048,
        backend_overrides=dict(splash_use_fused_bwd_kernel=True),
    )
    attention.kv_cache.cache_dtype = None
    attention.query_scale.norm = _norm()
    attention.key_scale.norm = _norm()
    return attention


def model_config(
    *,
    num_layers: int,
    dim: int,
    num_heads: int,
    num_kv_heads: int,
    num_experts: int,
    moe_hidden_dim: int,
    num_experts_per_token: int,
    vocab_size: int = VOCAB_SIZE,
) -> Model.Config:
    """A Qwen3-MoE decoder: every layer's feed-forward layer a drop-free MoE."""
    layer = TransformerLayer.default_config()
    layer.self_attention.set(
        attention=attention_config(num_heads=num_heads, num_kv_heads=num_kv_heads),
        norm=_norm(),
        structure="prenorm",
    )
    layer.feed_forward = moe_layer(
        dim=dim,
        hidden_dim=moe_hidden_dim,
        num_experts=num_experts,
        num_experts_per_token=num_experts_per_token,
    )
    layer.remat_spec = {"prevent_cse": False, "policy": flash_remat.policy}
    model = c4.causal_lm_config(
        dim=dim,
        vocab_size=vocab_size,
        transformer=RepeatedTransformerLayer.default_config().set(
            layer=layer, num_layers=num_layers
        ),
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        token_emb_partition_spec=("model", FSDP_AXIS_NAMES),
        shared_lm_head=False,
        metrics=c4.lm_loss_metrics(z_loss_scale=1e-6),
        norm_eps=NORM_EPS,
    )
    decoder = model.decoder
    decoder.output_norm = _norm()
    decoder.emb.token_emb.output_partition_spec = (MODEL_BATCH_AXIS_NAMES, "seq", None)
    decoder.lm_head = LmHead.default_config().set(param_partition_spec=("model", FSDP_AXIS_NAMES))
    model.batch_axis_names = MODEL_BATCH_AXIS_NAMES
    return model


def learner_config(*, dim: int, max_step: int, peak_lr: float, weight_decay: float, warmup: int):
    """AXLearn's AdamW (c4.adamw_learner_config) with muP-simple update scales: the hidden
    matrices' updates scaled by min(1, 768 / dim)."""
    scale = min(MUP_BASE_DIM / dim, 1.0)
    transformation = config_for_function(scale_update_per_param).set(
        per_param_scale=config_for_function(per_param_scale_by_path).set(
            default_scale=1.0,
            description="scale_by_mup_simple",
            scale_by_path=[(regex, scale) for regex in MUP_SCALED_WEIGHTS],
        )
    )
    return c4.adamw_learner_config(
        peak_lr=peak_lr,
        weight_decay=weight_decay,
        max_step=max_step,
        warmup_steps=warmup,
        alpha=1 / 200.0,
        adam_update_transformation=transformation,
    )


def with_aux_loss(cfg: SpmdTrainer.Config) -> SpmdTrainer.Config:
    """`cfg` with its MoE layers' load-balancing losses in the training loss (the scanned
    stack keeps their `aux_loss` outputs, the 'aux' metric averages them)."""
    cfg.model.decoder.transformer.repeat.drop_output.rules = [DROP_ALL_BUT_AUX_LOSS]
    cfg.model.metrics.metrics["aux"].aux_loss_regex = ".*/aux_loss"
    return cfg


def qwen_trainer(size_name: str, *, tokens_per_batch: int, max_sequence_length: int):
    """The trainer of Qwen3 `size_name` (a key of CONFIGS) at one of its batch shapes."""
    if size_name != "30B-A3B":
        raise ConfigError(f"qwen: unknown size {size_name!r}; sizes: {', '.join(CONFIGS)}")
    if (tokens_per_batch, max_sequence_length) not in CONFIGS[size_name]:
        raise ConfigError(
            f"qwen: {size_name} has no batch shape ({tokens_per_batch}, {max_sequence_length}); "
            f"shapes: {CONFIGS[size_name]}"
        )
    dim, max_step = 2048, 250_000
    model = model_config(
        num_layers=48,
        dim=dim,
        num_heads=32,
        num_kv_heads=4,
        num_experts=128,
        moe_hidden_dim=768,
        num_experts_per_token=8,
    )
    cfg = c4.c4_trainer_config(
        model=model,
        learner=learner_config(
            dim=dim, max_step=max_step, peak_lr=0.01, weight_decay=1e-4, warmup=5_000
        ),
        vocab_cfg=c4.sentencepiece_vocab_config(SENTENCEPIECE_MODEL),
        max_sequence_length=max_sequence_length,
        global_batch_size=tokens_per_batch // max_sequence_length,
        max_step=max_step,
        mesh_shape=mesh_shape_from_axes(fsdp=8, data=-1),
        mesh_rules=_mesh_rules(),
        eval_every_n_steps=25_000,
        save_every_n_steps=5000,
        keep_every_n_steps=5000,
    )
    return cfg


def config_name(size_name: str, tokens_per_batch: int, max_sequence_length: int) -> str:
    """AXLearn's name, e.g. 'qwen3-30B-A3B-bs8m-seq8k' (8M tokens a step, 8k sequences)."""
    return (
        f"qwen3-{size_name}-bs{tokens_per_batch // 1024 // 1024}m"
        f"-seq{max_sequence_length // 1024}k"
    )


def descriptions() -> dict[str, str]:
    """One line per registered config (for `--list_configs`)."""
    return {
        config_name(size, tokens, seq_len): (
            f"AXLearn's Qwen3 {size} MoE on C4 (128 experts, 8 a token): "
            f"{seq_len:,}-token sequences, {tokens // seq_len:,} a step."
        )
        for size, shapes in CONFIGS.items()
        for tokens, seq_len in shapes
    }


def named_trainer_configs() -> dict[str, Callable[[], SpmdTrainer.Config]]:
    return {
        config_name(size, tokens, seq_len): functools.partial(
            qwen_trainer, size, tokens_per_batch=tokens, max_sequence_length=seq_len
        )
        for size, shapes in CONFIGS.items()
        for tokens, seq_len in shapes
    }
