"""The Fuji family: Llama-shaped GPTs trained on C4, as AXLearn's `c4_trainer`
experiments define them, so that their golden files read the same here.

A config is a function of a model size ('test', '1B', '3B', '7B', '8B', '70B') and a
version (V1, V2, V3: Llama 1, 2 and 3 recipes), with variants:
- `flash_attention`: attention through `FlashAttention` (our cuDNN/XLA kernels on GPU);
- `tiktoken` (V3): Llama 3's tokenizer (`FujiV3Vocabulary`) instead of SentencePiece;
- `fp8`: the mesh rules of FP8-capable GPU hosts also switch the matmuls to FP8;
- `single_host`: a global batch of 16 sequences, for one host.

The per-version table (VERSIONS) holds the vocabulary, sequence length, RoPE theta, batch
in tokens and training tokens per size; the per-size table (SIZES) the dims, learning rate
and mesh; MESH_RULES each size's layouts on TPU, GPU and Trainium fleets. A new size or
version is a new row. `named_trainer_configs()` registers AXLearn's names for them
(`fuji-7B-v2-flash`, ...).

The configs are built from AXLearn's `c4_trainer` layout (`c4.py`). The remat policies
below are named by the mesh rules (`remat_spec['policy']`).
"""

import dataclasses
import enum
import functools
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import jax

from axlearn.common.attention import (
    GroupedQKVLinear,
    RepeatedTransformerLayer,
    StackedTransformerLayer,
    TransformerLayer,
    build_remat_spec,
)
from axlearn.common.config import (
    ConfigBase,
    ConfigError,
    config_for_function,
    register_configurable,
)
from axlearn.common.flash_attention import remat as flash_remat
from axlearn.common.flash_attention.layer import FlashBlockSizeModifier
from axlearn.common.kv_cache.kv_cache import KVCache
from axlearn.common.trainer import SpmdTrainer
from axlearn.common.trainer_config_modifier import (
    ChainConfigModifier,
    FP8ConfigModifier,
    GradientAccumulationModifier,
    MeshShapeModifier,
    ModuleConfigModifier,
    PartitionSpecModifier,
    RematSpecModifier,
)
from axlearn.common.utils import combine_remat_policies, save_and_offload_only_these_names_regex
from axlearn.experiments.text.gpt import c4, common
from axlearn.experiments.text.gpt.common import mesh_shape_from_axes
from axlearn.experiments.text.gpt.vocabulary_fuji_v3 import FujiV3Vocabulary
from axlearn.experiments.trainer_config_utils import (
    SplashAttentionConfigModifier,
    V6eFlashConfigModifier,
    V7xFlashConfigModifier,
)

# ----- remat policies the mesh rules name -----

_OFFLOAD_DOTS = jax.checkpoint_policies.offload_dot_with_no_batch_dims(
    offload_src="device", offload_dst="pinned_host"
)
_OFFLOAD_ATTENTION_PROJ = save_and_offload_only_these_names_regex(
    names_which_can_be_saved=None,
    names_which_can_be_offloaded=r".*[kqv]_proj",
    offload_src="device",
    offload_dst="pinned_host",
)


@register_configurable
def offload_dots_saveable_policy(prim, *args, **params):
    """Remat policy: offload the outputs of matmuls without batch dimensions to host memory
    and recompute everything else."""
    return _OFFLOAD_DOTS(prim, *args, **params)


@register_configurable
def offload_attention_proj_policy(prim, *args, **params):
    """Remat policy: offload the q/k/v projections to host memory, recompute the rest."""
    return _OFFLOAD_ATTENTION_PROJ(prim, *args, **params)


# ----- versions -----


class Version(enum.Enum):
    V1 = 1
    V2 = 2
    V3 = 3


TIB = 1024**4
MIB = 1024**2


