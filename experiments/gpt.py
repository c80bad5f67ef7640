"""GPT trainer configs: gpt_test (CPU, built-in data), 125M to 70B and gpt_8b (Llama 3 8B's
shape).

Each size is a row of numbers; everything else comes from
`axlearn.experiments.text.gpt.common`. `gpt_3b` is the reference trainer of
`golden_configs/gpt/gpt_3b.txt`.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Optional

import jax.numpy as jnp

from axlearn.common.attention import (
    PipelinedTransformerLayer,
    build_remat_spec,
    build_save_matmuls_remat_spec,
)
from axlearn.common.input_builtin import BuiltinTextInput
from axlearn.common.trainer import SpmdTrainer
from axlearn.common.trainer_config_modifier import (
    ChainConfigModifier,
    FP8ConfigModifier,
    MeshShapeModifier,
    OptimizerStateDtypeModifier,
)
from axlearn.experiments.text.gpt import common

# The corpus names of the reference configs (TFDS datasets prepared by the user).
TRAIN_DATASET = "pajama_honeycrisp_15t_202408072230"
EVAL_DATASET = "pile/openwebtext_2:1.0.0"
EVAL_SPLIT = "test[:5000]"


@dataclasses.dataclass(frozen=True)
class SingleHost:
    """How a size trains on one H100/H200 host (`--mesh_selector=gpu-h100-8`, ...).

    The GPUs hold the training state in FSDP: float32 weights and two float32 moments, and
    a float32 gradient sum while accumulating, 16 bytes a parameter. A host qualifies when
    its share of that is at most half of the allocator's default 75% of an 80 GB card
    (30 GB), leaving the other half for activations.
    """

    gpu_counts: tuple[int, ...]  # The host sizes whose GPUs hold the state (see above).
    # Sequences a GPU computes at once; a larger share of the global batch is accumulated
    # over microbatches of this size (SpmdTrainer.Config.per_device_microbatch_size).
    microbatch: int
    remat: Optional[dict[str, Any]]  # None saves everything (fastest while memory allows).
    # Where True, H200 hosts (141 GB a card) run without remat and H100s with `remat`, a
    # rule each. FP8 configs keep `remat` on both (their step without it compiles for
    # minutes).
    h200_without_remat: bool = False


# Adastar's two EMAs in 4 bytes a weight instead of 8: the second moment in bfloat16, the
# update EMA in float16 (bounded by 4.5, so in range). No measured loss cost for gpt_1b
# (gpt_1b_narrow_state, docs/performance.md).
NARROW_STATE_DTYPES = {"gradient_square_ema": jnp.bfloat16, "update_ema": jnp.float16}


@dataclasses.dataclass(frozen=True)
class OneGpu:
    """How a size whose 16 bytes a parameter no card holds trains on one GPU of `fleet`.

    The state takes 12 bytes a parameter: each weight as its bf16 copy and 16 low bits
    (4, `split_carried_weights`), Adastar's EMAs in bf16 and fp16 (4, NARROW_STATE_DTYPES)
    and the float32 gradient sum over the step's microbatches (4). gpt_7b: 7.18B
    parameters, 80.3 GiB, of the 104.9 GiB the JAX allocator takes of an H200 by default
    (75%); an H100's 59.4 GiB cannot hold it. One sequence of 4,096 tokens a microbatch;
    `remat` keeps its activations in the rest.
    """

    fleet: common.Fleet  # The card: common.GPU_H200_HOST; its rule selects `<prefix>-1`.
    remat: Optional[dict[str, Any]]  # The layers' remat_spec (None: save everything).
    microbatch: int = 1  # Sequences the GPU computes at once.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Size:
    """The numbers that distinguish one model size from another (named at every use)."""

    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    hidden_dim: int
    vocab_size: int
    sentencepiece_model_name: str
    max_sequence_length: int
    global_batch_size: int
    max_step: int
    warmup_steps: int
    single_host: Optional[SingleHost]  # None: too large for one host; clusters only.
    one_gpu: Optional[OneGpu] = None  # A one-GPU rule in compact state (OneGpu).
    untied_lm_head: bool = False  # An LM head of its own instead of the token table's.


SIZES = {
    "125M": Size(
        dim=768, num_layers=12, num_heads=12, num_kv_heads=4, hidden_dim=2048,
        vocab_size=32768, sentencepiece_model_name="bpe_32k_c4.model",
        max_sequence_length=2048, global_batch_size=512, max_step=100_000, warmup_steps=2000,
        single_host=SingleHost((1, 2, 4, 8), microbatch=32, remat=None),
    ),
    "350M": Size(
        dim=1024, num_layers=24, num_heads=16, num_kv_heads=8, hidden_dim=2816,
        vocab_size=32768, sentencepiece_model_name="bpe_32k_c4.model",
        max_sequence_length=2048, global_batch_size=512, max_step=200_000, warmup_steps=2000,
        single_host=SingleHost((1, 2, 4, 8), microbatch=16, remat=None),
    ),
    "1B": Size(
        dim=2048, num_layers=16, num_heads=16, num_kv_heads=8, hidden_dim=8192,
        vocab_size=32768, sentencepiece_model_name="bpe_32k_c4.model",
        max_sequence_length=4096, global_batch_size=1024, max_step=250_000, warmup_steps=5000,
        single_host=SingleHost((1, 2, 4, 8), microbatch=4, remat=None),
    ),
    "3B": Size(
        dim=3072, num_layers=26, num_heads=24, num_kv_heads=8, hidden_dim=8064,
        vocab_size=49152, sentencepiece_model_name="bpe_48k_honeycrisp.model",
        max_sequence_length=4096, global_batch_size=2048, max_step=750_000, warmup_steps=5000,
        single_host=None,  # The reference config keeps the mesh rules of its golden file.
    ),
    "7B": Size(
        dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, hidden_dim=14336,
        vocab_size=49152, sentencepiece_model_name="bpe_48k_honeycrisp.model",
        max_sequence_length=4096, global_batch_size=2048, max_step=750_000, warmup_steps=5000,
        single_host=SingleHost(
            (4, 8), microbatch=2, remat=build_remat_spec(), h200_without_remat=True
        ),
        # One H200: every matmul's output saved (~13 GiB a sequence), norms and activations
        # recomputed; ~96 GiB with the state and the logits.
        one_gpu=OneGpu(common.GPU_H200_HOST, remat=build_save_matmuls_remat_spec()),
    ),
    # Llama 3 / 3.1 8B's shape (untied head, vocabulary of 128,256): 8.03B parameters.
    # `--init_from_hf` fills it from such a checkpoint; train it on token shards of that
    # checkpoint's tokenizer (`--data_dir`): its reference corpora are the other sizes'.
    # Its 1.05B embedding and head parameters (89.7 GiB of state) leave too little of the
    # allocator's default 75% of an H200: its one-GPU rule, which saves the matmul outputs
    # and recomputes attention, needs XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 (113.4 GiB peak).
    "8B": Size(
        dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, hidden_dim=14336,
        vocab_size=128256, sentencepiece_model_name="bpe_48k_honeycrisp.model",
        max_sequence_length=4096, global_batch_size=2048, max_step=750_000, warmup_steps=5000,
        single_host=SingleHost(
            (8,), microbatch=2, remat=build_remat_spec(), h200_without_remat=True
        ),
        one_gpu=OneGpu(
            common.GPU_H200_HOST,
            remat={"prevent_cse": True, "policy": "dots_with_no_batch_dims_saveable"},
        ),
        untied_lm_head=True,
    ),
    # 70B's state (1.1 TB) is 140 GB a GPU on an 8-GPU host.
    "70B": Size(
        dim=8192, num_layers=80, num_heads=64, num_kv_heads=8, hidden_dim=28672,
        vocab_size=49152, sentencepiece_model_name="bpe_48k_honeycrisp.model",
        max_sequence_length=4096, global_batch_size=2048, max_step=750_000, warmup_steps=5000,
        single_host=None,
    ),
}

# The reference (3B) config's mesh rules, as its golden file records them.
REFERENCE_MESH_RULES = [
    (common.TPU_V4.selector([256]), common.mesh_shape_from_axes(fsdp=-1)),
    (common.TPU_V5E.selector(), common.mesh_shape_from_axes(data=-1, fsdp=256)),
    (common.GPU_H100_CLUSTER.selector(), common.mesh_shape_from_axes(data=-1, fsdp=8)),
    (common.GPU_A100_CLUSTER.selector(), common.mesh_shape_from_axes(data=-1, fsdp=8)),
    (common.TPU_V5P.selector(), common.mesh_shape_from_axes(data=-1)),
]

# The mesh of each cloud fleet: FSDP within a GPU host or a TPU slice, data parallel across.
FLEET_MESHES = (
    (common.TPU_V4, common.mesh_shape_from_axes(fsdp=-1)),
    (common.TPU_V5E, common.mesh_shape_from_axes(data=-1, fsdp=256)),
    (common.GPU_H100_CLUSTER, common.mesh_shape_from_axes(data=-1, fsdp=8)),
    (common.GPU_A100_CLUSTER, common.mesh_shape_from_axes(data=-1, fsdp=8)),
    (common.TPU_V5P, common.mesh_shape_from_axes(data=-1)),
)


# The GPU cluster fleet split by FP8 support: H100 hosts, and p4de.24xlarge's A100s.
FP8_CLUSTER_HOSTS = common.Fleet("gpu-(p5.48xlarge|a3-highgpu-8g)", common.GPU_H100_CLUSTER.sizes)
NON_FP8_CLUSTER_HOSTS = common.Fleet("gpu-p4de.24xlarge", common.GPU_H100_CLUSTER.sizes)

# Delayed scaling over this many steps where a config trains in FP8 (FP8ConfigModifier).
FP8_AMAX_HISTORY_LENGTH = 128


def fp8_modifier() -> FP8ConfigModifier.Config:
    """FP8 matmuls in the transformer layers, with delayed scaling: each cast depends on
    no reduction of its own step, so XLA fuses it into the op producing its input."""
    return FP8ConfigModifier.default_config().set(fp8_amax_history_length=FP8_AMAX_HISTORY_LENGTH)


def _with_fp8(rule: Optional[tuple[str, Any]]) -> Optional[tuple[str, Any]]:
    """A mesh rule that also switches to FP8: its modifier chain (or mesh shape) and then
    `fp8_modifier()`."""
    if rule is None:
        return None
    selector, value = rule
    if isinstance(value, ChainConfigModifier.Config):
        modifiers = [*value.config_modifiers, fp8_modifier()]
    else:
        mesh = MeshShapeModifier.default_config().set(mesh_shape=tuple(value))
        modifiers = [mesh, fp8_modifier()]
    return selector, ChainConfigModifier.default_config().set(config_modifiers=modifiers)


def mesh_rules(
    size: Size, *, split_carried_weights: bool = False, fp8: bool = False
) -> list[tuple[str, Any]]:
    """The cloud fleets (only the sizes that split the global batch evenly), single-host
    H100/H200 machines that hold the size (SingleHost), one GPU in compact state
    (OneGpu; not with `fp8`), and CPU.

    `split_carried_weights`: the single-host rule, where it carries the weights' bf16 copies,
    carries each weight as its copy and low bits (`common.single_host_gpu_rule`).

    `fp8`: the rules of H100 and H200 hosts also switch the transformer's matmuls to FP8
    (`fp8_modifier`); other hosts (A100, TPU, CPU) train as without it."""
    rules = []
    for fleet, shape in FLEET_MESHES:
        if fp8 and fleet == common.GPU_H100_CLUSTER:
            # The same mesh on both halves of the fleet, FP8 where the GPUs have it.
            fp8_hosts = common.fleet_mesh_rule(
                FP8_CLUSTER_HOSTS, shape, global_batch_size=size.global_batch_size
            )
            rules.append(_with_fp8(fp8_hosts))
            fleet = NON_FP8_CLUSTER_HOSTS
        rules.append(common.fleet_mesh_rule(fleet, shape, global_batch_size=size.global_batch_size))
    single_host = size.single_host
    if single_host is not None:
        hosts = [(common.GPU_SINGLE_HOST, single_host.remat)]
        if single_host.h200_without_remat and not fp8:
            hosts = [(common.GPU_H200_HOST, None), (common.GPU_H100_HOST, single_host.remat)]
        for fleet, remat in hosts:
            rule = (
                fleet.selector(single_host.gpu_counts),
                _single_host_rule(size, single_host, remat, split_carried_weights),
            )
            rules.append(_with_fp8(rule) if fp8 else rule)
    if size.one_gpu is not None and not fp8:
        rules.append((size.one_gpu.fleet.selector([1]), one_gpu_rule(size.one_gpu)))
    rules.append((common.CPU, common.mesh_shape_from_axes(fsdp=-1)))
    return [rule for rule in rules if rule is not None]


def _single_host_rule(
    size: Size, single_host: SingleHost, remat: Optional[dict[str, Any]], split: bool
) -> ChainConfigModifier.Config:
    """`size` on one host's GPUs with `remat` on every layer (None: none)."""
    unrolled = size.num_layers <= 32
    # Carried bf16 weights speed up a step that saves all activations; under remat they
    # only add memory.
    carried = unrolled and remat is None
    return common.single_host_gpu_rule(
        remat,
        unrolled_layers=unrolled,
        carry_train_dtype_weights=carried,
        split_carried_weights=carried and split,
        per_device_microbatch_size=single_host.microbatch,
    )


