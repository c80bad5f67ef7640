"""Building blocks of GPT experiments: inputs, model, learner, evalers, mesh rules.

Experiment modules (`experiments/*.py`) call these with a few numbers per size; every
choice that is not a size lives here, once. This file must stay importable without
TensorFlow: TensorFlow is only imported when a built tf.data source is called.
"""

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any, Optional, Union

import jax.numpy as jnp

from axlearn.common.attention import (
    FusedGroupedQKVLinear,
    GroupedQueryAttention,
    RepeatedTransformerLayer,
    RoFormerQKVLinear,
    ScaleKey,
    ScaleQuery,
    StackedTransformerLayer,
    TransformerLayer,
)
from axlearn.common.causal_lm import Model
from axlearn.common.checkpointer import (
    Checkpointer,
    TensorStoreStateStorage,
    every_n_steps_and_last_policy,
)
from axlearn.common.config import (
    ConfigBase,
    ConfigError,
    config_for_function,
    register_configurable,
)
from axlearn.common.decoder import Decoder
from axlearn.common.evaler import ModelSummaryAccumulator, SpmdEvaler, every_n_steps_policy
from axlearn.common.input_tf_data import (
    BuildDatasetFn,
    Input,
    batch,
    default_pad_example_fn,
    identity,
    lm_text_processor,
    tfds_dataset,
)
from axlearn.common.layers import Linear, RMSNorm, scaled_hidden_dim
from axlearn.common.learner import Learner
from axlearn.common.metrics import MetricAccumulator
from axlearn.common.optimizers import (
    adastar_optimizer,
    cast_optimizer_state,
    muon_optimizer,
    param_ema,
    per_param_scale_by_path,
    scale_update_per_param,
    skip_and_clip_by_global_norm,
)
from axlearn.common.param_init import DefaultInitializer, WeightInitializer
from axlearn.common.schedule import cosine_with_linear_warmup, warmup_stable_decay
from axlearn.common.summary_writer import SummaryWriter
from axlearn.common.trainer import SpmdTrainer
from axlearn.common.trainer_config_modifier import (
    ChainConfigModifier,
    MeshShapeModifier,
    ModuleConfigModifier,
    PartitionSpecModifier,
    RematSpecModifier,
    TrainerFieldsModifier,
)
from axlearn.experiments.text.common import vocab


@register_configurable
def tfds_input(
    *,
    dataset_name: str,
    split: str,
    max_sequence_length: int,
    replace_newlines_with: Optional[str],
    train_shuffle_buffer_size: int,
    vocab_cfg: Any,
    is_training: bool,
    data_dir: Optional[str] = None,
    seed: Optional[int] = None,
) -> BuildDatasetFn:
    """A source of packed LM examples from a TFDS text dataset (feature 'text').

    Documents are read with `tfds_dataset` (shuffled with `train_shuffle_buffer_size`
    and repeated when training), tokenized with `vocab_cfg` after replacing newlines
    with `replace_newlines_with` (None: kept) and packed into examples of
    `max_sequence_length` tokens as `axlearn.common.input_packing` specifies.
    `data_dir`: the TFDS data directory (None: TFDS's default); `seed`: shuffling seed
    (None: 0).
    """
    source = tfds_dataset(
        dataset_name,
        split=split,
        is_training=is_training,
        train_shuffle_buffer_size=train_shuffle_buffer_size,
        data_dir=data_dir,
        seed=seed,
    )
    processor = lm_text_processor(
        vocab_cfg=vocab_cfg,
        max_sequence_length=max_sequence_length,
        is_training=is_training,
        replace_newlines_with=replace_newlines_with,
    )

    def build():
        return processor(source())

    return build


# The keys of a `mixture_train_input_source` component; 'info' is free text, not read.
DATA_MIXTURE_COMPONENT_KEYS = ("name", "weight", "shuffle_buffer_size", "split", "info")