@dataclasses.dataclass(frozen=True)
class VersionSpec:
    """What a Fuji version fixes for every size."""

    vocab_size: int  # Of its SentencePiece vocabulary.
    sentencepiece_model_name: str
    max_sequence_length: int
    rope_theta: float
    tokens_per_batch: int  # The global batch in tokens (max_sequence_length a sequence).
    total_tokens: dict[str, int]  # Size -> tokens trained on; the sizes of this version.


VERSIONS = {
    Version.V1: VersionSpec(
        32 * 1024, "bpe_32k_c4.model", 2048, 1e4, 4 * MIB, {"7B": TIB, "70B": int(1.4 * TIB)}
    ),
    Version.V2: VersionSpec(
        32 * 1024, "bpe_32k_c4.model", 4096, 1e4, 4 * MIB, {"7B": 2 * TIB, "70B": 2 * TIB}
    ),
    Version.V3: VersionSpec(
        128 * 1024,
        "bpe_128k_c4.model",
        8192,
        5e5,
        16 * MIB,
        {size: 15 * TIB for size in ("1B", "3B", "7B", "8B", "70B")},
    ),
}

# Llama 3's tokenizer (V3 with `tiktoken`): its vocabulary size and special ids.
TIKTOKEN_FILENAME = "Llama-3-tokenizer.json"
TIKTOKEN_VOCAB_SIZE = 128256
TIKTOKEN_EOS_ID = 128001  # <|end_of_text|>
TIKTOKEN_PAD_ID = 128004  # <|finetune_right_pad_id|>
SINGLE_HOST_BATCH_SIZE = 16  # Sequences a step with `single_host`.


# ----- sizes -----


@dataclasses.dataclass(frozen=True, kw_only=True)
class Size:
    """The numbers that distinguish one model size from another (named at every use)."""

    num_layers: int
    dim: int
    num_heads: int
    # Feed-forward hidden dim: a number, or (scale, multiple) for dim * scale rounded up.
    hidden_dim: Union[int, tuple[float, int]]
    num_kv_heads: int  # Key/value heads from version `gqa_since` on; before, num_heads.
    gqa_since: Version
    shared_lm_head: bool  # Logits through the token embeddings (else an untied LmHead).
    peak_lr: float
    weight_decay: float
    mesh_shape: tuple[int, ...]
    # The test size fixes these (None: from the version; a size with max_step needs no
    # token budget in VERSIONS).
    vocab_size: Optional[int] = None
    max_sequence_length: Optional[int] = None
    global_batch_size: Optional[int] = None
    max_step: Optional[int] = None
    eval_every_n_steps: int = 5000
    save_every_n_steps: int = 5000


_DATA = mesh_shape_from_axes(data=-1)
_DATA_FSDP8 = mesh_shape_from_axes(data=-1, fsdp=8)
_FSDP = mesh_shape_from_axes(fsdp=-1)

SIZES = {
    "test": Size(
        num_layers=4, dim=8, num_heads=4, hidden_dim=(8 / 3, 16),
        num_kv_heads=2, gqa_since=Version.V1, shared_lm_head=True,
        peak_lr=6e-4, weight_decay=0.01, mesh_shape=_DATA,
        vocab_size=32, max_sequence_length=64, global_batch_size=32, max_step=3000,
        eval_every_n_steps=1500, save_every_n_steps=500,
    ),
    "1B": Size(
        num_layers=16, dim=2048, num_heads=32, hidden_dim=8192,
        num_kv_heads=8, gqa_since=Version.V3, shared_lm_head=True,
        peak_lr=3e-4, weight_decay=0.1, mesh_shape=_DATA_FSDP8,
    ),
    "3B": Size(
        num_layers=28, dim=3072, num_heads=24, hidden_dim=8192,
        num_kv_heads=8, gqa_since=Version.V3, shared_lm_head=True,
        peak_lr=3e-4, weight_decay=0.1, mesh_shape=_DATA_FSDP8,
    ),
    "7B": Size(
        num_layers=32, dim=4096, num_heads=32, hidden_dim=(8 / 3, 256),
        num_kv_heads=8, gqa_since=Version.V3, shared_lm_head=True,
        peak_lr=3e-4, weight_decay=0.1, mesh_shape=_DATA_FSDP8,
    ),
    "8B": Size(
        num_layers=32, dim=4096, num_heads=32, hidden_dim=(3.5, 256),
        num_kv_heads=8, gqa_since=Version.V3, shared_lm_head=False,
        peak_lr=3e-4, weight_decay=0.1, mesh_shape=_DATA_FSDP8,
    ),
    "70B": Size(
        num_layers=80, dim=8192, num_heads=64, hidden_dim=(3.5, 256),
        num_kv_heads=8, gqa_since=Version.V2, shared_lm_head=False,
        peak_lr=1.5e-4, weight_decay=0.1, mesh_shape=_FSDP,
    ),
}


