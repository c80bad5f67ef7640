"""AXLearn's `c4_trainer` layout: the building blocks of the Fuji configs, field for field.

AXLearn's `c4_trainer` experiments build their trainers from these pieces: C4 inputs fed
through an `SpmdInputDispatcher`, evalers on C4's train slice and validation split, AdamW
with global-norm clipping, fused-QKV RoPE attention, and a tied-embedding decoder. With
them, `fuji.py`'s configs dump to AXLearn's golden files line for line (see
docs/golden_configs.md). The generic blocks they share with the other GPT experiments
(inputs, evalers, checkpointer, trainer, mesh axes) are in `common.py`.
"""

from collections.abc import Sequence
from typing import Any, Optional, Union

import jax.numpy as jnp
from jax.sharding import PartitionSpec

from axlearn.common.attention import (
    FusedGroupedQKVLinear,
    FusedQKVLinear,
    GroupedQueryAttention,
    MultiheadAttention,
    RoFormerQKVLinear,
    ScaleKey,
    ScaleQuery,
    TransformerLayer,
)
from axlearn.common.causal_lm import (
    AuxLossMetrics,
    CompositeLossMetrics,
    CrossEntropyLossMetrics,
    Model,
)
from axlearn.common.config import ConfigBase, config_for_function
from axlearn.common.decoder import Decoder, LmHead
from axlearn.common.evaler import SpmdEvaler
from axlearn.common.flash_attention.layer import FlashAttention
from axlearn.common.input_base import partition_by_path_rank
from axlearn.common.input_dispatch import SpmdInputDispatcher
from axlearn.common.input_lm import lm_text_preprocessor
from axlearn.common.input_tf_data import Input, default_pad_example_fn, identity, per_feed_batch
from axlearn.common.kv_cache.kv_cache import KVCache
from axlearn.common.learner import Learner
from axlearn.common.optimizers import (
    adamw_decoupled_optimizer,
    chain,
    clip_by_global_norm,
    param_ema,
)
from axlearn.common.schedule import cosine_with_linear_warmup
from axlearn.common.trainer import SpmdTrainer
from axlearn.experiments.text.common import vocab
from axlearn.experiments.text.gpt.common import (
    ACTIVATION_PARTITION_SPEC,
    FSDP_AXIS_NAMES,
    MODEL_BATCH_AXIS_NAMES,
    checkpointer_config,
    evaler_config,
    mixture_train_input_source,
    rms_norm_config,
    tfds_input,
    trainer_config,
    weight_init_config,
)


C4_DATASET = "c4/en:3.0.1"
# Eval splits of C4: a fixed slice of train, and validation.
C4_EVAL_SPLITS = {"train": "train[:8192]", "validation": "validation"}
# Sharding of cached keys and values [batch, seq, kv heads, head dim].
KV_CACHE_PARTITION_SPEC = (MODEL_BATCH_AXIS_NAMES, "seq", "model", None)


def batch_partition_spec(*trailing: Any) -> PartitionSpec:
    """A jax PartitionSpec whose leading (batch) dim splits over MODEL_BATCH_AXIS_NAMES."""
    return PartitionSpec(MODEL_BATCH_AXIS_NAMES, *trailing)


def sentencepiece_vocab_config(sentencepiece_model_name: str) -> ConfigBase:
    """A SentencePiece vocabulary by model file name (`text.common.vocab`)."""
    return config_for_function(vocab).set(sentencepiece_model_name=sentencepiece_model_name)


def dispatched_batcher_input(
    *, source: ConfigBase, is_training: bool, global_batch_size: int
) -> Input.Config:
    """An Input whose global batch of `global_batch_size` rows is read per logical feed
    (`per_feed_batch`) and laid out over the batch axes by an `SpmdInputDispatcher`, so
    that it may be smaller than the device count."""
    return Input.default_config().set(
        is_training=is_training,
        source=source,
        processor=config_for_function(identity),
        batcher=config_for_function(per_feed_batch).set(
            pad_example_fn=default_pad_example_fn, prefetch_buffer_size=-1
        ),
        input_dispatcher=SpmdInputDispatcher.default_config().set(
            global_logical_batch_size=global_batch_size, partition_spec=batch_partition_spec()
        ),
    )


def c4_train_input(
    *, vocab_cfg: ConfigBase, max_sequence_length: int, global_batch_size: int
) -> Input.Config:
    """C4's train split as a one-component mixture, tokenized and packed in windows of 128
    documents; [batch] and [batch, seq] inputs split over the batch axes and 'seq'."""
    component = dict(name=C4_DATASET, weight=1.0, shuffle_buffer_size=8192, split="train", info="")
    source = config_for_function(mixture_train_input_source).set(
        data_mixture_components=[component],
        vocab_cfg=vocab_cfg,
        preprocessor=config_for_function(lm_text_preprocessor).set(
            # Packed examples over half padding (a window's short tail) are dropped.
            max_padding_fraction=0.5,
            shuffle_buffer_size=8192,
            window_size=128,
        ),
        max_sequence_length=max_sequence_length,
        replace_newlines_with="<n>",
    )
    cfg = dispatched_batcher_input(
        source=source, is_training=True, global_batch_size=global_batch_size
    )
    cfg.input_partitioner = config_for_function(partition_by_path_rank).set(
        path_rank_to_partition={
            (None, 1): batch_partition_spec(),
            (None, 2): batch_partition_spec("seq"),
        }
    )
    return cfg