def one_gpu_rule(one_gpu: OneGpu) -> ChainConfigModifier.Config:
    """The size on one GPU in 12 bytes of state a parameter (OneGpu): layers unrolled,
    `one_gpu.remat` on each, weights carried as bf16 copy and low bits, Adastar's EMAs
    narrowed, `one_gpu.microbatch` sequences at a time."""
    rule = common.single_host_gpu_rule(
        one_gpu.remat,
        unrolled_layers=True,
        carry_train_dtype_weights=True,
        split_carried_weights=True,
        per_device_microbatch_size=one_gpu.microbatch,
    )
    narrow = OptimizerStateDtypeModifier.default_config().set(state_dtypes=NARROW_STATE_DTYPES)
    rule.config_modifiers = [*rule.config_modifiers, narrow]
    return rule


def gpt_trainer(
    size_name: str,
    *,
    optimizer_state_dtype: Optional[Any] = None,
    split_carried_weights: bool = False,
    fp8: bool = False,
) -> SpmdTrainer.Config:
    """The trainer of one model size on the reference corpora.

    `optimizer_state_dtype`: the dtype of the optimizer's two EMAs between steps (None:
    float32), or a dtype each (`common.adastar_learner_config`).

    `split_carried_weights`: where the GPU rule carries bf16 weight copies, carry each
    weight as its copy and low bits (`mesh_rules`): the same weights, 2 bytes a weight fewer.

    `fp8`: on H100 and H200 hosts the transformer's matmuls run in FP8 (`mesh_rules`).
    """
    size = SIZES[size_name]
    reference = size_name == "3B"
    model = common.model_config(
        dim=size.dim,
        num_layers=size.num_layers,
        num_heads=size.num_heads,
        num_kv_heads=size.num_kv_heads,
        hidden_dim=size.hidden_dim,
        vocab_size=size.vocab_size,
        remat_spec=build_remat_spec(),
        # The reference 3B config keeps what its golden file shows: per-document attention,
        # QK-norm and the MLP diagnostics. The other sizes are Llama-shaped (no QK-norm;
        # loadable with axlearn.common.hf_llama) and tuned for speed: packed rows attend
        # across documents so cuDNN runs unmasked, and no MLP diagnostic summaries.
        attend_across_documents=None if reference else True,
        qk_norm=reference,
        extra_ffn_summaries=reference,
        lm_head=common.untied_lm_head() if size.untied_lm_head else None,
    )
    eval_input = common.tfds_text_eval_input(
        dataset_name=EVAL_DATASET,
        split=EVAL_SPLIT,
        max_sequence_length=size.max_sequence_length,
        sentencepiece_model_name=size.sentencepiece_model_name,
        global_batch_size=size.global_batch_size,
    )
    return common.trainer_config(
        model=model,
        learner=common.adastar_learner_config(
            dim=size.dim,
            max_step=size.max_step,
            warmup_steps=size.warmup_steps,
            state_dtype=optimizer_state_dtype,
        ),
        train_input=common.tfds_train_input(
            dataset_name=TRAIN_DATASET, global_batch_size=size.global_batch_size
        ),
        evalers={
            "openwebtext_2": common.evaler_config(
                input_cfg=eval_input, every_n_steps=25_000, max_step=size.max_step
            )
        },
        max_step=size.max_step,
        # The reference keeps its golden file's cluster mesh; the other sizes' own mesh
        # (`--mesh_selector=none`) is FSDP over however many devices there are.
        mesh_shape=(
            common.mesh_shape_from_axes(data=-1, fsdp=8)
            if reference
            else common.mesh_shape_from_axes(fsdp=-1)
        ),
        mesh_rules=(
            REFERENCE_MESH_RULES
            if size_name == "3B"
            else mesh_rules(size, split_carried_weights=split_carried_weights, fp8=fp8)
        ),
        checkpointer=common.checkpointer_config(
            every_n_steps=5000, max_step=size.max_step, keep_last_n=3, keep_every_n_steps=5000
        ),
    )