# ----- mesh rules -----

_LAYER = "model.decoder.transformer.layer"
FP8_AMAX_HISTORY_LENGTH = 128  # Delayed scaling over this many steps (FP8ConfigModifier).


def _chain(*modifiers: ConfigBase) -> ChainConfigModifier.Config:
    return ChainConfigModifier.default_config().set(config_modifiers=list(modifiers))


def _mesh(**axes: int) -> MeshShapeModifier.Config:
    return MeshShapeModifier.default_config().set(mesh_shape=mesh_shape_from_axes(**axes))


def _remat(policy: Any, *, prevent_cse: bool = False) -> RematSpecModifier.Config:
    """Every transformer layer rematerialized by `policy` (a function or its config)."""
    spec = {"prevent_cse": prevent_cse, "policy": policy}
    return RematSpecModifier.default_config().set(remat_policies={_LAYER: spec})


def _save_and_offload(
    saved: Optional[str], offloaded: Optional[str], *, offload: bool = True
) -> ConfigBase:
    """A remat policy saving the names matching `saved`, offloading to host memory those
    matching `offloaded` (regexes; None: none); `offload=False` leaves the memories unset."""
    policy = config_for_function(save_and_offload_only_these_names_regex).set(
        names_which_can_be_saved=saved, names_which_can_be_offloaded=offloaded
    )
    if not offload:
        policy.set(offload_src=None, offload_dst=None)
    return policy


def _grad_acc(steps: int) -> GradientAccumulationModifier.Config:
    return GradientAccumulationModifier.default_config().set(grad_acc_steps=steps)


def _gpu_flash_blocks() -> FlashBlockSizeModifier.Config:
    return FlashBlockSizeModifier.default_config().set(gpu_block_size=64)


def _fp8() -> FP8ConfigModifier.Config:
    return FP8ConfigModifier.default_config().set(fp8_amax_history_length=FP8_AMAX_HISTORY_LENGTH)


# Trainium: tensor parallelism (model=4) over unrolled layers, activations and norms split
# as PARTITION_SPECS_TRN2 gives. Kept as AXLearn writes it; applying it here needs the
# input/output/embedding partition-spec fields of AXLearn's Embedding and RMSNorm.
TRN2 = "neuron-(trn2|trn2n).48xlarge-64"
_TRN2_BATCH = ("data", "fsdp")
_TRN2_NORM = {
    "input_partition_spec": (_TRN2_BATCH, "model", None),
    "output_partition_spec": (_TRN2_BATCH, None, None),
}
PARTITION_SPECS_TRN2 = {
    "model.decoder.emb.token_emb": {
        "param_partition_spec": ("model", common.FSDP_AXIS_NAMES),
        "input_partition_spec": (_TRN2_BATCH, None),
        "output_partition_spec": (_TRN2_BATCH, None, None),
        "embedding_partition_spec": ("model", None),
    },
    f"{_LAYER}.self_attention.norm": _TRN2_NORM,
    f"{_LAYER}.feed_forward.norm": _TRN2_NORM,
    "model.decoder.output_norm": _TRN2_NORM,
    f"{_LAYER}.feed_forward.linear2": {"output_partition_spec": (_TRN2_BATCH, None, None)},
}


