"""Conversion between our Llama-shaped causal LM and Hugging Face Llama checkpoints.

A Llama-shaped `causal_lm.Model` config (from `llama_model_config`) has: grouped-query
attention with one fused projection (`FusedGroupedQKVLinear`, weight [D, N + 2K, H]) under
rotary embeddings that rotate halves (our `apply_rotary_position_embeddings` pairs
(x[i], x[i + H/2]), as HF's `rotate_half` does, so q/k weights need no permutation),
optionally rescaled frequencies (rope_scaling 'linear' or 'llama3'), no biases, a SwiGLU
feed-forward (linear1_0 = gate with silu, linear1_1 = up, linear2 = down), pre-norm
RMSNorm everywhere, and a tied or untied LM head. Llama 2, 3, 3.1 and 3.2 have this shape.

Weight layouts: HF's torch Linear stores [out, in]; ours store [in, out]. The HF names
map to ours as (per layer i; `layer` below is `transformer/repeat/layer` with a leading
stacked axis, or `transformer/layer{i}` for a StackedTransformerLayer):

  model.embed_tokens.weight [V, D]             decoder/emb/token_emb/weight [V, D]
  self_attn.{q,k,v}_proj.weight [N*H|K*H, D]   .../attention/i_proj/i_proj/qkv_proj/weight [D, N+2K, H]
  self_attn.o_proj.weight [D, N*H]             .../attention/o_proj/weight [D, N, H]
  mlp.gate_proj / up_proj.weight [F, D]        .../feed_forward/linear1_0 / linear1_1/weight [D, F]
  mlp.down_proj.weight [D, F]                  .../feed_forward/linear2/weight [F, D]
  input_layernorm.weight [D]                   .../self_attention/norm/scale
  post_attention_layernorm.weight [D]          .../feed_forward/norm/scale
  model.norm.weight [D]                        decoder/output_norm/scale
  lm_head.weight [V, D]                        decoder/lm_head/weight [D, V] (untied only)

Each of our parameters is a `hf_checkpoint.TensorView` of the HF tensors, so any slice of
it reads only the matching slices of the files: `HfLlamaWeights` (the trainer's
`init_params` for `--init_from_hf`) fills each device's shard straight from safetensors.

A config is exported only if a Llama computes the same function: it is compared field by
field with the Llama config of its sizes, and every difference outside the settings that
do not change the function (sharding, rematerialization, dtypes, dropout, the loss's
training-only terms; `_NEUTRAL_FIELDS`) is refused by name.

Usage:
    cfg = llama_config_from_hf(hf_model.config)
    params = params_from_hf(hf_model.state_dict(), cfg)
    hf_model.load_state_dict(params_to_hf(params, cfg))

    python -m axlearn.common.hf_llama export --trainer_dir=T [--step=N] --output=DIR \\
        [--dtype=bfloat16] [--max_shard_size=5GB] [--tokenizer=PATH] [--merge_lora]

A LoRA run exports as a PEFT adapter directory (`hf_peft`), or merged with --merge_lora.

Export writes the run's parameter dtype unless --dtype says otherwise, and keeps the
config.json fields of the Hugging Face model a run started from (--init_from_hf records
them: bos_token_id, max_position_embeddings, ...).
"""

import copy
import dataclasses
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from axlearn.common import fp8, hf_checkpoint, hf_peft, lora
from axlearn.common.attention import (
    FusedGroupedQKVLinear,
    GroupedQueryAttention,
    RepeatedTransformerLayer,
    RoFormerQKVLinear,
    StackedTransformerLayer,
    TransformerLayer,
    linear_rope_scaling,
    llama3_rope_scaling,
)
from axlearn.common.causal_lm import Model, language_model_config
from axlearn.common.checkpointer import CheckpointCorruptError
from axlearn.common.command_flags import parse_command_flags, usage_error
from axlearn.common.config import (
    REQUIRED,
    ConfigBase,
    ConfigError,
    Configurable,
    Required,
    config_class,
    config_for_function,
    format_value,
)
from axlearn.common.decoder import TokenIds, token_id_list
from axlearn.common.hf_checkpoint import Concat, SplitAxis, Stack, Tensor, TensorView, Transpose
from axlearn.common.layers import Dropout, Linear, RMSNorm, StochasticDepth
from axlearn.common.param_init import default_initializer_config
from axlearn.common.utils import flatten_with_paths, unflatten_paths

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LlamaDims:
    """The sizes that determine every weight shape of a Llama-shaped model."""

    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_dim: int
    tied: bool
    repeated: bool  # RepeatedTransformerLayer (stacked params) vs StackedTransformerLayer.


# ----- rope scaling -----

# Hugging Face rope_type -> (our frequency-scaling function, the rope_scaling keys it takes).
_ROPE_SCALINGS = {
    "linear": (linear_rope_scaling, ("factor",)),
    "llama3": (
        llama3_rope_scaling,
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    ),
}


def _rope_type(rope_scaling: Optional[Mapping[str, Any]]) -> str:
    rope_scaling = rope_scaling or {}
    return rope_scaling.get("rope_type", rope_scaling.get("type")) or "default"


def _frequency_scaling_config(rope_scaling: Optional[Mapping[str, Any]]) -> Any:
    """Our RoPE `frequency_scaling` config for an HF rope_scaling dict (None: default)."""
    rope_type = _rope_type(rope_scaling)
    if rope_type == "default":
        return None
    if rope_type not in _ROPE_SCALINGS:
        raise ConfigError(
            f"rope_scaling: rope_type '{rope_type}' is not supported (supported: default, "
            f"{', '.join(_ROPE_SCALINGS)})"
        )
    fn, keys = _ROPE_SCALINGS[rope_type]
    missing = [key for key in keys if rope_scaling.get(key) is None]
    if missing:
        raise ConfigError(f"rope_scaling of rope_type '{rope_type}' lacks {missing}")
    values = {key: rope_scaling[key] for key in keys}
    if "original_max_position_embeddings" in values:
        values["original_max_position_embeddings"] = int(values["original_max_position_embeddings"])
    return config_for_function(fn).set(**values)