def gpt_test_trainer() -> SpmdTrainer.Config:
    """A tiny byte-level GPT that trains on the Python standard library in about a minute
    on one CPU core; loss, bits per byte, checkpoints and summaries all appear."""
    max_step, seq_len, batch = 200, 256, 16
    model = common.model_config(
        dim=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        hidden_dim=384,
        vocab_size=384,  # The 259 byte ids, padded to a multiple of 128.
        rope_theta=10000.0,
        stack="stack",
    )

    def text_input(split: str, is_training: bool) -> BuiltinTextInput.Config:
        return BuiltinTextInput.default_config().set(
            split=split,
            is_training=is_training,
            global_batch_size=batch,
            max_sequence_length=seq_len,
            model_vocab_size=384,
        )

    cfg = common.trainer_config(
        model=model,
        learner=common.adastar_learner_config(dim=128, max_step=max_step, warmup_steps=30),
        train_input=text_input("train", True),
        evalers={
            "validation": common.evaler_config(
                input_cfg=text_input("validation", False), every_n_steps=100, max_step=max_step
            )
        },
        max_step=max_step,
        mesh_shape=common.mesh_shape_from_axes(fsdp=-1),
        mesh_rules=[(common.CPU, common.mesh_shape_from_axes(fsdp=-1))],
        checkpointer=common.checkpointer_config(
            every_n_steps=100, max_step=max_step, keep_last_n=2
        ),
        summary_every_n_steps=10,
        name="gpt_test",
        train_dtype=jnp.float32,  # bf16 is emulated (slow) on CPUs.
    )
    cfg.evalers["validation"].eval_dtype = jnp.float32
    cfg.log_every_n_steps = 25
    return cfg