def c4_evalers(
    *,
    vocab_cfg: ConfigBase,
    max_sequence_length: int,
    global_batch_size: int,
    every_n_steps: int,
    max_step: int,
) -> dict[str, SpmdEvaler.Config]:
    """Evaluators on C4's 'train' slice and 'validation' split (C4_EVAL_SPLITS)."""
    evalers = {}
    for name, split in C4_EVAL_SPLITS.items():
        source = config_for_function(tfds_input).set(
            dataset_name=C4_DATASET,
            split=split,
            is_training=False,
            max_sequence_length=max_sequence_length,
            replace_newlines_with="\n",  # Evaluated on the text as it is.
            train_shuffle_buffer_size=16384,
            vocab_cfg=vocab_cfg,
        )
        input_cfg = dispatched_batcher_input(
            source=source, is_training=False, global_batch_size=global_batch_size
        )
        evalers[name] = evaler_config(
            input_cfg=input_cfg, every_n_steps=every_n_steps, max_step=max_step
        )
        evalers[name].summary_writer.max_queue = 1000
    return evalers


def adamw_learner_config(
    *,
    peak_lr: float,
    weight_decay: float,
    max_step: int,
    warmup_steps: int = 2000,
    alpha: float = 0.1,
    b1: float = 0.9,
    b2: float = 0.95,
    adam_update_transformation: Optional[ConfigBase] = None,
) -> Learner.Config:
    """Global-norm clipping to 1, then AdamW with decoupled weight decay under a cosine
    schedule with linear warmup (peaking at `peak_lr`, ending at alpha * peak_lr)."""
    adamw = config_for_function(adamw_decoupled_optimizer).set(
        learning_rate=peak_lr,
        b1=b1,
        b2=b2,
        eps=1e-08,
        weight_decay=weight_decay,
        update_schedule=config_for_function(cosine_with_linear_warmup).set(
            peak_lr=1.0, max_step=max_step, warmup_steps=warmup_steps, begin_value=0.0, alpha=alpha
        ),
        adam_update_transformation=adam_update_transformation,
    )
    clip = config_for_function(clip_by_global_norm).set(max_norm=1, eps=1e-08)
    return Learner.default_config().set(
        optimizer=config_for_function(chain).set(args=[clip, adamw]),
        ema=config_for_function(param_ema),
        enable_per_variable_summaries=False,
        ignore_undefined_loss=False,
    )


def attention_config(
    *,
    num_heads: int,
    num_kv_heads: Optional[int],
    rope_theta: float,
    flash_attention: bool = False,
    qk_norm: bool = False,
    norm_eps: float = 1e-5,
) -> ConfigBase:
    """Causal self-attention with RoPE and a fused QKV projection: grouped-query when
    `num_kv_heads` is set (else every head its own keys), through FlashAttention if
    `flash_attention`; a bf16 kv cache for decoding; QK-norm if `qk_norm`."""
    if flash_attention:
        attention = FlashAttention.default_config().set(
            mha_dim_to_partition_spec={
                "btnh": batch_partition_spec(None, ("seq", "model"), None),
                "bsnh": batch_partition_spec(None, ("seq", "model"), None),
                "bnts": batch_partition_spec(None, None, None),
            },
            output_dim_to_partition_spec={
                "btnh": batch_partition_spec("seq", "model", None),
                "bnts": batch_partition_spec("model", "seq", None),
            },
        )
    elif num_kv_heads:
        attention = GroupedQueryAttention.default_config()
    else:
        attention = MultiheadAttention.default_config()
    if num_kv_heads:
        qkv = FusedGroupedQKVLinear.default_config().set(num_kv_heads=num_kv_heads)
    else:
        qkv = FusedQKVLinear.default_config()
    qkv.layer.set(bias=False, param_partition_spec=(FSDP_AXIS_NAMES, "model", None))
    input_linear = RoFormerQKVLinear.default_config().set(input_linear=qkv, rotary_value=False)
    input_linear.rope_pos_emb_layer.theta = rope_theta
    attention.set(
        causal=True,
        num_heads=num_heads,
        input_linear=input_linear,
        kv_cache=KVCache.default_config().set(
            cache_dtype=jnp.bfloat16, kv_partition_spec=KV_CACHE_PARTITION_SPEC
        ),
    )
    attention.output_linear.set(bias=False, param_partition_spec=(FSDP_AXIS_NAMES, "model", None))
    if qk_norm:
        attention.query_scale = ScaleQuery.default_config().set(norm=rms_norm_config(norm_eps))
        attention.key_scale = ScaleKey.default_config().set(norm=rms_norm_config(norm_eps))
    return attention