def _tensor_parallel_layers() -> StackedTransformerLayer.Config:
    """Unrolled transformer layers at the layers' defaults, every weight split over 'model'.

    AXLearn's ModuleConfigModifier keeps every field the replaced config shares with this
    one (`layer` included), so there only the stack's class changes."""
    layer = TransformerLayer.default_config()
    attention = layer.self_attention.attention
    attention.input_linear.layer.param_partition_spec = (None, "model", None)
    attention.output_linear.param_partition_spec = (None, "model", None)
    attention.kv_cache = KVCache.default_config()
    layer.feed_forward.linear1.param_partition_spec = (None, "model")
    layer.feed_forward.linear2.param_partition_spec = ("model", None)
    return StackedTransformerLayer.default_config().set(layer=layer)


def _trn2_rule(
    *, grouped_qkv: bool, untied_lm_head: bool, remat: Optional[ConfigBase] = None
) -> tuple[str, ConfigBase]:
    """The Trainium2 rule: mesh (fsdp=-1, model=4), `remat` if given, tensor-parallel
    unrolled layers (with `grouped_qkv`, a grouped QKV projection split over 'model'), and
    the activations' partition specs (with `untied_lm_head`, the head's too)."""
    modifiers = [_mesh(fsdp=-1, model=4)]
    if remat is not None:
        modifiers.append(remat)
    modifiers.append(
        ModuleConfigModifier.default_config().set(
            target_config="model.decoder.transformer", modification=_tensor_parallel_layers()
        )
    )
    if grouped_qkv:
        qkv = GroupedQKVLinear.default_config()
        qkv.layer.param_partition_spec = (None, "model", None)
        modifiers.append(
            ModuleConfigModifier.default_config().set(
                target_config=f"{_LAYER}.self_attention.attention.input_linear.input_linear",
                modification=qkv,
            )
        )
    modifiers.append(
        PartitionSpecModifier.default_config().set(partition_specs=PARTITION_SPECS_TRN2)
    )
    if untied_lm_head:
        modifiers.append(
            PartitionSpecModifier.default_config().set(
                partition_specs={
                    "model.decoder.lm_head": {
                        "param_partition_spec": ("model", common.FSDP_AXIS_NAMES)
                    }
                }
            )
        )
    return TRN2, _chain(*modifiers)


# GPU fleets: H100 (p5, a3), A100 (p4de) and B200 (a4) hosts of 8 GPUs.
GPU_P5_P4DE = "gpu-(p5.48xlarge|p4de.24xlarge)"
GPU_A3 = "gpu-(a3-highgpu-8g|a3-megagpu-8g|a3-ultragpu-8g)"
GPU_A4 = "gpu-(a4-highgpu-8g)"
GPU_ALL = "gpu-(p5.48xlarge|p4de.24xlarge|a3-highgpu-8g|a3-megagpu-8g|a3-ultragpu-8g|a4-highgpu-8g)"
GPU_SIZES = "(256|512|1024)"


def _gpu_mesh(fleet: str, fsdp: int, *, sizes: str = GPU_SIZES) -> tuple[str, Any]:
    """FSDP over `fsdp` GPUs, data parallel across (a bare mesh shape)."""
    return f"{fleet}-{sizes}", mesh_shape_from_axes(data=-1, fsdp=fsdp)


def _gpu_chain(fleet: str, fsdp: int, *extra: ConfigBase, fp8: bool) -> tuple[str, Any]:
    """As `_gpu_mesh`, then the `extra` modifiers, then FP8 matmuls if `fp8`."""
    modifiers = [_mesh(data=-1, fsdp=fsdp), *extra, *([_fp8()] if fp8 else [])]
    return f"{fleet}-{GPU_SIZES}", _chain(*modifiers)