@register_configurable
def mixture_train_input_source(
    *,
    is_training: Optional[bool] = None,
    vocab_cfg: Any,
    preprocessor: ConfigBase,
    data_mixture_components: Sequence[dict[str, Any]],
    max_sequence_length: int,
    replace_newlines_with: Optional[str] = None,
    data_dir: Optional[str] = None,
    seed: Optional[int] = None,
) -> BuildDatasetFn:
    """A training source of packed LM examples mixed from several TFDS text datasets.

    Each component `{'name', 'weight', 'shuffle_buffer_size', 'split', 'info'}` is read
    with `tfds_dataset` (its split, shuffled in its buffer, repeated) and preprocessed on
    its own by `preprocessor` (e.g. `input_lm.lm_text_preprocessor`, given vocab_cfg,
    max_sequence_length and replace_newlines_with here); examples are then drawn from
    the components with probabilities proportional to their weights. `data_dir`: the
    TFDS data directory (None: TFDS's default); `seed`: seeds shuffles and draws.
    Without TensorFlow, train on token shards instead (the launcher's --data_dir).
    """
    if is_training is False:
        raise ConfigError("mixture_train_input_source is a training source (is_training=True)")
    for i, component in enumerate(data_mixture_components):
        unknown = set(component) - set(DATA_MIXTURE_COMPONENT_KEYS)
        missing = {"name", "weight", "split"} - set(component)
        if unknown or missing:
            raise ConfigError(
                f"mixture_train_input_source.data_mixture_components[{i}]: unknown keys "
                f"{sorted(unknown)}, missing keys {sorted(missing)}"
            )
    weights = [float(c["weight"]) for c in data_mixture_components]
    if not weights or min(weights) < 0 or sum(weights) <= 0:
        raise ConfigError(
            f"mixture_train_input_source: weights {weights} must be >= 0 with a positive sum"
        )
    sources = [
        tfds_dataset(
            c["name"],
            split=c["split"],
            is_training=True,
            train_shuffle_buffer_size=c.get("shuffle_buffer_size") or 0,
            data_dir=data_dir,
            seed=seed,
        )
        for c in data_mixture_components
    ]
    process = preprocessor.clone(
        vocab_cfg=vocab_cfg,
        max_sequence_length=max_sequence_length,
        replace_newlines_with=replace_newlines_with,
    ).instantiate()

    def build():
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        datasets = [process(source()) for source in sources]
        if len(datasets) == 1:
            return datasets[0]
        probabilities = [w / sum(weights) for w in weights]
        return tf.data.Dataset.sample_from_datasets(datasets, probabilities, seed=seed or 0)

    return build


# ----- mesh -----

MESH_AXIS_NAMES = ("pipeline", "data", "expert", "fsdp", "seq", "model")
# Mesh axes the global batch is split over, and those that shard parameters (FSDP).
BATCH_AXIS_NAMES = ("data", "expert", "fsdp", "seq")
MODEL_BATCH_AXIS_NAMES = ("data", "expert", "fsdp")
FSDP_AXIS_NAMES = ("expert", "fsdp", "seq")
# Activations [batch, seq, dim-like]: batch over the data-parallel axes, seq, then model.
ACTIVATION_PARTITION_SPEC = (MODEL_BATCH_AXIS_NAMES, "seq", "model")


@register_configurable
def scale_fn(
    input_dim: Optional[int] = None, *, scale: float, round_up_to_multiples_of: int = 1
) -> int:
    """A feed-forward hidden_dim as AXLearn's configs give it: input_dim * scale rounded up
    to a multiple of `round_up_to_multiples_of`. The layer fills in input_dim."""
    if input_dim is None:
        raise ConfigError("scale_fn: input_dim is set by the feed-forward layer; got None")
    return scaled_hidden_dim(scale, round_up_to_multiples_of)(input_dim)


def mesh_shape_from_axes(
    *,
    pipeline: int = 1,
    data: int = 1,
    expert: int = 1,
    fsdp: int = 1,
    seq: int = 1,
    model: int = 1,
) -> tuple[int, ...]:
    """A mesh shape over MESH_AXIS_NAMES; one axis may be -1 (all remaining devices)."""
    return (pipeline, data, expert, fsdp, seq, model)