def named_trainer_configs() -> dict[str, Callable[[], SpmdTrainer.Config]]:
    return {
        "gpt_test": gpt_test_trainer,
        "gpt_125m": functools.partial(gpt_trainer, "125M"),
        "gpt_350m": functools.partial(gpt_trainer, "350M"),
        "gpt_1b": functools.partial(gpt_trainer, "1B"),
        # gpt_1b carrying 8 bytes a weight instead of 14: Adastar's second moment in bfloat16,
        # its update EMA in float16 (bounded by 4.5, so in range) and each weight split exactly
        # into its bf16 copy and low bits. Faster than gpt_1b with the same validation loss.
        "gpt_1b_narrow_state": functools.partial(
            gpt_trainer,
            "1B",
            optimizer_state_dtype=NARROW_STATE_DTYPES,
            split_carried_weights=True,
        ),
        "gpt_3b": functools.partial(gpt_trainer, "3B"),
        "gpt_7b": functools.partial(gpt_trainer, "7B"),
        "gpt_8b": functools.partial(gpt_trainer, "8B"),
        "gpt_70b": functools.partial(gpt_trainer, "70B"),
        # gpt_1b and gpt_7b with their transformer matmuls in FP8 on H100 and H200 hosts.
        "gpt_1b_fp8": functools.partial(gpt_trainer, "1B", fp8=True),
        "gpt_7b_fp8": functools.partial(gpt_trainer, "7B", fp8=True),
        **_NAMED_PIPELINE_CONFIGS,
    }