def _rope_scaling_of(frequency_scaling: Any, *, path: str) -> Optional[dict[str, Any]]:
    """The HF rope_scaling dict of our `frequency_scaling` config (None: unscaled)."""
    if frequency_scaling is None:
        return None
    for rope_type, (fn, keys) in _ROPE_SCALINGS.items():
        if getattr(frequency_scaling, "fn", None) is fn:
            values = {key: getattr(frequency_scaling, key) for key in keys}
            return {"rope_type": rope_type, **values}
    raise ConfigError(
        f"{path}: a Llama rescales RoPE frequencies with {', '.join(_ROPE_SCALINGS)} only, got "
        f"{frequency_scaling}"
    )


# ----- our config -----


def llama_model_config(
    *,
    vocab_size: int,
    dim: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    hidden_dim: int,
    head_dim: Optional[int] = None,
    rope_theta: float = 10000.0,
    rope_scaling: Optional[Mapping[str, Any]] = None,
    norm_eps: float = 1e-5,
    tie_word_embeddings: bool = False,
    repeated: bool = True,
    pad_token_id: Optional[int] = 0,
    eos_token_id: TokenIds = 1,
) -> Model.Config:
    """A float32 Llama-shaped Model config (see the module doc for its structure).

    `rope_scaling` is an HF rope_scaling dict ({'rope_type': 'llama3', 'factor': ...});
    `eos_token_id` one id or a list (generation stops at any); `pad_token_id` None for a
    vocabulary without one (Llama 3).
    """
    head_dim = head_dim or dim // num_heads
    norm = RMSNorm.default_config().set(eps=norm_eps)
    stack = RepeatedTransformerLayer if repeated else StackedTransformerLayer
    transformer = stack.default_config().set(
        num_layers=num_layers, layer=TransformerLayer.default_config()
    )
    layer = transformer.layer
    layer.self_attention.norm = norm.clone()
    attention = GroupedQueryAttention.default_config().set(
        num_heads=num_heads, hidden_dim=num_heads * head_dim, causal=True
    )
    fused = FusedGroupedQKVLinear.default_config().set(num_kv_heads=num_kv_heads)
    fused.layer.bias = False
    attention.input_linear = RoFormerQKVLinear.default_config().set(
        input_linear=fused, rotary_value=False
    )
    rope = attention.input_linear.rope_pos_emb_layer
    rope.theta = rope_theta
    rope.frequency_scaling = _frequency_scaling_config(rope_scaling)
    attention.output_linear.bias = False
    layer.self_attention.attention = attention
    ff = layer.feed_forward
    ff.set(hidden_dim=hidden_dim, activation=("nn.silu", "linear"), norm=norm.clone())
    ff.linear1.bias = False
    ff.linear2.bias = False
    cfg = Model.default_config().set(
        name="model", dtype=jnp.float32, param_init=default_initializer_config()
    )
    eos = token_id_list(eos_token_id)
    cfg.decoder.set(
        vocab_size=vocab_size,
        dim=dim,
        transformer=transformer,
        output_norm=norm.clone(),
        lm_head=None if tie_word_embeddings else Linear.default_config().set(bias=False),
        pad_token_id=pad_token_id,
        eos_token_id=eos[0] if len(eos) == 1 else eos,
    )
    return cfg


# ----- from a Hugging Face config -----


def _hf_dict(hf_config: Any) -> dict[str, Any]:
    """A config.json dict, or a transformers config object's."""
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    return hf_config.to_dict()