# ----- model -----


def weight_init_config(fan: str) -> DefaultInitializer.Config:
    """Weights (`*weight`) drawn from normal(0, 1 / `fan`); other parameters by default."""
    return DefaultInitializer.default_config().set(
        init_by_param_name={
            ".*weight$": WeightInitializer.default_config().set(
                distribution="normal", fan=fan, scale=1.0
            )
        }
    )


def rms_norm_config(eps: float) -> RMSNorm.Config:
    """An RMSNorm of epsilon `eps`."""
    # forward_dtype None: normalize in the compute dtype (bf16 under train_dtype).
    return RMSNorm.default_config().set(eps=eps, forward_dtype=None)


def untied_lm_head() -> Linear.Config:
    """An LM head of its own, as Llama 3's (weight [dim, vocab], no bias: the layout
    hf_llama maps to `lm_head.weight`), split over the FSDP axes along dim and the
    vocabulary over 'model'."""
    return Linear.default_config().set(bias=False, param_partition_spec=(FSDP_AXIS_NAMES, "model"))


def model_config(
    *,
    dim: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    hidden_dim: int,
    vocab_size: int,
    activation: Union[str, Sequence[str]] = ("nn.silu", "linear"),
    rope_theta: float = 500000.0,
    qk_norm: bool = True,
    norm_eps: float = 1e-5,
    z_loss_scale: float = 1e-6,
    remat_spec: Optional[dict[str, Any]] = None,
    stack: str = "repeat",
    lm_head: Optional[ConfigBase] = None,
    logits_soft_cap: Optional[float] = None,
    extra_ffn_summaries: bool = True,
    attend_across_documents: Optional[bool] = None,
) -> Model.Config:
    """A decoder-only LM: RoPE, grouped-query attention (fused QKV), optional QK-norm,
    gated or plain MLP, RMSNorm pre-norm, tied embeddings unless `lm_head` is given.

    `stack`: 'repeat' (layers under jax.lax.scan; fast compiles) or 'stack' (unrolled).
    `attend_across_documents`: see causal_lm.Model.Config (True lets cuDNN's flash
    attention run unmasked on packed rows, which is faster).
    `remat_spec`: per-layer rematerialization (None: none; `attention.build_remat_spec()`
    saves the attention projections and context and recomputes the MLP).
    """
    layer = TransformerLayer.default_config()
    layer.self_attention.set(
        attention=_attention_config(
            num_heads=num_heads, num_kv_heads=num_kv_heads, rope_theta=rope_theta,
            qk_norm=qk_norm, norm_eps=norm_eps,
        ),
        norm=rms_norm_config(norm_eps),
        structure="prenorm",
    )
    _set_feed_forward(
        layer.feed_forward, activation=activation, hidden_dim=hidden_dim, norm_eps=norm_eps,
        extra_summaries=extra_ffn_summaries,
    )
    layer.remat_spec = remat_spec
    decoder = Decoder.default_config().set(
        attention_mask=None,  # Causal masking happens inside attention (causal=True).
        dim=dim,
        dropout_rate=0.0,
        eos_token_id=1,
        pad_token_id=0,
        vocab_size=vocab_size,
        logits_partition_spec=ACTIVATION_PARTITION_SPEC,
        output_norm=rms_norm_config(norm_eps),
        transformer=_layer_stack(layer, stack=stack, num_layers=num_layers),
        lm_head=lm_head,
        logits_soft_cap=logits_soft_cap,
    )
    decoder.emb.token_emb.set(
        param_init=weight_init_config("fan_out"), param_partition_spec=(FSDP_AXIS_NAMES, "model")
    )
    return Model.default_config().set(
        batch_axis_names=MODEL_BATCH_AXIS_NAMES,
        seq_axis_names=("seq",),
        decoder=decoder,
        dtype=jnp.float32,
        param_init=weight_init_config("fan_in"),
        z_loss_scale=z_loss_scale,
        attend_across_documents=attend_across_documents,
    )