def _v5e_rules() -> list[tuple[str, Any]]:
    """TPU v5e: matmul outputs offloaded to host memory on 1 slice (accumulating 4
    microbatches) and on 2; saved on 4."""
    dots_saveable = jax.checkpoint_policies.dots_saveable
    return [
        (
            "tpu-v5litepod-256",
            _chain(_fsdp256(), _remat(offload_dots_saveable_policy), _grad_acc(4)),
        ),
        ("tpu-v5litepod-256-2", _chain(_fsdp256(), _remat(offload_dots_saveable_policy))),
        ("tpu-v5litepod-256-4", _chain(_fsdp256(), _remat(dots_saveable))),
    ]


def _fsdp256() -> MeshShapeModifier.Config:
    return _mesh(data=-1, fsdp=256)


def _v7x_flash(tpu_block_size: int) -> list[ConfigBase]:
    return [
        V7xFlashConfigModifier.default_config().set(tpu_block_size=tpu_block_size),
        SplashAttentionConfigModifier.default_config().set(
            splash_block_kv_compute=1024, splash_block_q=4096
        ),
    ]


def _v6e_flash() -> V6eFlashConfigModifier.Config:
    return V6eFlashConfigModifier.default_config().set(tpu_block_size=1024)


def _rules_1b(*, grouped: bool, fp8: bool) -> list[tuple[str, Any]]:
    del fp8  # No GPU rules.
    return [_trn2_rule(grouped_qkv=grouped, untied_lm_head=False)]


def _rules_7b(*, grouped: bool, fp8: bool) -> list[tuple[str, Any]]:
    del grouped
    flash_and_dots = config_for_function(combine_remat_policies).set(
        policy_1=flash_remat.policy, policy_2=jax.checkpoint_policies.dots_saveable
    )
    return [
        ("tpu-v4-(1024|2048)", mesh_shape_from_axes(data=-1, fsdp=16)),
        *_v5e_rules(),
        (
            "tpu-v6e-256-(2|4|8)",
            _chain(_fsdp256(), _remat(offload_attention_proj_policy), _v6e_flash()),
        ),
        ("tpu-v5p-.*", _chain(_mesh(data=-1, fsdp=64), _remat(flash_and_dots))),
        _gpu_mesh(GPU_P5_P4DE, 8),
        _gpu_chain(GPU_A3, 8, fp8=fp8),
        _gpu_chain(GPU_A4, 8, _gpu_flash_blocks(), fp8=fp8),
        _trn2_rule(grouped_qkv=False, untied_lm_head=False),
    ]


def _rules_8b(*, grouped: bool, fp8: bool) -> list[tuple[str, Any]]:
    del grouped
    if fp8:
        raise ConfigError("fuji 8B has no FP8 rules: its one GPU rule also covers A100 hosts")
    return [
        ("tpu-v4-(1024|2048)", mesh_shape_from_axes(data=-1, fsdp=16)),
        *_v5e_rules(),
        ("tpu-v5p-.*", mesh_shape_from_axes(data=-1, fsdp=8)),
        _gpu_mesh(GPU_ALL, 8),
        _trn2_rule(grouped_qkv=False, untied_lm_head=True),
    ]