def _hf_rope(config: Mapping[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    """(rope_theta, rope_scaling dict or None) of a transformers 4.x config (`rope_theta`,
    `rope_scaling`) or 5.x (`rope_parameters`)."""
    parameters = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    theta = parameters.pop("rope_theta", config.get("rope_theta"))
    merged = {**scaling, **parameters}
    if _rope_type(merged) == "default":
        return float(theta if theta is not None else 10000.0), None
    return float(theta if theta is not None else 10000.0), merged


# config.json fields we cannot express, with the value that we can: refused by name.
_HF_REQUIRED_VALUES = (
    ("hidden_act", "silu"),
    ("attention_bias", False),
    ("mlp_bias", False),
    ("partial_rotary_factor", 1.0),
    ("quantization_config", None),
)
_HF_MODEL_TYPES = ("llama",)


def _check_hf_fields(config: Mapping[str, Any], rope_scaling: Optional[Mapping]) -> None:
    """Raises naming every config.json field a Llama-shaped model of ours cannot express."""
    problems = []
    model_type = config.get("model_type", "llama")
    if model_type not in _HF_MODEL_TYPES:
        problems.append(f"model_type={model_type!r} (need one of {_HF_MODEL_TYPES})")
    for field, expected in _HF_REQUIRED_VALUES:
        value = config.get(field, expected)
        if value != expected and not (expected is None and not value):
            problems.append(f"{field}={value!r} (need {expected!r})")
    rope_scaling = rope_scaling or {}
    if rope_scaling.get("partial_rotary_factor", 1.0) != 1.0:
        factor = rope_scaling["partial_rotary_factor"]
        problems.append(f"rope_parameters.partial_rotary_factor={factor!r} (need 1.0)")
    try:
        _frequency_scaling_config(rope_scaling)
    except ConfigError as e:
        problems.append(str(e))
    if problems:
        raise ConfigError(f"Hugging Face config fields not supported: {'; '.join(problems)}")


def _optional_id(value: Any) -> Optional[int]:
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return None if value is None else int(value)


def llama_config_from_hf(
    hf_config: Any,
    *,
    generation_config: Optional[Mapping[str, Any]] = None,
    repeated: bool = True,
) -> Model.Config:
    """Our Model config equivalent to a Hugging Face Llama config: a transformers
    LlamaConfig or a config.json dict.

    The EOS ids (one or a list, all kept) and the pad id (None where there is none) come
    from `generation_config` (generation_config.json) where it names them, else from the
    config. Fields we cannot express (rope types other than default/linear/llama3,
    biases, other activations, partial rotary, quantization) are a ConfigError naming them.
    """
    config = _hf_dict(hf_config)
    theta, rope_scaling = _hf_rope(config)
    _check_hf_fields(config, rope_scaling)
    generation_config = generation_config or {}
    eos = generation_config.get("eos_token_id", config.get("eos_token_id"))
    pad = generation_config.get("pad_token_id", config.get("pad_token_id"))
    num_heads = config["num_attention_heads"]
    cfg = llama_model_config(
        vocab_size=config["vocab_size"],
        dim=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        hidden_dim=config["intermediate_size"],
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
        rope_theta=theta,
        rope_scaling=rope_scaling,
        norm_eps=config.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        repeated=repeated,
        pad_token_id=_optional_id(pad),
        eos_token_id=token_id_list(eos) if eos is not None else 1,
    )
    dropout = config.get("attention_dropout") or 0.0
    if dropout:  # Training only; a recipe's own dropout replaces it (warm_start_model_config).
        cfg.decoder.transformer.layer.self_attention.attention.dropout.rate = float(dropout)
    return cfg


# ----- is a config a Llama? -----

_ATTENTION_PATH = "decoder.transformer.layer.self_attention.attention"
_ROPE_PATH = f"{_ATTENTION_PATH}.input_linear.rope_pos_emb_layer.frequency_scaling"


def _attention_config(cfg: Model.Config) -> Any:
    return cfg.decoder.transformer.layer.self_attention.attention

# Fields that do not change the function a model computes at inference: how it is
# sharded, rematerialized and stored, its training-only terms and summaries.
_NEUTRAL_FIELDS = frozenset(
    {
        "name",
        "dtype",
        "param_init",
        "param_partition_spec",
        "output_partition_spec",
        "logits_partition_spec",
        "batch_axis_names",
        "seq_axis_names",
        "remat_spec",
        "drop_output",
        "cache_dtype",
        "forward_dtype",
        "attention_implementation",
        "dropout_rate",
        "z_loss_scale",
        "metrics",  # The loss the model trains on, not the logits it computes.
        "loss_chunk_size",
        "attend_across_documents",
        "add_dead_neuron_summary",
        "add_value_rms_norm_summary",
        "decoding",
        "fp8",  # FP8 casts of training's matmuls; the float32 weights are the model.
    }
)
# Sub-configs that act in training only.
_NEUTRAL_CLASSES = (Dropout, StochasticDepth)


def _is_neutral(name: str, value: Any) -> bool:
    if name in _NEUTRAL_FIELDS:
        return True
    klass = getattr(value, "klass", None) if isinstance(value, ConfigBase) else None
    return isinstance(klass, type) and issubclass(klass, _NEUTRAL_CLASSES)


def _same_target(a: ConfigBase, b: ConfigBase) -> bool:
    """Whether two configs configure the same class or function."""
    return getattr(a, "klass", None) is getattr(b, "klass", None) and getattr(
        a, "fn", None
    ) is getattr(b, "fn", None)


def _copy_neutral_fields(source: ConfigBase, target: ConfigBase) -> None:
    """Sets every function-neutral field of `target` to `source`'s value at the same path,
    descending where both hold configs of the same class."""
    for name in target.keys():
        if name not in source.keys():
            continue
        value, mine = getattr(source, name), getattr(target, name)
        if _is_neutral(name, value) or _is_neutral(name, mine):
            setattr(target, name, copy.deepcopy(value))
        elif (
            isinstance(value, ConfigBase)
            and isinstance(mine, ConfigBase)
            and _same_target(value, mine)
        ):
            _copy_neutral_fields(value, mine)


def _spelled_out(cfg: Model.Config) -> Model.Config:
    """`cfg` with defaults that have two spellings written one way: the decoder's
    attention_mask='causal' as the attention's causal=True, the attention's hidden_dim
    None as the model dim."""
    cfg = cfg.clone()
    attention = cfg.decoder.transformer.layer.self_attention.attention
    if cfg.decoder.attention_mask == "causal":
        cfg.decoder.attention_mask = None
        attention.causal = True
    if attention.hidden_dim is None:
        attention.hidden_dim = cfg.decoder.dim
    return cfg


def _comparable(value: Any) -> Any:
    """Sequences as tuples, so that a list and a tuple of the same items compare equal."""
    if isinstance(value, (list, tuple)):
        return tuple(_comparable(item) for item in value)
    if isinstance(value, dict):
        return {key: _comparable(item) for key, item in value.items()}
    return value


def _shown(value: Any) -> str:
    if isinstance(value, ConfigBase):
        klass = getattr(value, "klass", None) or getattr(value, "fn", None)
        return f"{getattr(klass, '__name__', klass)}(...)"
    return format_value(value)


def _differences(have: Any, want: Any, path: str) -> list[str]:
    """'path is X (a Llama has Y)' for each field where config `have` differs from
    `want`, reported at the top-most path that differs."""
    if isinstance(have, ConfigBase) and isinstance(want, ConfigBase) and _same_target(have, want):
        found = []
        for name in sorted(set(have.keys()) | set(want.keys())):
            child = f"{path}.{name}" if path else name
            found += _differences(getattr(have, name), getattr(want, name), child)
        return found
    if isinstance(have, ConfigBase) or isinstance(want, ConfigBase):
        same = have == want
    else:
        same = _comparable(have) == _comparable(want)
    return [] if same else [f"{path} is {_shown(have)} (a Llama has {_shown(want)})"]


def _structure(cfg: Model.Config) -> dict[str, Any]:
    """The `llama_model_config` arguments of `cfg`'s sizes and settings; ConfigError naming
    the path where `cfg` is not even shaped like one."""
    if getattr(cfg, "klass", None) is not Model:
        raise ConfigError(f"model: expected causal_lm.Model, got {getattr(cfg, 'klass', cfg)}")
    decoder = cfg.decoder
    transformer = decoder.transformer
    if transformer.klass not in (RepeatedTransformerLayer, StackedTransformerLayer):
        raise ConfigError(
            "decoder.transformer: expected RepeatedTransformerLayer or StackedTransformerLayer, "
            f"got {transformer.klass.__name__}"
        )
    layer = transformer.layer
    if isinstance(layer, (list, tuple)):
        raise ConfigError(
            "decoder.transformer.layer: a list of per-layer configs; a Llama repeats one layer"
        )
    attention = layer.self_attention.attention
    rope = attention.input_linear
    if rope.klass is not RoFormerQKVLinear or rope.input_linear.klass is not FusedGroupedQKVLinear:
        raise ConfigError(
            f"{_ATTENTION_PATH}.input_linear: expected RoFormerQKVLinear over "
            "FusedGroupedQKVLinear (see hf_llama.llama_model_config)"
        )
    if decoder.output_norm is None or decoder.output_norm.klass is not RMSNorm:
        raise ConfigError("decoder.output_norm: Llama needs RMSNorm")
    hidden_dim = layer.feed_forward.hidden_dim
    if not isinstance(hidden_dim, int):
        # A rule of the model dim: the layer computes it.
        ff = layer.feed_forward.clone(name="feed_forward", input_dim=decoder.dim)
        hidden_dim = ff.instantiate(parent=None).hidden_dim
    head_dim = (attention.hidden_dim or decoder.dim) // attention.num_heads
    return dict(
        vocab_size=decoder.vocab_size,
        dim=decoder.dim,
        num_layers=transformer.num_layers,
        num_heads=attention.num_heads,
        num_kv_heads=rope.input_linear.num_kv_heads,
        hidden_dim=hidden_dim,
        head_dim=head_dim,
        rope_theta=rope.rope_pos_emb_layer.theta,
        rope_scaling=_rope_scaling_of(rope.rope_pos_emb_layer.frequency_scaling, path=_ROPE_PATH),
        norm_eps=decoder.output_norm.eps,
        tie_word_embeddings=decoder.lm_head is None,
        repeated=transformer.klass is RepeatedTransformerLayer,
        pad_token_id=decoder.pad_token_id,
        eos_token_id=decoder.eos_token_id,
    )


def llama_dims(cfg: Model.Config) -> LlamaDims:
    """The sizes of `cfg` once checked to compute what a Llama computes: every field
    outside `_NEUTRAL_FIELDS` must equal the Llama config of those sizes (logits and
    attention soft caps, query scale factors, QK-norm, residual weights, biases,
    activations, norms ... are refused, each named with its value). A LoRA model's sizes
    are its base model's (`lora.base_model_config`)."""
    cfg = lora.base_model_config(cfg)  # A LoRA model's base is the Llama.
    structure = _structure(cfg)
    llama = llama_model_config(**structure)
    actual = _spelled_out(cfg)
    _copy_neutral_fields(actual, llama)
    differences = _differences(actual, _spelled_out(llama), "")
    if differences:
        raise ConfigError(
            f"The model is not a Llama; Hugging Face Llama cannot express: {'; '.join(differences)}"
        )
    head_dim = structure["head_dim"]
    return LlamaDims(
        vocab_size=structure["vocab_size"],
        dim=structure["dim"],
        num_layers=structure["num_layers"],
        num_heads=structure["num_heads"],
        num_kv_heads=structure["num_kv_heads"],
        head_dim=head_dim,
        hidden_dim=structure["hidden_dim"],
        tied=structure["tie_word_embeddings"],
        repeated=structure["repeated"],
    )


# ----- to a Hugging Face config -----


def hf_config_dict(
    cfg: Model.Config, *, dtype: str = "float32", source: Optional[Mapping[str, Any]] = None
) -> dict[str, Any]:
    """The config.json of a Llama equivalent to our Llama-shaped `cfg` (ConfigError naming
    the fields a Llama cannot express), with the `source` fields (`source_fields` of the
    model it started from) it does not compute: bos_token_id, max_position_embeddings ..."""
    source = dict(source or {})
    dims = llama_dims(cfg)
    rope = _attention_config(cfg).input_linear.rope_pos_emb_layer
    rope_scaling = _rope_scaling_of(rope.frequency_scaling, path=_ROPE_PATH)
    eos = token_id_list(cfg.decoder.eos_token_id)
    # Only sizes transformers' default caches: rotary embeddings have no length limit.
    max_positions = 2048
    if "max_position_embeddings" in source:
        max_positions = int(source["max_position_embeddings"])
    elif rope_scaling is not None:
        original = rope_scaling.get("original_max_position_embeddings", max_positions)
        max_positions = int(original * rope_scaling["factor"])
    return {
        **source,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": dims.vocab_size,
        "hidden_size": dims.dim,
        "intermediate_size": dims.hidden_dim,
        "num_hidden_layers": dims.num_layers,
        "num_attention_heads": dims.num_heads,
        "num_key_value_heads": dims.num_kv_heads,
        "head_dim": dims.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.decoder.output_norm.eps,
        "rope_theta": float(rope.theta),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": dims.tied,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "pad_token_id": cfg.decoder.pad_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "torch_dtype": dtype,
    }


def generation_config_dict(
    cfg: Model.Config, *, source: Optional[Mapping[str, Any]] = None
) -> dict[str, Any]:
    """generation_config.json: the EOS ids (all of them), the pad id, and the bos id of
    the `source` fields (`source_fields`) where they name one."""
    eos = token_id_list(cfg.decoder.eos_token_id)
    result: dict[str, Any] = {"eos_token_id": eos[0] if len(eos) == 1 else eos}
    if (source or {}).get("bos_token_id") is not None:
        result["bos_token_id"] = source["bos_token_id"]
    if cfg.decoder.pad_token_id is not None:
        result["pad_token_id"] = cfg.decoder.pad_token_id
    return result


def hf_config_from_llama_config(cfg: Model.Config) -> Any:
    """A transformers LlamaConfig equivalent to our Llama-shaped `cfg`."""
    from transformers import LlamaConfig  # pylint: disable=import-outside-toplevel

    config = hf_config_dict(cfg)
    del config["architectures"], config["model_type"], config["torch_dtype"]
    return LlamaConfig(**config)


# ----- warm start -----


def warm_start_model_config(recipe: Model.Config, hf_directory: str) -> Model.Config:
    """The model of the Hugging Face checkpoint in `hf_directory` (its config.json and
    generation_config.json), with the settings of `recipe` (a named config's model) that
    do not change the function: sharding, rematerialization, dtypes, dropout, loss terms.
    The layer stack is scanned (RepeatedTransformerLayer) or not as in `recipe`, and
    the recipe's LoRA layers (`axlearn.common.lora`) wrap the same layers of the new model."""
    lora_layers = lora.lora_layer_configs(recipe)  # Put back on the new model below.
    recipe = lora.base_model_config(recipe)
    config = hf_checkpoint.read_config(hf_directory)
    repeated = getattr(recipe.decoder.transformer, "klass", None) is not StackedTransformerLayer
    try:
        model = llama_config_from_hf(
            config,
            generation_config=hf_checkpoint.read_generation_config(hf_directory),
            repeated=repeated,
        )
    except ConfigError as e:
        raise ConfigError(f"{hf_directory}/{hf_checkpoint.CONFIG_FILE}: {e}") from e
    _copy_neutral_fields(recipe, model)
    if recipe.decoder.lm_head is None and model.decoder.lm_head is not None:
        # An untied head for a tied recipe: split like the token table, transposed.
        table = recipe.decoder.emb.token_emb.param_partition_spec
        if table is not None:
            model.decoder.lm_head.param_partition_spec = tuple(reversed(tuple(table)))
    return lora.with_lora_layers(model, lora_layers)


# Fields of config.json that `hf_config_dict` writes from the model config (or that only
# describe the file: its dtype, the rope spelling of another transformers version).
_MODEL_FIELDS = frozenset(
    (
        "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
        "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
        "tie_word_embeddings", "attention_bias", "mlp_bias", "attention_dropout",
        "pad_token_id", "eos_token_id", "torch_dtype", "dtype", "partial_rotary_factor",
        "quantization_config", "transformers_version",
    )
)


def source_fields(hf_directory: str) -> dict[str, Any]:
    """The fields of the config.json in `hf_directory` that our model config does not
    carry and export should keep: scalars outside `_MODEL_FIELDS` (bos_token_id,
    max_position_embeddings, initializer_range, use_cache, ...)."""
    config = hf_checkpoint.read_config(hf_directory)
    return {
        key: value
        for key, value in sorted(config.items())
        if key not in _MODEL_FIELDS
        and isinstance(value, (bool, int, float, str))
        and not key.startswith("_")
    }


# ----- parameters as views of the HF tensors -----


def _layer_views(reader: Any, i: int, dims: LlamaDims) -> dict[str, Any]:
    """Our parameters of transformer layer i as views of the HF tensors."""
    prefix = f"model.layers.{i}."
    n, k, h = dims.num_heads, dims.num_kv_heads, dims.head_dim

    def tensor(name: str) -> TensorView:
        return Tensor(reader, prefix + name)

    def heads(name: str, num: int) -> TensorView:  # [num*H, D] -> [D, num, H]
        return SplitAxis(Transpose(tensor(name)), 1, (num, h))

    qkv = Concat(
        [heads("self_attn.q_proj.weight", n), heads("self_attn.k_proj.weight", k),
         heads("self_attn.v_proj.weight", k)],
        axis=1,
    )
    return dict(
        self_attention=dict(
            norm=dict(scale=tensor("input_layernorm.weight")),
            attention=dict(
                i_proj=dict(i_proj=dict(qkv_proj=dict(weight=qkv))),
                o_proj=dict(weight=SplitAxis(tensor("self_attn.o_proj.weight"), 1, (n, h))),
            ),
        ),
        feed_forward=dict(
            norm=dict(scale=tensor("post_attention_layernorm.weight")),
            linear1_0=dict(weight=Transpose(tensor("mlp.gate_proj.weight"))),
            linear1_1=dict(weight=Transpose(tensor("mlp.up_proj.weight"))),
            linear2=dict(weight=Transpose(tensor("mlp.down_proj.weight"))),
        ),
    )


def _stack_views(layers: list[Any]) -> Any:
    if isinstance(layers[0], dict):
        return {key: _stack_views([layer[key] for layer in layers]) for key in layers[0]}
    return Stack(layers)


def param_views(reader: Any, dims: LlamaDims) -> dict[str, Any]:
    """Our parameter tree as views of the HF tensors of `reader` (a
    `hf_checkpoint.SafetensorsReader` or `ArrayReader`); KeyError naming missing tensors."""
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(dims.num_layers):
        expected |= {
            f"model.layers.{i}.{name}.weight"
            for name in (
                "input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
                "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj",
            )
        }
    if not dims.tied:
        expected.add("lm_head.weight")
    missing = sorted(expected - reader.names())
    if missing:
        raise KeyError(
            f"The HF checkpoint lacks {missing[:8]} ({len(missing)} in all) for a {dims}"
        )
    layers = [_layer_views(reader, i, dims) for i in range(dims.num_layers)]
    if dims.repeated:
        transformer = dict(repeat=dict(layer=_stack_views(layers)))
    else:
        transformer = {f"layer{i}": layer for i, layer in enumerate(layers)}
    decoder = dict(
        emb=dict(token_emb=dict(weight=Tensor(reader, "model.embed_tokens.weight"))),
        transformer=transformer,
        output_norm=dict(scale=Tensor(reader, "model.norm.weight")),
    )
    if not dims.tied:
        decoder["lm_head"] = dict(weight=Transpose(Tensor(reader, "lm_head.weight")))
    return dict(decoder=decoder)


def params_from_hf(state_dict: dict[str, Any], cfg: Model.Config) -> dict[str, Any]:
    """Our parameter tree (jax arrays of cfg.dtype, default float32) from an HF state dict."""
    views = param_views(hf_checkpoint.ArrayReader(state_dict), llama_dims(cfg))
    dtype = cfg.dtype or jnp.float32
    return hf_checkpoint.map_views(lambda view: jnp.asarray(view.read(), dtype=dtype), views)


def load_params(reader: Any, cfg: Model.Config, param_specs: Any, shardings: Any) -> Any:
    """Our parameters from the HF tensors of `reader`, each device's shard read on its own
    (`jax.make_array_from_callback`), in the dtypes of `param_specs` and placed by
    `shardings` (trees shaped like the parameters)."""
    views = param_views(reader, llama_dims(cfg))
    return load_views(reader.directory, views, param_specs, shardings)


def load_views(directory: str, views: Any, param_specs: Any, shardings: Any) -> Any:
    """`load_params` of a tree of views (any model family's, `hf_models.param_views`) of
    the checkpoint in `directory`."""
    flat_views = dict(flatten_with_paths(views, is_leaf=lambda x: isinstance(x, TensorView)))
    flat_specs = flatten_with_paths(param_specs, is_leaf=lambda x: hasattr(x, "shape"))
    # FP8 scaling state is no weight: it starts empty (zeros), as in a fresh run.
    fp8_state = re.compile(fp8.STATE_REGEX)
    for path, spec in flat_specs:
        if fp8_state.fullmatch(path):
            flat_views[path] = hf_checkpoint.Zeros(tuple(spec.shape))
    missing = sorted(set(path for path, _ in flat_specs) - set(flat_views))
    unexpected = sorted(set(flat_views) - set(path for path, _ in flat_specs))
    if missing or unexpected:
        raise ValueError(
            f"{directory}: parameters without a Hugging Face tensor: {missing or 'none'}; "
            f"tensors without a parameter: {unexpected or 'none'}"
        )
    flat_shardings = dict(flatten_with_paths(shardings, is_leaf=lambda x: hasattr(x, "device_set")))
    arrays = []
    for path, spec in flat_specs:
        view = flat_views[path]
        if tuple(view.shape) != tuple(spec.shape):
            raise ValueError(
                f"{directory}: parameter {path} has shape {tuple(spec.shape)}, the "
                f"checkpoint gives {tuple(view.shape)}"
            )
        dtype = np.dtype(spec.dtype)
        arrays.append(
            jax.make_array_from_callback(
                tuple(spec.shape),
                flat_shardings[path],
                lambda index, view=view, dtype=dtype: view.read(index).astype(dtype),
            )
        )
    treedef = jax.tree_util.tree_structure(param_specs, is_leaf=lambda x: hasattr(x, "shape"))
    return jax.tree_util.tree_unflatten(treedef, arrays)


class HfLlamaWeights(Configurable):
    """The initial parameters of a fresh run (`SpmdTrainer.Config.init_params`): the
    weights of a local Hugging Face Llama directory (config.json and safetensors, one file
    or sharded; every process reads it), each device's shard of each parameter read on its
    own, so that no host holds the whole model."""

    @config_class
    class Config(Configurable.Config):
        """Configures HfLlamaWeights."""

        path: Required[str] = REQUIRED  # A local Hugging Face model directory.
        # Fields of its config.json that the model config does not carry (bos_token_id,
        # max_position_embeddings, initializer_range, ...; `source_fields`), which export
        # writes back. None: none recorded.
        source_fields: Optional[dict[str, Any]] = None
        # A LoRA model's adapters: a PEFT adapter directory to start them from
        # (`hf_peft.read_adapter` checks it against the model); None: from the model's
        # param_init (key PRNGKey(0); lora_up zero, so step 0 computes the base model).
        lora_from: Optional[str] = None

    def load(self, *, model_config: Model.Config, param_specs: Any, shardings: Any) -> Any:
        """The parameters of `model_config` (whose sizes must be the checkpoint's) in the
        shapes and dtypes of `param_specs`, placed by `shardings`. A LoRA model's base
        layers get the checkpoint's weights, its adapters `lora_from`'s or fresh ones."""
        path = self.config.path
        expected = llama_dims(llama_config_from_hf(hf_checkpoint.read_config(path)))
        dims = llama_dims(model_config)
        if dataclasses.replace(dims, repeated=expected.repeated) != expected:
            raise ConfigError(
                f"init_params.path={path}: the checkpoint's sizes {expected} differ from the "
                f"model's {dims}"
            )
        log.info("Loading the weights of %s, each device's shard on its own", path)
        reader = hf_checkpoint.SafetensorsReader(path)
        if not lora.lora_layer_configs(model_config):
            if self.config.lora_from is not None:
                raise ConfigError(
                    f"init_params.lora_from={self.config.lora_from}: the model has no LoRA layers"
                )
            return load_params(reader, model_config, param_specs, shardings)
        model = model_config.clone(name="model").instantiate(parent=None)
        paths = lora.base_param_paths(model, param_specs)
        is_spec = lambda x: hasattr(x, "shape")  # pylint: disable=unnecessary-lambda-assignment
        flat_specs = dict(flatten_with_paths(param_specs, is_leaf=is_spec))
        flat_shardings = dict(
            flatten_with_paths(shardings, is_leaf=lambda x: hasattr(x, "device_set"))
        )
        base = {b: p for p, b in paths.items() if b is not None}
        base_params = load_params(
            reader,
            lora.base_model_config(model_config),
            unflatten_paths({b: flat_specs[p] for b, p in base.items()}),
            unflatten_paths({b: flat_shardings[p] for b, p in base.items()}),
        )
        adapter_paths = sorted(p for p, b in paths.items() if b is None)
        if self.config.lora_from is not None:
            log.info("Starting the adapters from %s", self.config.lora_from)
            values = hf_peft.read_adapter(self.config.lora_from, model, param_specs)
            adapters = {
                p: jax.device_put(values[p].astype(flat_specs[p].dtype), flat_shardings[p])
                for p in adapter_paths
            }
        else:
            adapters = lora.initial_adapters(model, adapter_paths, flat_shardings)
        return lora.join_params(
            model, param_specs, dict(flatten_with_paths(base_params)), adapters
        )


# ----- our parameters to HF tensors -----


def _layer_to_hf(layer: dict[str, Any], i: int, dims: LlamaDims) -> dict[str, np.ndarray]:
    """The HF state-dict entries of transformer layer i from our layer parameters."""
    prefix = f"model.layers.{i}."
    d, n, k, h = dims.dim, dims.num_heads, dims.num_kv_heads, dims.head_dim
    attention = layer["self_attention"]["attention"]
    qkv = attention["i_proj"]["i_proj"]["qkv_proj"]["weight"]
    ff = layer["feed_forward"]
    return {
        prefix + "input_layernorm.weight": layer["self_attention"]["norm"]["scale"],
        prefix + "self_attn.q_proj.weight": qkv[:, :n].reshape(d, n * h).T,
        prefix + "self_attn.k_proj.weight": qkv[:, n : n + k].reshape(d, k * h).T,
        prefix + "self_attn.v_proj.weight": qkv[:, n + k :].reshape(d, k * h).T,
        prefix + "self_attn.o_proj.weight": attention["o_proj"]["weight"].reshape(d, n * h),
        prefix + "post_attention_layernorm.weight": ff["norm"]["scale"],
        prefix + "mlp.gate_proj.weight": ff["linear1_0"]["weight"].T,
        prefix + "mlp.up_proj.weight": ff["linear1_1"]["weight"].T,
        prefix + "mlp.down_proj.weight": ff["linear2"]["weight"].T,
    }


def _unstack_layer(stacked: dict[str, Any], i: int) -> dict[str, Any]:
    if isinstance(stacked, dict):
        return {key: _unstack_layer(value, i) for key, value in stacked.items()}
    return stacked[i]


def params_to_hf(
    params: dict[str, Any],
    cfg: Model.Config,
    *,
    framework: str = "pt",
    layer_to_hf: Optional[Callable[[dict[str, Any], int, LlamaDims], dict[str, Any]]] = None,
) -> dict:
    """An HF LlamaForCausalLM state dict from our parameters.

    framework 'pt': float32 torch tensors (for `load_state_dict`); 'np': numpy arrays.
    A tied model gets `lm_head.weight` equal to the token table, as HF expects.
    layer_to_hf: the HF entries of one transformer layer's float32 parameters (a model of
    Llama's shape with other layers, e.g. Mixtral's); None: a Llama layer's.
    """
    if framework not in ("pt", "np"):
        raise ValueError(f"framework must be 'pt' or 'np', got {framework!r}")
    dims = llama_dims(cfg)
    decoder = hf_checkpoint.map_views(hf_checkpoint.to_float32, params["decoder"])
    transformer = decoder["transformer"]
    sd = {"model.embed_tokens.weight": decoder["emb"]["token_emb"]["weight"]}
    for i in range(dims.num_layers):
        layer = (
            _unstack_layer(transformer["repeat"]["layer"], i)
            if dims.repeated
            else transformer[f"layer{i}"]
        )
        sd.update((layer_to_hf or _layer_to_hf)(layer, i, dims))
    sd["model.norm.weight"] = decoder["output_norm"]["scale"]
    sd["lm_head.weight"] = (
        sd["model.embed_tokens.weight"] if dims.tied else decoder["lm_head"]["weight"].T
    )
    # Own, writable, contiguous copies: torch cannot wrap read-only (jax-backed) buffers.
    sd = {name: np.array(value, dtype=np.float32, order="C") for name, value in sd.items()}
    if framework == "np":
        return sd
    import torch  # pylint: disable=import-outside-toplevel

    return {name: torch.from_numpy(value) for name, value in sd.items()}


# ----- export -----

_EXPORT_DTYPES = ("bfloat16", "float32", "float16")


def write_hf_model(
    params: dict[str, Any],
    cfg: Model.Config,
    directory: str,
    *,
    dtype: str = "bfloat16",
    max_shard_size: int = hf_checkpoint.parse_size(hf_checkpoint.DEFAULT_MAX_SHARD_SIZE),
    tokenizer: Optional[str] = None,
    source: Optional[Mapping[str, Any]] = None,
) -> list[str]:
    """Writes our Llama-shaped model as a Hugging Face directory: config.json (with the
    `source` fields of the model it started from, `source_fields`),
    generation_config.json, safetensors weights in `dtype` (sharded above
    `max_shard_size` bytes) and, given a tokenizer file, its files. Returns the names."""
    check_export_dtype(dtype)
    # Refuses non-Llama configs before any write.
    config = hf_config_dict(cfg, dtype=dtype, source=source)
    return write_hf_directory(
        directory,
        config,
        lambda: params_to_hf(params, cfg, framework="np"),
        cfg=cfg,
        dtype=dtype,
        max_shard_size=max_shard_size,
        tokenizer=tokenizer,
        source=source,
    )


def check_export_dtype(dtype: str) -> None:
    """Refuses an export `dtype` outside `_EXPORT_DTYPES`, naming --dtype."""
    if dtype not in _EXPORT_DTYPES:
        raise ConfigError(f"--dtype={dtype}: expected one of {_EXPORT_DTYPES}")


def write_hf_directory(
    directory: str,
    config: dict[str, Any],
    state_dict: Callable[[], dict[str, np.ndarray]],
    *,
    cfg: Model.Config,
    dtype: str,
    max_shard_size: int,
    tokenizer: Optional[str],
    source: Optional[Mapping[str, Any]],
) -> list[str]:
    """Writes the Hugging Face directory of `cfg` (any family): `config` as config.json,
    `generation_config_dict(cfg, source=source)`, the weights `state_dict()` gives (called
    once the directory is known to hold none) in `dtype` and the tokenizer's files, as
    `write_hf_model` says. Returns the names written."""
    if os.path.isdir(directory):
        # Weights left by an earlier export would mix with these (a stale index wins).
        old = sorted(f for f in os.listdir(directory) if "safetensors" in f)
        if old:
            raise ConfigError(
                f"{directory} already holds weights ({', '.join(old)}): export into a new "
                "directory"
            )
    weights = state_dict()
    if config["tie_word_embeddings"]:
        del weights["lm_head.weight"]  # Tied: transformers takes the token table.
    numpy_dtype = np.dtype(jnp.dtype(dtype))
    weights = {name: value.astype(numpy_dtype) for name, value in weights.items()}
    os.makedirs(directory, exist_ok=True)
    written = hf_checkpoint.write_safetensors(weights, directory, max_shard_size=max_shard_size)
    hf_checkpoint.write_json(os.path.join(directory, hf_checkpoint.CONFIG_FILE), config)
    hf_checkpoint.write_json(
        os.path.join(directory, hf_checkpoint.GENERATION_CONFIG_FILE),
        generation_config_dict(cfg, source=source),
    )
    written += [hf_checkpoint.CONFIG_FILE, hf_checkpoint.GENERATION_CONFIG_FILE]
    if tokenizer is not None:
        written += hf_checkpoint.copy_tokenizer(tokenizer, directory)
    return written


def export_tokenizer(trainer_cfg: Any, tokenizer: Optional[str]) -> Optional[str]:
    """The tokenizer file an export of the run `trainer_cfg` copies: `tokenizer` if given,
    else the one recorded with the run's data (`trainer_dir.recorded_tokenizer`); None,
    with a warning, for bytes or a run that records none."""
    if tokenizer is not None:
        return tokenizer
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common import trainer_dir as trainer_dir_lib

    tokenizer = trainer_dir_lib.recorded_tokenizer(trainer_cfg)
    if tokenizer == trainer_dir_lib.BYTES_TOKENIZER:
        log.warning("The run's data is bytes: Hugging Face has no tokenizer file for it")
        return None
    if tokenizer is None:
        log.warning("The run records no tokenizer file: none exported (--tokenizer=PATH)")
    return tokenizer


def export_trainer_dir(
    trainer_dir: str,
    output: str,
    *,
    step: Optional[int] = None,
    dtype: Optional[str] = None,
    max_shard_size: str = hf_checkpoint.DEFAULT_MAX_SHARD_SIZE,
    tokenizer: Optional[str] = None,
    merge_lora: bool = False,
) -> tuple[int, str, list[str]]:
    """Exports the model of `trainer_dir` at `step` (None: the latest checkpoint) as a
    Hugging Face Llama directory `output`: weights in `dtype` (None: the run's parameter
    dtype, model.dtype), the config.json fields of the Hugging Face model the run started
    from (`HfLlamaWeights.Config.source_fields`), and the tokenizer recorded with its data
    (`trainer_dir.recorded_tokenizer`) unless `tokenizer` names one. Returns (step, the
    weights' dtype, the files written).

    A LoRA run (`axlearn.common.lora`) is exported as a PEFT adapter directory
    (`hf_peft.write_adapter`: float32 adapters, loaded onto the base model by
    `peft.PeftModel.from_pretrained`), or with `merge_lora` as the Llama with each adapter
    merged into its base weight."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common import trainer_dir as trainer_dir_lib

    trainer_cfg = trainer_dir_lib.read_trainer_config(trainer_dir)
    # The run's language model: its model, or the one it wraps (a DPO run's policy).
    lm_config = language_model_config(trainer_cfg.model)
    llama_dims(lm_config)  # Refuses a model a Llama cannot express, before reading.
    limit = hf_checkpoint.parse_size(max_shard_size)
    has_lora = bool(lora.lora_layer_configs(lm_config))
    if merge_lora and not has_lora:
        raise ConfigError(f"--merge_lora: the run in {trainer_dir} has no LoRA adapters")
    adapters_only = has_lora and not merge_lora
    if adapters_only:
        if dtype not in (None, "float32"):
            raise ConfigError(
                f"--dtype={dtype}: PEFT adapters are written in float32; --dtype applies to "
                "the weights of --merge_lora"
            )
        dtype = "float32"
        model = lm_config.clone(name="model").instantiate(parent=None)
        hf_peft.adapter_settings(model)  # Refuses adapters PEFT cannot name, before reading.
    if dtype is None:
        dtype = jnp.dtype(lm_config.dtype or jnp.float32).name
        log.info("Writing %s weights, the run's parameter dtype (--dtype to choose)", dtype)
    init_params = trainer_cfg.init_params
    if init_params is not None and "source" in init_params.keys():
        init_params = init_params.source  # The language model's (dpo.PolicyWeights).
    source = getattr(init_params, "source_fields", None) if init_params is not None else None
    tokenizer = export_tokenizer(trainer_cfg, tokenizer)
    restored_step, _, params = trainer_dir_lib.restore_language_model(
        trainer_dir, step=step, frozen=not adapters_only  # Adapters need no base.
    )
    if adapters_only:
        base = getattr(init_params, "path", None) if init_params is not None else None
        written = hf_peft.write_adapter(output, model, params, base_model=base)
        if tokenizer is not None:
            written += hf_checkpoint.copy_tokenizer(tokenizer, output)
        return restored_step, dtype, written
    model_cfg = lm_config
    if has_lora:
        model = model_cfg.clone(name="model").instantiate(parent=None)
        params = lora.merged_params(model, params)
        model_cfg = lora.base_model_config(model_cfg)
    written = write_hf_model(
        params,
        model_cfg,
        output,
        dtype=dtype,
        max_shard_size=limit,
        tokenizer=tokenizer,
        source=source,
    )
    return restored_step, dtype, written


COMMANDS = ("export",)  # The command's subcommands: export writes a trainer directory's model.


def define_flags(flag_values: flags.FlagValues) -> None:
    """The flags of `export` (a trainer directory's model as an HF Llama), on `flag_values`."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_string("trainer_dir", None, "The trainer directory to export from.", **fv)
    flags.DEFINE_integer("step", None, "The step to export. Default: the latest checkpoint.", **fv)
    flags.DEFINE_string("output", None, "The Hugging Face directory to write.", **fv)
    flags.DEFINE_enum(
        "dtype",
        None,
        _EXPORT_DTYPES,
        "The weights' dtype. Default: the run's parameter dtype (model.dtype).",
        **fv,
    )
    flags.DEFINE_string(
        "max_shard_size",
        hf_checkpoint.DEFAULT_MAX_SHARD_SIZE,
        "Largest safetensors file (e.g. 5GB, 500MB); above it the weights are sharded.",
        **fv,
    )
    flags.DEFINE_string(
        "tokenizer",
        None,
        "A tokenizer.json or SentencePiece .model to include; default: the one recorded "
        "with the run's data.",
        **fv,
    )
    flags.DEFINE_bool(
        "merge_lora",
        False,
        "A LoRA run: write the model with its adapters merged into the weights instead of "
        "a PEFT adapter directory.",
        **fv,
    )
    flags.mark_flags_as_required(["trainer_dir", "output"], flag_values=flag_values)


def run_export_command(
    argv: Optional[Sequence[str]],
    *,
    program: str,
    doc: Optional[str],
    export: Callable[..., tuple[int, Optional[str], str, list[str]]],
) -> None:
    """The `export` command of `program` (`hf_llama`'s and `hf_models`'): parses `argv` for
    `define_flags` (`doc`: its --help), calls `export(trainer_dir, output, step=..., dtype=...,
    max_shard_size=..., tokenizer=..., merge_lora=...)`, which returns (step, the family
    written or None, the weights' dtype, the files written), and prints what was written.
    A refusal exits with one line, "<module> export: <why>"."""
    args, commands = parse_command_flags(
        define_flags,
        argv,
        program=program,
        doc=doc,
        positional=COMMANDS,
        reads_config_text=True,
    )
    if commands != ["export"]:
        usage_error(program, f"give one command, {' or '.join(COMMANDS)}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # Its backend probes.
    try:
        step, family, dtype, written = export(
            args.trainer_dir,
            args.output,
            step=args.step,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            tokenizer=args.tokenizer,
            merge_lora=args.merge_lora,
        )
    except (ConfigError, ValueError, KeyError, CheckpointCorruptError) as e:
        raise SystemExit(f"{program.rsplit('.', 1)[-1]} export: {e}") from e
    family = f" as {family}" if family else ""
    print(
        f"Exported step {step} of {args.trainer_dir} to {args.output}{family} ({dtype} weights): "
        f"{', '.join(written)}"
    )


def main(argv: Optional[Sequence[str]] = None) -> None:
    """`export`: writes a trainer directory's model as a Hugging Face Llama directory."""

    def export(*args, **kwargs) -> tuple[int, None, str, list[str]]:
        step, dtype, written = export_trainer_dir(*args, **kwargs)
        return step, None, dtype, written

    run_export_command(argv, program="axlearn.common.hf_llama", doc=__doc__, export=export)


if __name__ == "__main__":
    main()