def _attention_config(
    *, num_heads: int, num_kv_heads: int, rope_theta: float, qk_norm: bool, norm_eps: float
) -> GroupedQueryAttention.Config:
    """model_config's causal attention: grouped-query, fused QKV under RoPE, optional
    QK-norm, no biases, weights split over the FSDP and model axes."""
    qkv = FusedGroupedQKVLinear.default_config().set(
        cache_dtype=jnp.bfloat16, num_kv_heads=num_kv_heads
    )
    qkv.layer.set(bias=False, param_partition_spec=(FSDP_AXIS_NAMES, "model", None))
    input_linear = RoFormerQKVLinear.default_config().set(
        cache_dtype=jnp.bfloat16, input_linear=qkv, rotary_value=False
    )
    input_linear.rope_pos_emb_layer.theta = rope_theta
    attention = GroupedQueryAttention.default_config().set(
        causal=True, num_heads=num_heads, input_linear=input_linear
    )
    attention.output_linear.set(bias=False, param_partition_spec=(FSDP_AXIS_NAMES, "model", None))
    if qk_norm:
        attention.query_scale = ScaleQuery.default_config().set(norm=rms_norm_config(norm_eps))
        attention.key_scale = ScaleKey.default_config().set(norm=rms_norm_config(norm_eps))
    return attention


def _set_feed_forward(
    ffn: ConfigBase,
    *,
    activation: Union[str, Sequence[str]],
    hidden_dim: int,
    norm_eps: float,
    extra_summaries: bool,
) -> None:
    """model_config's MLP, set on the layer's `ffn`: pre-norm, no biases, activations in
    ACTIVATION_PARTITION_SPEC; `extra_summaries`: dead neurons and the output's RMS."""
    ffn.set(
        activation=activation,
        hidden_dim=hidden_dim,
        norm=rms_norm_config(norm_eps),
        residual_weight=1.0,
        structure="prenorm",
    )
    if extra_summaries:
        ffn.set(add_dead_neuron_summary=True, add_value_rms_norm_summary=["linear2_outputs"])
    ffn.linear1.set(
        bias=False,
        output_partition_spec=ACTIVATION_PARTITION_SPEC,
        param_partition_spec=(FSDP_AXIS_NAMES, "model"),
    )
    ffn.linear2.set(
        bias=False,
        output_partition_spec=ACTIVATION_PARTITION_SPEC,
        param_partition_spec=("model", FSDP_AXIS_NAMES),
    )


def _layer_stack(layer: ConfigBase, *, stack: str, num_layers: int) -> ConfigBase:
    """`num_layers` copies of `layer`: 'repeat' (under jax.lax.scan) or 'stack' (unrolled)."""
    if stack == "repeat":
        transformer = RepeatedTransformerLayer.default_config()
    elif stack == "stack":
        transformer = StackedTransformerLayer.default_config()
    else:
        raise ValueError(f"stack must be 'repeat' or 'stack', got {stack!r}")
    return transformer.set(layer=layer, num_layers=num_layers)


# ----- learner -----

# Hidden matrices whose Adam updates are scaled down with width (muP-style).
MUP_SCALED_WEIGHTS = (
    ".*attention/o_proj/weight",
    ".*attention/i_proj/i_proj/qkv_proj/weight",
    ".*feed_forward/linear1_0/weight",
    ".*feed_forward/linear1_1/weight",
    ".*feed_forward/linear2/weight",
    ".*feed_forward/wi_0_weight",
    ".*feed_forward/wi_1_weight",
    ".*feed_forward/wo_weight",
)
MUP_BASE_DIM = 768  # The width at which the hidden-matrix scale is 1.