def _size_description(size_name: str) -> str:
    """A size's shape and where it trains, from its row of SIZES."""
    size = SIZES[size_name]
    where = "a cluster"
    if size.single_host is not None:
        counts = [str(n) for n in size.single_host.gpu_counts]
        hosts = counts[0] if len(counts) == 1 else f"{', '.join(counts[:-1])} or {counts[-1]}"
        where = f"{hosts} GPUs of one host, or {where}"
        if size.one_gpu is not None:
            card = size.one_gpu.fleet.prefix.removeprefix("gpu-").upper()
            where = f"one {card} (compact state), {where}"
    return (
        f"A GPT of {size.num_layers} layers of width {size.dim:,}, "
        f"{size.max_sequence_length:,}-token sequences, {size.global_batch_size:,} a step; "
        f"trains on {where}."
    )


# One line each for `--list_configs`, which prints it beside the parameter count.
DESCRIPTIONS = {
    "gpt_test": "A tiny byte-level GPT that trains on the Python standard library in about a "
    "minute on one CPU core.",
    "gpt_125m": _size_description("125M"),
    "gpt_350m": _size_description("350M"),
    "gpt_1b": _size_description("1B"),
    "gpt_1b_narrow_state": "gpt_1b in 8 bytes of state a weight instead of 14: bf16 and fp16 "
    "optimizer moments, each weight kept as its bf16 copy and low bits.",
    "gpt_3b": f"The reference trainer of golden_configs/gpt/gpt_3b.txt. {_size_description('3B')}",
    "gpt_7b": _size_description("7B"),
    "gpt_8b": f"Llama 3 8B's shape (vocabulary 128,256, untied head; --init_from_hf fills it). "
    f"{_size_description('8B')}",
    "gpt_70b": _size_description("70B"),
    "gpt_1b_fp8": "gpt_1b with the transformer's matmuls in FP8 on H100 and H200 hosts (e4m3 "
    "operands, e5m2 gradients, delayed scaling).",
    "gpt_7b_fp8": "gpt_7b with the transformer's matmuls in FP8 on H100 and H200 hosts (e4m3 "
    "operands, e5m2 gradients, delayed scaling).",
}