def _rules_70b(*, grouped: bool, fp8: bool) -> list[tuple[str, Any]]:
    qkv_saved_input_offloaded = functools.partial(_save_and_offload, r".*[kqv]_proj", ".*input")
    return [
        ("tpu-v5litepod-256-4", _chain(_fsdp256(), _remat(offload_dots_saveable_policy))),
        ("tpu-v5p-.*", _chain(_mesh(fsdp=-1), _remat(qkv_saved_input_offloaded()))),
        (
            "tpu-7x-128",
            _chain(
                _mesh(data=-1, fsdp=128), *_v7x_flash(2048), _remat(qkv_saved_input_offloaded())
            ),
        ),
        (
            "tpu-7x-256",
            _chain(
                _mesh(data=-1, fsdp=128),
                *_v7x_flash(2048),
                _remat(_save_and_offload(None, ".*input")),
            ),
        ),
        (
            "tpu-v6e-256-(4|8)",
            _chain(
                _fsdp256(), _remat(_save_and_offload(None, r".*[kqv]_proj|.*input")), _v6e_flash()
            ),
        ),
        (
            "tpu-v6e-256",
            _chain(
                _fsdp256(), _remat(offload_attention_proj_policy), _v6e_flash(), _grad_acc(4)
            ),
        ),
        _gpu_mesh(GPU_P5_P4DE, 128, sizes="(512|1024)"),
        _gpu_chain(GPU_A3, 64, fp8=fp8),
        _gpu_chain(GPU_A4, 16, _gpu_flash_blocks(), fp8=fp8),
        _trn2_rule(
            grouped_qkv=grouped,
            untied_lm_head=True,
            remat=_remat(
                _save_and_offload(r".*[kqv]_proj|.*linear1_[01]", None, offload=False),
                prevent_cse=True,
            ),
        ),
    ]


# Size -> its mesh rules, given whether the model has grouped-query attention and FP8.
MESH_RULES: dict[str, Callable[..., list[tuple[str, Any]]]] = {
    "test": lambda **_: [],  # The test size trains on the config's own mesh.
    "1B": _rules_1b,
    "3B": _rules_1b,
    "7B": _rules_7b,
    "8B": _rules_8b,
    "70B": _rules_70b,
}


# ----- the trainer -----


def _batch_shape(size: Size, spec: VersionSpec, *, single_host: bool) -> tuple[int, int]:
    """(sequence length, global batch in sequences) of a size in a version."""
    max_sequence_length = size.max_sequence_length or spec.max_sequence_length
    if single_host:
        return max_sequence_length, SINGLE_HOST_BATCH_SIZE
    return max_sequence_length, (
        size.global_batch_size or spec.tokens_per_batch // max_sequence_length
    )


def _hidden_dim(size: Size) -> Union[int, ConfigBase]:
    if isinstance(size.hidden_dim, int):
        return size.hidden_dim
    scale, multiple = size.hidden_dim
    return config_for_function(common.scale_fn).set(
        scale=scale, round_up_to_multiples_of=multiple
    )


def fuji_trainer(
    size_name: str,
    *,
    version: Version,
    flash_attention: bool = False,
    tiktoken: bool = False,
    fp8: bool = False,
    single_host: bool = False,
) -> SpmdTrainer.Config:
    """The trainer of Fuji `size_name` (a key of SIZES) of `version` (see the module
    docstring for the variants)."""
    if size_name not in SIZES:
        raise ConfigError(f"fuji: unknown size {size_name!r}; sizes: {', '.join(SIZES)}")
    spec, size = VERSIONS[version], SIZES[size_name]
    if size.max_step is None and size_name not in spec.total_tokens:
        raise ConfigError(
            f"fuji: no size {size_name!r} in {version.name} (VERSIONS gives its tokens for "
            f"{', '.join(spec.total_tokens)})"
        )
    if tiktoken and version != Version.V3:
        raise ConfigError(f"fuji: tiktoken is Llama 3's tokenizer (V3), not {version.name}")
    max_sequence_length, global_batch_size = _batch_shape(size, spec, single_host=single_host)
    max_step = size.max_step or spec.total_tokens[size_name] // spec.tokens_per_batch
    vocab_size, eos_id, pad_id = spec.vocab_size, 1, 0
    vocab_cfg = c4.sentencepiece_vocab_config(spec.sentencepiece_model_name)
    if tiktoken:
        vocab_size, eos_id, pad_id = TIKTOKEN_VOCAB_SIZE, TIKTOKEN_EOS_ID, TIKTOKEN_PAD_ID
        vocab_cfg = FujiV3Vocabulary.default_config().set(filename=TIKTOKEN_FILENAME)

    grouped = version.value >= size.gqa_since.value
    attention = c4.attention_config(
        num_heads=size.num_heads,
        num_kv_heads=size.num_kv_heads if grouped else None,
        rope_theta=spec.rope_theta,
        flash_attention=flash_attention,
    )
    layer = c4.transformer_layer_config(
        attention=attention, hidden_dim=_hidden_dim(size), remat_spec=build_remat_spec()
    )
    model = c4.causal_lm_config(
        dim=size.dim,
        vocab_size=size.vocab_size or vocab_size,
        transformer=RepeatedTransformerLayer.default_config().set(
            layer=layer, num_layers=size.num_layers
        ),
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        shared_lm_head=size.shared_lm_head,
    )
    return c4.c4_trainer_config(
        model=model,
        learner=c4.adamw_learner_config(
            peak_lr=size.peak_lr, weight_decay=size.weight_decay, max_step=max_step
        ),
        vocab_cfg=vocab_cfg,
        max_sequence_length=max_sequence_length,
        global_batch_size=global_batch_size,
        max_step=max_step,
        mesh_shape=size.mesh_shape,
        mesh_rules=MESH_RULES[size_name](grouped=grouped, fp8=fp8),
        eval_every_n_steps=size.eval_every_n_steps,
        save_every_n_steps=size.save_every_n_steps,
    )