def adastar_learner_config(
    *,
    dim: int,
    max_step: int,
    warmup_steps: int = 5000,
    learning_rate: float = 0.01,
    weight_decay: float = 0.000316,
    alpha: float = 0.005,
    state_dtype: Optional[Any] = None,
) -> Learner.Config:
    """Adastar (Adam with update EMA and raw-update clipping) under a cosine schedule,
    with muP-style update scales and skip-on-spike global-norm clipping.

    `state_dtype`: the floating dtype Adastar's two EMAs are kept in between steps
    (`cast_optimizer_state`); or a dict of {state path regex: dtype}, one
    `cast_optimizer_state` for each, the first outermost (e.g.
    {"gradient_square_ema": jnp.bfloat16, "update_ema": jnp.float16}). None keeps them in
    float32, like the parameters.
    """
    mup_scale = min(1.0, MUP_BASE_DIM / dim)
    per_param_scale = config_for_function(per_param_scale_by_path).set(
        default_scale=1.0,
        description="scale_by_mup_simple",
        scale_by_path=[(regex, mup_scale) for regex in MUP_SCALED_WEIGHTS],
    )
    inner = config_for_function(adastar_optimizer).set(
        learning_rate=learning_rate,
        gradient_ema_decay=None,
        gradient_ema_debias=None,
        gradient_square_ema_decay=0.95,
        gradient_square_ema_debias=True,
        eps=0,
        eps_square=1e-30,
        raw_update_clipping_threshold=1.0,
        update_ema_decay=0.95,
        update_ema_debias=False,
        weight_decay=weight_decay,
        update_schedule=config_for_function(cosine_with_linear_warmup).set(
            peak_lr=1.0, max_step=max_step, warmup_steps=warmup_steps, begin_value=0.0, alpha=alpha
        ),
        adam_update_transformation=config_for_function(scale_update_per_param).set(
            per_param_scale=per_param_scale
        ),
        verbosity=0,
    )
    if isinstance(state_dtype, dict):
        for state_paths, dtype in reversed(state_dtype.items()):
            inner = config_for_function(cast_optimizer_state).set(
                inner=inner, dtype=dtype, state_paths=state_paths
            )
    elif state_dtype is not None:
        inner = config_for_function(cast_optimizer_state).set(inner=inner, dtype=state_dtype)
    optimizer = config_for_function(skip_and_clip_by_global_norm).set(
        inner=inner, drop_norm=100, max_norm=1, eps=1e-08
    )
    return Learner.default_config().set(
        optimizer=optimizer,
        ema=config_for_function(param_ema),
        enable_per_variable_summaries=False,
    )


def muon_learner_config(
    *,
    max_step: int,
    learning_rate: float = 0.02,
    adam_learning_rate: float = 0.008,
    warmup_steps: int = 0,
    weight_decay: float = 0.0,
) -> Learner.Config:
    """Muon for hidden matrices, AdamW for embeddings, norms and the rest, with a
    warmup-stable-decay schedule on both (the speedrun recipe)."""

    def schedule(peak_lr: float) -> ConfigBase:
        return config_for_function(warmup_stable_decay).set(
            peak_lr=peak_lr, max_step=max_step, warmup_steps=warmup_steps, decay_steps=0.4
        )

    optimizer = config_for_function(muon_optimizer).set(
        learning_rate=schedule(learning_rate),
        adamw_learning_rate=schedule(adam_learning_rate),
        weight_decay=weight_decay,
    )
    return Learner.default_config().set(
        optimizer=config_for_function(skip_and_clip_by_global_norm).set(
            inner=optimizer, drop_norm=100, max_norm=1, eps=1e-08
        ),
        ema=config_for_function(param_ema),
    )


# ----- inputs and evaluation -----


def tfds_train_input(
    *, dataset_name: str, split: str = "train", global_batch_size: int
) -> Input.Config:
    """Pre-tokenized, pre-packed examples from a TFDS dataset, read in order."""
    return Input.default_config().set(
        is_training=True,
        source=config_for_function(tfds_dataset).set(
            dataset_name=dataset_name,
            split=split,
            download=False,
            is_training=True,
            train_shuffle_buffer_size=0,
            train_shuffle_files=False,
        ),
        processor=config_for_function(identity),
        batcher=_batcher(global_batch_size),
    )