# ----- pipeline parallelism -----

# Sequences the pipelined 7B runs through its stages at once on one host (the trainer
# accumulates a larger global batch over such passes), and the pipeline microbatches
# they are split into: one sequence each, so the bubble is 3 of 19 iterations.
PIPELINE_7B_ROWS = 16
PIPELINE_7B_MICROBATCHES = 16


def pipelined(
    trainer: SpmdTrainer.Config, *, num_stages: int, num_microbatches: int
) -> SpmdTrainer.Config:
    """`trainer` with its transformer layers split into `num_stages` pipeline stages
    (attention.PipelinedTransformerLayer); the same layers, in the same order."""
    transformer = trainer.model.decoder.transformer
    trainer.model.decoder.transformer = PipelinedTransformerLayer.default_config().set(
        layer=transformer.layer,
        num_layers=transformer.num_layers,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
    )
    return trainer


def gpt_7b_pipeline_trainer() -> SpmdTrainer.Config:
    """gpt_7b in 4 pipeline stages of 8 layers: on 4 GPUs of one host each GPU holds one
    stage (with 8 GPUs, each stage is split in FSDP over 2)."""
    cfg = pipelined(
        gpt_trainer("7B"), num_stages=4, num_microbatches=PIPELINE_7B_MICROBATCHES
    )
    pipeline_mesh = common.mesh_shape_from_axes(pipeline=4, fsdp=-1)
    cfg.mesh_shape = pipeline_mesh
    cfg.mesh_rules = [
        (
            common.GPU_SINGLE_HOST.selector([4, 8]),
            common.single_host_gpu_rule(
                # No per-layer remat: each pipeline iteration already recomputes its stage
                # from the stage's input in the backward pass.
                None,
                mesh_shape=pipeline_mesh,
                per_device_microbatch_size=PIPELINE_7B_ROWS,
            ),
        ),
        (common.CPU, common.mesh_shape_from_axes(fsdp=-1)),
    ]
    return cfg


def gpt_pipeline_test_trainer() -> SpmdTrainer.Config:
    """gpt_test with 4 layers in 2 pipeline stages of 4 microbatches. Its CPU mesh rule
    keeps both stages on every device; its own mesh (`--mesh_selector=none`) puts them on
    2 device groups (pipeline=2)."""
    cfg = gpt_test_trainer()
    cfg.name = "gpt_pipeline_test"
    cfg.model.decoder.transformer.num_layers = 4
    cfg = pipelined(cfg, num_stages=2, num_microbatches=4)
    # Without a mesh rule (--mesh_selector=none), on 2, 4 or 8 devices.
    cfg.mesh_shape = common.mesh_shape_from_axes(pipeline=2, fsdp=-1)
    return cfg


_NAMED_PIPELINE_CONFIGS = {
    "gpt_pipeline_test": gpt_pipeline_test_trainer,
    "gpt_7b_pipeline": gpt_7b_pipeline_trainer,
}
DESCRIPTIONS.update(
    {
        "gpt_pipeline_test": "gpt_test with 4 layers in 2 pipeline stages (pipeline=2 on 2, 4 "
        "or 8 CPU devices with --mesh_selector=none).",
        "gpt_7b_pipeline": "gpt_7b in 4 pipeline stages (GPipe, 16 microbatches): one stage "
        "a GPU on 4 H100/H200s, FSDP over 2 within each stage on 8.",
    }
)