def config_name(
    size_name: str,
    version: Version,
    *,
    flash_attention: bool = False,
    tiktoken: bool = False,
    fp8: bool = False,
    single_host: bool = False,
) -> str:
    """AXLearn's name of a Fuji config, e.g. 'fuji-8B-v3-tiktoken-flash-single-host'."""
    suffixes = (
        ("tiktoken", tiktoken),
        ("flash", flash_attention),
        ("fp8", fp8),
        ("single-host", single_host),
    )
    return "-".join([f"fuji-{size_name}-v{version.value}"] + [s for s, on in suffixes if on])


# The Fuji configs registered here: (size, version, variants).
NAMED_CONFIGS: Sequence[tuple[str, Version, dict[str, bool]]] = (
    ("test", Version.V1, {}),
    ("test", Version.V2, dict(flash_attention=True)),
    ("test", Version.V3, {}),
    ("test", Version.V3, dict(tiktoken=True)),
    ("1B", Version.V3, {}),
    ("7B", Version.V2, dict(flash_attention=True)),
    ("8B", Version.V3, dict(tiktoken=True, flash_attention=True, single_host=True)),
    ("70B", Version.V3, dict(fp8=True)),
)


def describe(size_name: str, version: Version, **variants: bool) -> str:
    """One line on a Fuji config, from the tables (for `--list_configs`)."""
    spec, size = VERSIONS[version], SIZES[size_name]
    seq_len, batch = _batch_shape(size, spec, single_host=variants.get("single_host", False))
    extras = {
        "flash_attention": "FlashAttention",
        "tiktoken": "Llama 3's tokenizer",
        "fp8": "FP8 matmuls on H100/B200 host fleets",
        "single_host": "a single-host batch",
    }
    shown = [text for key, text in extras.items() if variants.get(key)]
    return (
        f"AXLearn's Fuji {size_name} {version.name} on C4: {size.num_layers} layers of width "
        f"{size.dim:,}, {seq_len:,}-token sequences, {batch:,} a step"
        + (f"; {', '.join(shown)}." if shown else ".")
    )


def descriptions() -> dict[str, str]:
    """`describe` of every registered config, by name."""
    return {
        config_name(size, version, **variants): describe(size, version, **variants)
        for size, version, variants in NAMED_CONFIGS
    }


def named_trainer_configs() -> dict[str, Callable[[], SpmdTrainer.Config]]:
    return {
        config_name(size, version, **variants): functools.partial(
            fuji_trainer, size, version=version, **variants
        )
        for size, version, variants in NAMED_CONFIGS
    }