def _batcher(global_batch_size: int) -> ConfigBase:
    return config_for_function(batch).set(
        global_batch_size=global_batch_size,
        pad_example_fn=default_pad_example_fn,
        prefetch_buffer_size=-1,
    )


def tfds_text_eval_input(
    *,
    dataset_name: str,
    split: str,
    max_sequence_length: int,
    sentencepiece_model_name: str,
    global_batch_size: int,
) -> Input.Config:
    """Raw text from a TFDS dataset, tokenized and packed on the fly."""
    return Input.default_config().set(
        is_training=False,
        source=config_for_function(tfds_input).set(
            dataset_name=dataset_name,
            split=split,
            is_training=False,
            max_sequence_length=max_sequence_length,
            replace_newlines_with="<n>",
            train_shuffle_buffer_size=16384,
            vocab_cfg=config_for_function(vocab).set(
                sentencepiece_model_name=sentencepiece_model_name
            ),
        ),
        processor=config_for_function(identity),
        batcher=_batcher(global_batch_size),
    )


def evaler_config(
    *, input_cfg: ConfigBase, every_n_steps: int, max_step: int, write_every_n_steps: int = 1
) -> SpmdEvaler.Config:
    """An evaler that reports loss, perplexity and bits per byte of `input_cfg`."""
    return SpmdEvaler.default_config().set(
        eval_dtype=jnp.bfloat16,
        eval_policy=config_for_function(every_n_steps_policy).set(
            n=every_n_steps, min_step=1, max_step=max_step
        ),
        input=input_cfg,
        metric_calculator=ModelSummaryAccumulator.default_config().set(
            metric_accumulator=MetricAccumulator.default_config(), model_method="forward"
        ),
        summary_writer=SummaryWriter.default_config().set(write_every_n_steps=write_every_n_steps),
    )


# ----- trainer -----


def checkpointer_config(
    *,
    every_n_steps: int,
    max_step: int,
    keep_last_n: int = 3,
    keep_every_n_steps: Optional[int] = None,
) -> Checkpointer.Config:
    """Saves every `every_n_steps` and at `max_step`; keeps the last `keep_last_n`
    checkpoints and every `keep_every_n_steps`-th (None: no others)."""
    return Checkpointer.default_config().set(
        save_policy=config_for_function(every_n_steps_and_last_policy).set(
            n=every_n_steps, min_step=1, max_step=max_step
        ),
        storage=TensorStoreStateStorage.default_config().set(timeout_secs=3600),
        keep_last_n=keep_last_n,
        keep_every_n_steps=keep_every_n_steps,
        gc_loop_interval_seconds=60,
    )


def trainer_config(
    *,
    model: Model.Config,
    learner: Learner.Config,
    train_input: ConfigBase,
    evalers: dict[str, SpmdEvaler.Config],
    max_step: int,
    mesh_shape: Sequence[int],
    mesh_rules: Sequence[tuple[str, Any]],
    checkpointer: Checkpointer.Config,
    summary_every_n_steps: int = 100,
    name: str = "gpt_trainer",
    train_dtype: Any = jnp.bfloat16,
) -> SpmdTrainer.Config:
    return SpmdTrainer.default_config().set(
        name=name,
        model=model,
        learner=learner,
        input=train_input,
        evalers=evalers,
        checkpointer=checkpointer,
        summary_writer=SummaryWriter.default_config().set(
            max_queue=1000, write_every_n_steps=summary_every_n_steps
        ),
        max_step=max_step,
        train_dtype=train_dtype,
        mesh_axis_names=MESH_AXIS_NAMES,
        mesh_shape=tuple(mesh_shape),
        mesh_rules=list(mesh_rules),
        batch_axis_names=BATCH_AXIS_NAMES,
        save_input_iterator=True,
        start_trace_process_indices=[0],
        prune_empty_state_updates=True,
    )


# ----- mesh rules -----