def transformer_layer_config(
    *,
    attention: ConfigBase,
    hidden_dim: Union[int, ConfigBase],
    activation: Union[str, Sequence[str]] = ("nn.silu", "linear"),
    norm_eps: float = 1e-5,
    remat_spec: Optional[dict[str, Any]] = None,
) -> TransformerLayer.Config:
    """A pre-norm (RMSNorm) transformer layer of `attention` and a bias-free (gated)
    feed-forward layer of `hidden_dim` (or a `scale_fn` config of the model dim)."""
    layer = TransformerLayer.default_config()
    layer.self_attention.set(
        attention=attention, norm=rms_norm_config(norm_eps), structure="prenorm"
    )
    layer.feed_forward.set(
        activation=activation,
        hidden_dim=hidden_dim,
        norm=rms_norm_config(norm_eps),
        residual_weight=1.0,
        structure="prenorm",
    )
    layer.feed_forward.linear1.set(
        bias=False,
        output_partition_spec=ACTIVATION_PARTITION_SPEC,
        param_partition_spec=(FSDP_AXIS_NAMES, "model"),
    )
    layer.feed_forward.linear2.set(
        bias=False,
        output_partition_spec=ACTIVATION_PARTITION_SPEC,
        param_partition_spec=("model", FSDP_AXIS_NAMES),
    )
    layer.remat_spec = remat_spec
    return layer


def lm_loss_metrics(
    *, z_loss_scale: Optional[float] = None, aux_loss_regex: Optional[str] = None
) -> ConfigBase:
    """The loss as AXLearn's configs compose it: cross entropy ('lm', with z-loss at
    `z_loss_scale`; None: none) plus the auxiliary losses of the module outputs matching
    `aux_loss_regex` ('aux'; None: none)."""
    return CompositeLossMetrics.default_config().set(
        metrics=dict(
            lm=CrossEntropyLossMetrics.default_config().set(z_loss_scale=z_loss_scale),
            aux=AuxLossMetrics.default_config().set(aux_loss_regex=aux_loss_regex),
        )
    )


def causal_lm_config(
    *,
    dim: int,
    vocab_size: int,
    transformer: ConfigBase,
    eos_token_id: int = 1,
    pad_token_id: int = 0,
    token_emb_partition_spec: Sequence[Any] = (None, "model"),
    shared_lm_head: bool = True,
    metrics: Optional[ConfigBase] = None,
    norm_eps: float = 1e-5,
) -> Model.Config:
    """A decoder-only LM over `transformer` (a stack of layers): token embeddings, a final
    RMSNorm and tied logits (an untied `LmHead` unless `shared_lm_head`); the loss is
    `metrics` (None: `lm_loss_metrics()`)."""
    decoder = Decoder.default_config().set(
        attention_mask=None,  # Causal masking happens inside attention (causal=True).
        dim=dim,
        dropout_rate=0.0,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        vocab_size=vocab_size,
        logits_partition_spec=ACTIVATION_PARTITION_SPEC,
        output_norm=rms_norm_config(norm_eps),
        transformer=transformer,
        lm_head=None if shared_lm_head else LmHead.default_config(),
    )
    decoder.emb.token_emb.set(
        param_init=weight_init_config("fan_out"), param_partition_spec=token_emb_partition_spec
    )
    return Model.default_config().set(
        batch_axis_names=None,  # The input's partitioner shards the batch.
        decoder=decoder,
        dtype=jnp.float32,
        param_init=weight_init_config("fan_in"),
        metrics=metrics if metrics is not None else lm_loss_metrics(),
    )


def c4_trainer_config(
    *,
    model: Model.Config,
    learner: Learner.Config,
    vocab_cfg: ConfigBase,
    max_sequence_length: int,
    global_batch_size: int,
    max_step: int,
    mesh_shape: Sequence[int],
    mesh_rules: Sequence[tuple[str, Any]] = (),
    eval_every_n_steps: int = 5000,
    save_every_n_steps: int = 5000,
    keep_every_n_steps: int = 50_000,
) -> SpmdTrainer.Config:
    """A trainer on C4 (c4_train_input, c4_evalers) that saves every `save_every_n_steps`
    and keeps every `keep_every_n_steps`-th checkpoint (at most max_step apart)."""
    cfg = trainer_config(
        model=model,
        learner=learner,
        train_input=c4_train_input(
            vocab_cfg=vocab_cfg,
            max_sequence_length=max_sequence_length,
            global_batch_size=global_batch_size,
        ),
        evalers=c4_evalers(
            vocab_cfg=vocab_cfg,
            max_sequence_length=max_sequence_length,
            global_batch_size=global_batch_size,
            every_n_steps=eval_every_n_steps,
            max_step=max_step,
        ),
        max_step=max_step,
        mesh_shape=mesh_shape,
        mesh_rules=mesh_rules,
        checkpointer=checkpointer_config(
            every_n_steps=save_every_n_steps,
            max_step=max_step,
            keep_last_n=3,
            keep_every_n_steps=min(max_step, keep_every_n_steps),
        ),
    )
    # The input iterator is not checkpointed (a restart reads on from a new shuffle).
    cfg.save_input_iterator = False
    cfg.mesh_rules = list(mesh_rules) or None
    return cfg