@dataclasses.dataclass(frozen=True)
class Fleet:
    """Instance types `<prefix>-<size>` of one accelerator family, as mesh selectors name them."""

    prefix: str  # A regex, e.g. 'gpu-(p5.48xlarge|p4de.24xlarge|a3-highgpu-8g)'.
    sizes: tuple[int, ...]  # The sizes offered (see instance_device_count for their unit).

    def selector(self, sizes: Optional[Sequence[int]] = None) -> str:
        """The regex matching `<prefix>-<size>` for `sizes` (None: all of them)."""
        sizes = self.sizes if sizes is None else tuple(sizes)
        if not sizes:
            raise ValueError(f"Fleet {self.prefix}: no sizes to select")
        if len(sizes) == 1:
            return f"{self.prefix}-{sizes[0]}"
        return f"{self.prefix}-({'|'.join(str(s) for s in sizes)})"


# The public clouds' GPU and TPU fleets, and the single hosts lent to this project.
TPU_V4 = Fleet("tpu-v4", (256, 512, 1024))
TPU_V5E = Fleet("tpu-v5litepod", (256,))
TPU_V5P = Fleet("tpu-v5p", (1024, 2048, 4096))
GPU_H100_CLUSTER = Fleet("gpu-(p5.48xlarge|p4de.24xlarge|a3-highgpu-8g)", (64, 128, 256, 512, 1024))
GPU_A100_CLUSTER = Fleet("gpu-p4d.24xlarge", (256,))
GPU_SINGLE_HOST = Fleet("gpu-(h100|h200)", (1, 2, 4, 8))  # E.g. --mesh_selector=gpu-h100-8.
# GPU_SINGLE_HOST by card, for rules that differ by memory (80 GB, 141 GB).
GPU_H100_HOST = Fleet("gpu-h100", (1, 2, 4, 8))
GPU_H200_HOST = Fleet("gpu-h200", (1, 2, 4, 8))
CPU = "cpu(-[0-9]+)?"

# TPU v4 and v5p sizes count TensorCores; their two cores per chip form one JAX device
# (megacore). Other sizes count devices: GPUs, TPU v5e chips.
_TENSORCORES_PER_DEVICE = (("tpu-v4-", 2), ("tpu-v5p-", 2))


def instance_device_count(instance_type: str) -> Optional[int]:
    """JAX devices of a concrete instance type ('tpu-v5p-1024' -> 512, 'gpu-h100-8' -> 8);
    None when the name carries no size (e.g. 'cpu'). A TPU name with a second number is
    that many slices of the first ('tpu-v5litepod-256-4' -> 1024, AXLearn's multislice)."""
    multislice = re.fullmatch(r"(tpu-.*-[0-9]+)-([0-9]+)", instance_type)
    if multislice:
        per_slice = instance_device_count(multislice.group(1))
        return per_slice * int(multislice.group(2)) if per_slice else None
    match = re.fullmatch(r".*-([0-9]+)", instance_type)
    if not match:
        return None
    size = int(match.group(1))
    for prefix, cores in _TENSORCORES_PER_DEVICE:
        if instance_type.startswith(prefix):
            return size // cores
    return size


def batch_split(mesh_shape: Sequence[int], num_devices: int) -> Optional[int]:
    """Into how many shards `mesh_shape` on `num_devices` splits the global batch (the
    product of its BATCH_AXIS_NAMES axes); None if the shape cannot cover the devices."""
    from axlearn.common.trainer import infer_mesh_shape  # pylint: disable=import-outside-toplevel

    try:
        shape = infer_mesh_shape(mesh_shape, num_devices)
    except ConfigError:
        return None
    return math.prod(shape[MESH_AXIS_NAMES.index(axis)] for axis in BATCH_AXIS_NAMES)


def fleet_mesh_rule(
    fleet: Fleet, mesh_shape: Sequence[int], *, global_batch_size: int
) -> Optional[tuple[str, tuple[int, ...]]]:
    """(selector, mesh_shape) over the sizes of `fleet` on which the mesh resolves and the
    global batch splits evenly; None if no size qualifies (the rule is left out)."""
    sizes = []
    for size in fleet.sizes:
        split = batch_split(mesh_shape, instance_device_count(f"{fleet.prefix}-{size}"))
        if split is not None and global_batch_size % split == 0:
            sizes.append(size)
    return (fleet.selector(sizes), tuple(mesh_shape)) if sizes else None


def single_host_gpu_rule(
    remat_spec: Optional[dict[str, Any]],
    *,
    mesh_shape: Optional[Sequence[int]] = None,
    unrolled_layers: bool = False,
    carry_train_dtype_weights: bool = False,
    split_carried_weights: bool = False,
    per_device_microbatch_size: Optional[int] = None,
) -> ConfigBase:
    """The host's GPUs on `mesh_shape` (None: all in one FSDP group) with `remat_spec` on
    every transformer layer (None: no remat).

    `unrolled_layers`: run the layers unrolled instead of under jax.lax.scan: faster, as
    XLA fuses across layers and drops the scan's parameter slices and gradient updates,
    at the price of a compile time that grows with depth.

    `carry_train_dtype_weights`: the trainer keeps the bf16 weights from one step to the
    next (SpmdTrainer.Config.carry_train_dtype_weights) instead of casting them in every
    step. With unrolled layers and no remat the step holds all the casts at once anyway,
    so carrying them costs no peak memory and saves the casts.

    On a mesh whose 'model' axis is 1 (any without `mesh_shape`), linear2's weight
    [hidden, model_dim] is split over the FSDP axes along hidden instead of model_dim. On
    GPUs its gradient's reduce-scatter then splits the major dim: along model_dim, XLA
    computes the gradient transposed, and the update copies the weight and the
    optimizer's two EMAs back each step. With no tensor parallelism, hidden's 'model'
    split has nothing to keep.

    `split_carried_weights`: carry each weight as its bf16 copy and the 16 bits below it,
    the same float32 weight in 4 bytes instead of 6 (SpmdTrainer.Config.split_carried_weights);
    needs `carry_train_dtype_weights`.

    `per_device_microbatch_size`: the rows a GPU computes at once
    (SpmdTrainer.Config.per_device_microbatch_size); a cluster-sized global batch is
    accumulated over microbatches of this size. None: the whole share at once.
    """
    if mesh_shape is None:
        mesh_shape = mesh_shape_from_axes(fsdp=-1)
    modifiers = [MeshShapeModifier.default_config().set(mesh_shape=tuple(mesh_shape))]
    if unrolled_layers:
        modifiers.append(
            ModuleConfigModifier.default_config().set(
                target_config="model.decoder.transformer",
                modification=StackedTransformerLayer.default_config(),
            )
        )
        if remat_spec is not None:
            # Outside a scan, XLA's CSE would undo the recomputation unless prevented.
            remat_spec = dict(remat_spec, prevent_cse=True)
    modifiers.append(
        RematSpecModifier.default_config().set(
            remat_policies={"model.decoder.transformer.layer": remat_spec}
        )
    )
    if mesh_shape[MESH_AXIS_NAMES.index("model")] == 1:
        modifiers.append(
            PartitionSpecModifier.default_config().set(
                partition_specs={
                    "model.decoder.transformer.layer.feed_forward.linear2": {
                        "param_partition_spec": (FSDP_AXIS_NAMES, "model")
                    }
                }
            )
        )
    trainer_fields = {}
    if carry_train_dtype_weights:
        trainer_fields["carry_train_dtype_weights"] = True
    if split_carried_weights:
        if not carry_train_dtype_weights:
            raise ValueError(
                "single_host_gpu_rule: split_carried_weights needs carry_train_dtype_weights"
            )
        trainer_fields["split_carried_weights"] = True
    if per_device_microbatch_size is not None:
        trainer_fields["per_device_microbatch_size"] = per_device_microbatch_size
    if trainer_fields:
        modifiers.append(TrainerFieldsModifier.default_config().set(fields=trainer_fields))
    return ChainConfigModifier.default_config().set(config_modifiers=modifiers)
