"""Hugging Face Qwen2, Qwen3, Qwen3-MoE and Mistral models to and from ours, and one entry
point per use for every family (Llama through `hf_llama`): `--init_from_hf`
(`warm_start_model_config`, `HfWeights`), `generate --hf_dir` (`model_config_from_hf`,
`param_views`) and `export`.

Each family is a Llama (`hf_llama`: fused grouped q/k/v projection under half-rotating
RoPE, SwiGLU, pre-norm RMSNorm, tied or untied head) with some of:

  q/k/v biases          Qwen2 (always), Qwen3 and Qwen3-MoE (`attention_bias`, which also
                        gives o_proj a bias): FusedGroupedQKVLinear's layer.bias, and the
                        attention's output_linear.bias
  QK-norm               Qwen3, Qwen3-MoE: RMSNorm over each query and key head before
                        RoPE, `attention.QKNormQKVLinear` between RoFormerQKVLinear and the
                        fused projection (eps: rms_norm_eps)
  sliding window        Mistral (`sliding_window`), Qwen (`use_sliding_window` with every
                        layer sliding): decoder.attention_mask is a
                        SlidingWindowAttentionLogitBiasLayer of sliding_window_size =
                        sliding_window - 1 (HF counts the token itself)
  experts               Qwen3-MoE: each feed-forward layer a
                        TransformerFeedForwardDropFreeMoE with TopKDropFreeGating, as
                        `hf_mixtral` builds Mixtral's: softmax over the experts, the top k
                        renormalized (norm_topk_prob=true), no token dropped

Refused by name: fields the families cannot express (as `hf_llama` refuses Llama's), Qwen
sliding windows on some layers only, Qwen3-MoE's norm_topk_prob=false, dense layers among
the experts (mlp_only_layers, decoder_sparse_step > 1).

HF names beyond Llama's (per layer i; `attention` as in hf_llama):

  self_attn.{q,k,v}_proj.bias [N*H|K*H]   attention/i_proj/i_proj/qkv_proj/bias [N+2K, H]
  self_attn.o_proj.bias [D]               attention/o_proj/bias [D]
  self_attn.{q,k}_norm.weight [H]         attention/i_proj/i_proj/{q,k}_norm/scale
  (with QK-norm the projection is one level lower: attention/i_proj/i_proj/i_proj/qkv_proj)
  mlp.gate.weight [E, D]                  feed_forward/gate_weight [D, E]
  mlp.experts.{e}.gate_proj / up_proj.weight [F, D]  (or fused mlp.experts.gate_up_proj
                                          [E, 2F, D])  feed_forward/wi_0_weight / wi_1_weight
                                          [E, D, F]
  mlp.experts.{e}.down_proj.weight [D, F] (or mlp.experts.down_proj [E, D, F])
                                          feed_forward/wo_weight [E, F, D]

    python -m axlearn.common.hf_models export --trainer_dir=T --output=DIR [--step=N] \\
        [--dtype=bfloat16] [--max_shard_size=5GB] [--tokenizer=PATH]

writes a run's model as the family it came from (`HfWeights.Config.model_type`) or, for a
run that did not start from Hugging Face, the family its config has (QK-norm: Qwen3, MoE
with QK-norm: Qwen3-MoE, q/k/v biases: Qwen2, a sliding window: Mistral, else Llama).
"""

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from axlearn.common import hf_checkpoint, hf_llama, hf_mixtral, lora
from axlearn.common.attention import (
    QKNormQKVLinear,
    RoFormerQKVLinear,
    SlidingWindowAttentionLogitBiasLayer,
    StackedTransformerLayer,
)
from axlearn.common.causal_lm import Model
from axlearn.common.config import (
    REQUIRED,
    ConfigBase,
    ConfigError,
    Configurable,
    Required,
    config_class,
)
from axlearn.common.hf_checkpoint import Concat, SplitAxis, Stack, Tensor, TensorView, Transpose
from axlearn.common.hf_llama import LlamaDims
from axlearn.common.layers import RMSNorm
from axlearn.common.mixture_of_experts import TransformerFeedForwardDropFreeMoE

log = logging.getLogger(__name__)

# model_type -> (architecture, display name).
FAMILIES = {
    "llama": ("LlamaForCausalLM", "Llama"),
    "mistral": ("MistralForCausalLM", "Mistral"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3-MoE"),
}


@dataclasses.dataclass(frozen=True)
class Features:
    """What a family's model adds to a Llama (see the module doc)."""

    model_type: str
    qkv_bias: bool = False
    output_bias: bool = False
    qk_norm: bool = False
    sliding_window: Optional[int] = None  # Hugging Face's count (the token itself included).
    num_experts: int = 0  # 0: dense feed-forward layers.
    num_experts_per_token: int = 0
    router_aux_loss_coef: float = 0.0


# ----- our config of a family -----


def with_features(llama: Model.Config, features: Features) -> Model.Config:
    """The Llama config `llama` (`hf_llama.llama_model_config`) with `features` added."""
    cfg = llama.clone()
    attention = cfg.decoder.transformer.layer.self_attention.attention
    fused = attention.input_linear.input_linear
    fused.layer.bias = features.qkv_bias
    attention.output_linear.bias = features.output_bias
    if features.qk_norm:
        norm = RMSNorm.default_config().set(eps=cfg.decoder.output_norm.eps)
        attention.input_linear.input_linear = QKNormQKVLinear.default_config().set(
            input_linear=fused, norm=norm
        )
    if features.sliding_window is not None:
        cfg.decoder.attention_mask = SlidingWindowAttentionLogitBiasLayer.default_config().set(
            sliding_window_size=features.sliding_window - 1
        )
    if features.num_experts:
        cfg = hf_mixtral._with_experts(  # pylint: disable=protected-access
            cfg,
            num_experts=features.num_experts,
            num_experts_per_token=features.num_experts_per_token,
            router_aux_loss_coef=features.router_aux_loss_coef,
        )
    return cfg


def family_model_config(model_type: str, **kwargs) -> Model.Config:
    """A float32 model config of the family `model_type` (a FAMILIES key): the
    `hf_llama.llama_model_config` keyword arguments plus the `Features` fields (hidden_dim
    is each expert's where num_experts is set)."""
    names = {field.name for field in dataclasses.fields(Features)} - {"model_type"}
    features = Features(model_type, **{k: kwargs.pop(k) for k in list(kwargs) if k in names})
    _check_family(features)
    return with_features(hf_llama.llama_model_config(**kwargs), features)


def _check_family(features: Features) -> None:
    """ConfigError naming what the family of `features` cannot have."""
    model_type = features.model_type
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type={model_type!r} is not one of {sorted(FAMILIES)}")
    name = FAMILIES[model_type][1]
    wants = {
        "llama": dict(qkv_bias=False, output_bias=False, qk_norm=False, sliding=False, moe=False),
        "mistral": dict(qkv_bias=False, output_bias=False, qk_norm=False, moe=False),
        "qwen2": dict(qkv_bias=True, output_bias=False, qk_norm=False, moe=False),
        "qwen3": dict(qk_norm=True, moe=False),
        "qwen3_moe": dict(qk_norm=True, moe=True),
    }[model_type]
    have = dict(
        qkv_bias=features.qkv_bias,
        output_bias=features.output_bias,
        qk_norm=features.qk_norm,
        sliding=features.sliding_window is not None,
        moe=bool(features.num_experts),
    )
    problems = [f"{key}={have[key]} (a {name} has {value})" for key, value in wants.items()
                if have[key] != value]
    if model_type in ("qwen3", "qwen3_moe") and features.qkv_bias != features.output_bias:
        problems.append(
            f"q/k/v bias {features.qkv_bias} but o_proj bias {features.output_bias} (a {name} "
            "has both or neither: attention_bias)"
        )
    if problems:
        raise ConfigError(f"Hugging Face {name} cannot express: {'; '.join(problems)}")


# ----- from a Hugging Face config -----


def _window_from_hf(config: Mapping[str, Any], model_type: str) -> Optional[int]:
    """The sliding window of every layer (None: none); ConfigError where only some slide."""
    if model_type == "mistral":
        window = config.get("sliding_window")
        return None if window is None else int(window)
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    if window is None:
        return None
    num_layers = config["num_hidden_layers"]
    layer_types = config.get("layer_types")
    if layer_types is None:  # transformers' rule: the layers from max_window_layers on.
        start = config.get("max_window_layers", 28) if model_type != "qwen3_moe" else 0
        layer_types = ["sliding_attention" if i >= start else "full_attention"
                       for i in range(num_layers)]
    kinds = sorted(set(layer_types))
    if kinds == ["full_attention"]:
        return None
    if kinds != ["sliding_attention"]:
        raise ConfigError(
            f"layer_types={list(layer_types)} (max_window_layers="
            f"{config.get('max_window_layers')}): a sliding window on some layers only is not "
            "supported (need every layer sliding or none)"
        )
    return int(window)


def features_from_hf(config: Mapping[str, Any]) -> Features:
    """The Features of a config.json dict of a FAMILIES model type other than llama;
    ConfigError naming each field we cannot express."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES or model_type == "llama":
        raise ConfigError(
            f"model_type={model_type!r} (need one of {sorted(FAMILIES)})"
        )
    problems = []
    window = None
    try:
        window = _window_from_hf(config, model_type)
    except ConfigError as e:
        problems.append(str(e))
    bias = bool(config.get("attention_bias", False))
    features = Features(model_type, sliding_window=window)
    if model_type == "qwen2":
        features = dataclasses.replace(features, qkv_bias=True)
    elif model_type in ("qwen3", "qwen3_moe"):
        features = dataclasses.replace(features, qkv_bias=bias, output_bias=bias, qk_norm=True)
    elif bias:
        problems.append(f"attention_bias={bias!r} (need False)")
    if model_type == "qwen3_moe":
        required = (("norm_topk_prob", True), ("decoder_sparse_step", 1), ("mlp_only_layers", []))
        for field, expected in required:
            value = config.get(field, False if field == "norm_topk_prob" else expected)
            if value != expected:
                problems.append(f"{field}={value!r} (need {expected!r})")
        num_experts = config.get("num_experts", config.get("num_local_experts"))
        if not num_experts:
            problems.append(f"num_experts={num_experts!r} (need > 0)")
        features = dataclasses.replace(
            features,
            num_experts=int(num_experts or 0),
            num_experts_per_token=int(config.get("num_experts_per_tok", 8)),
            router_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
        )
    # pylint: disable=protected-access
    llama = dict(config, model_type="llama", attention_bias=False)
    try:  # The Llama part's fields, named together with the rest.
        hf_llama._check_hf_fields(llama, hf_llama._hf_rope(llama)[1])
    except ConfigError as e:
        problems.append(str(e).split(": ", 1)[1])
    if problems:
        raise ConfigError(f"Hugging Face config fields not supported: {'; '.join(problems)}")
    return features


def model_config_from_hf(
    hf_config: Any,
    *,
    generation_config: Optional[Mapping[str, Any]] = None,
    repeated: bool = True,
) -> Model.Config:
    """Our Model config equivalent to a Hugging Face config (a config.json dict or a
    transformers config object) of any FAMILIES model type; ConfigError naming the fields
    we cannot express."""
    config = hf_llama._hf_dict(hf_config)  # pylint: disable=protected-access
    if config.get("model_type", "llama") == "llama":
        return hf_llama.llama_config_from_hf(
            config, generation_config=generation_config, repeated=repeated
        )
    features = features_from_hf(config)
    # The Llama part reads as a Llama's; the features are checked above.
    llama = dict(config, model_type="llama", attention_bias=False)
    if features.num_experts:
        llama["intermediate_size"] = config["moe_intermediate_size"]
    cfg = hf_llama.llama_config_from_hf(
        llama, generation_config=generation_config, repeated=repeated
    )
    return with_features(cfg, features)


# ----- is a config one of the families? -----


def _attention(cfg: Model.Config) -> Any:
    return cfg.decoder.transformer.layer.self_attention.attention


def _features_of(cfg: Model.Config, model_type: Optional[str]) -> tuple[Features, Model.Config]:
    """(the Features that `cfg` has, `cfg` without them: a Llama-shaped config)."""
    view = cfg.clone()
    layer = getattr(view.decoder.transformer, "layer", None)
    if getattr(view, "klass", None) is not Model or isinstance(layer, (list, tuple)):
        hf_llama.llama_dims(view)  # Raises naming what is not even Llama-shaped.
    attention = _attention(view)
    rope = attention.input_linear
    qk_norm = False
    if getattr(rope, "klass", None) is RoFormerQKVLinear:
        qk_norm = getattr(rope.input_linear, "klass", None) is QKNormQKVLinear
        if qk_norm:
            rope.input_linear = rope.input_linear.input_linear
    fused_layer = getattr(getattr(rope, "input_linear", None), "layer", None)
    qkv_bias = bool(getattr(fused_layer, "bias", False))
    output_bias = bool(attention.output_linear.bias)
    if fused_layer is not None:
        fused_layer.bias = False
    attention.output_linear.bias = False
    window = None
    mask = view.decoder.attention_mask
    if getattr(mask, "klass", None) is SlidingWindowAttentionLogitBiasLayer:
        window = mask.sliding_window_size + 1
        view.decoder.attention_mask = "causal"
    ff = view.decoder.transformer.layer.feed_forward
    experts = {}
    if ff.klass is TransformerFeedForwardDropFreeMoE:
        top_k = ff.gating.num_experts_per_token
        experts = dict(
            num_experts=ff.num_experts,
            num_experts_per_token=top_k,
            router_aux_loss_coef=ff.load_balance_loss_weight / top_k,
        )
        view = hf_mixtral._llama_view(view)  # pylint: disable=protected-access
    if model_type is None:
        if qk_norm:
            model_type = "qwen3_moe" if experts else "qwen3"
        elif experts:
            raise ConfigError(
                "decoder.transformer.layer.feed_forward: experts without QK-norm are a "
                "Mixtral (hf_mixtral), which export does not write"
            )
        elif qkv_bias:
            model_type = "qwen2"
        elif window is not None:
            model_type = "mistral"
        else:
            model_type = "llama"
    features = Features(
        model_type, qkv_bias=qkv_bias, output_bias=output_bias, qk_norm=qk_norm,
        sliding_window=window, **experts,
    )
    return features, view


def _differences(have: Any, want: Any, path: str, family: str) -> list[str]:
    """hf_llama's field-by-field comparison, naming `family` as the reference."""
    # pylint: disable=protected-access
    if (
        isinstance(have, ConfigBase)
        and isinstance(want, ConfigBase)
        and hf_llama._same_target(have, want)
    ):
        found = []
        for name in sorted(set(have.keys()) | set(want.keys())):
            child = f"{path}.{name}" if path else name
            found += _differences(getattr(have, name), getattr(want, name), child, family)
        return found
    if isinstance(have, ConfigBase) or isinstance(want, ConfigBase):
        same = have == want
    else:
        same = hf_llama._comparable(have) == hf_llama._comparable(want)
    if same:
        return []
    return [f"{path} is {hf_llama._shown(have)} (a {family} has {hf_llama._shown(want)})"]


def model_dims(
    cfg: Model.Config, *, model_type: Optional[str] = None
) -> tuple[Features, LlamaDims]:
    """(Features, the sizes) of `cfg` once checked to compute what the Hugging Face model
    of `model_type` computes (None: the family its features say, module doc); every other
    difference from that family's config of these sizes (outside hf_llama's neutral
    fields) is a ConfigError naming it."""
    # pylint: disable=protected-access
    features, view = _features_of(cfg, model_type)
    _check_family(features)
    structure = hf_llama._structure(view)
    canonical = with_features(hf_llama.llama_model_config(**structure), features)
    actual = hf_llama._spelled_out(cfg)
    hf_llama._copy_neutral_fields(actual, canonical)
    if features.num_experts:  # A training-only term, and the coefficient's float round trip.
        ff = actual.decoder.transformer.layer.feed_forward
        canonical.decoder.transformer.layer.feed_forward.load_balance_loss_weight = (
            ff.load_balance_loss_weight
        )
    family = FAMILIES[features.model_type][1]
    differences = _differences(actual, hf_llama._spelled_out(canonical), "", family)
    if differences:
        raise ConfigError(
            f"The model is not a {family}; Hugging Face {family} cannot express: "
            f"{'; '.join(differences)}"
        )
    dims = LlamaDims(
        vocab_size=structure["vocab_size"],
        dim=structure["dim"],
        num_layers=structure["num_layers"],
        num_heads=structure["num_heads"],
        num_kv_heads=structure["num_kv_heads"],
        head_dim=structure["head_dim"],
        hidden_dim=structure["hidden_dim"],
        tied=structure["tie_word_embeddings"],
        repeated=structure["repeated"],
    )
    return features, dims


def llama_view(cfg: Model.Config) -> Model.Config:
    """`cfg` without its family's features: a Llama config of its sizes."""
    return _features_of(cfg, None)[1]


# ----- to a Hugging Face config -----


def hf_config_dict(
    cfg: Model.Config,
    *,
    model_type: Optional[str] = None,
    dtype: str = "float32",
    source: Optional[Mapping[str, Any]] = None,
) -> dict[str, Any]:
    """The config.json of the Hugging Face model equivalent to `cfg` (see `model_dims`),
    with the `source` fields of the model it started from."""
    features, dims = model_dims(cfg, model_type=model_type)
    source = dict(source or {})
    config = hf_llama.hf_config_dict(llama_view(cfg), dtype=dtype, source=source)
    model_type = features.model_type
    if model_type == "llama":
        return config
    config["architectures"] = [FAMILIES[model_type][0]]
    config["model_type"] = model_type
    del config["mlp_bias"]
    if model_type in ("qwen3", "qwen3_moe"):
        config["attention_bias"] = features.qkv_bias
    else:
        del config["attention_bias"]
    window = features.sliding_window
    if model_type == "mistral":
        config["sliding_window"] = window
    else:
        config["use_sliding_window"] = window is not None
        config["sliding_window"] = window
        if model_type != "qwen3_moe":
            config["max_window_layers"] = 0 if window is not None else dims.num_layers
            kind = "sliding_attention" if window is not None else "full_attention"
            config["layer_types"] = [kind] * dims.num_layers
    if features.num_experts:
        config.update(
            num_experts=features.num_experts,
            num_experts_per_tok=features.num_experts_per_token,
            moe_intermediate_size=dims.hidden_dim,
            intermediate_size=int(source.get("intermediate_size", dims.hidden_dim)),
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=features.router_aux_loss_coef,
        )
    return config


def hf_config_object(cfg: Model.Config, *, model_type: Optional[str] = None) -> Any:
    """A transformers config object equivalent to `cfg`."""
    import transformers  # pylint: disable=import-outside-toplevel

    config = hf_config_dict(cfg, model_type=model_type)
    model_type = config.pop("model_type")
    for key in ("architectures", "torch_dtype"):
        del config[key]
    return transformers.AutoConfig.for_model(model_type, **config)


# ----- parameters as views of the HF tensors -----

_normalize = hf_checkpoint._normalize  # pylint: disable=protected-access


class _Permute(TensorView):
    """`source` with its axes permuted (`axes` as numpy.transpose takes them)."""

    def __init__(self, source: TensorView, axes: Sequence[int]):
        self._source, self._axes = source, tuple(axes)
        self.shape = tuple(source.shape[a] for a in self._axes)

    def read(self, index=()) -> np.ndarray:
        index = _normalize(index, self.shape)
        source_index = [None] * len(self.shape)
        for out_axis, in_axis in enumerate(self._axes):
            source_index[in_axis] = index[out_axis]
        return self._source.read(tuple(source_index)).transpose(self._axes)


class _Slice(TensorView):
    """Entries [start, start + size) of `source` along `axis`."""

    def __init__(self, source: TensorView, axis: int, start: int, size: int):
        self._source, self._axis, self._start = source, axis, start
        shape = list(source.shape)
        shape[axis] = size
        self.shape = tuple(shape)

    def read(self, index=()) -> np.ndarray:
        index = list(_normalize(index, self.shape))
        cut = index[self._axis]
        index[self._axis] = slice(cut.start + self._start, cut.stop + self._start)
        return self._source.read(tuple(index))


def _expert_views(reader: Any, i: int, features: Features) -> dict[str, TensorView]:
    """Layer i's expert weights as views of either layout (module doc)."""
    prefix = f"model.layers.{i}.mlp."
    names = reader.names()
    gate = Transpose(Tensor(reader, prefix + "gate.weight"))
    if prefix + "experts.gate_up_proj" in names:
        gate_up = Tensor(reader, prefix + "experts.gate_up_proj")  # [E, 2F, D]
        hidden = gate_up.shape[1] // 2
        return dict(
            gate_weight=gate,
            wi_0_weight=_Permute(_Slice(gate_up, 1, 0, hidden), (0, 2, 1)),
            wi_1_weight=_Permute(_Slice(gate_up, 1, hidden, hidden), (0, 2, 1)),
            wo_weight=_Permute(Tensor(reader, prefix + "experts.down_proj"), (0, 2, 1)),
        )

    def experts(name: str) -> TensorView:  # Per expert [out, in] -> [E, in, out].
        return Stack(
            [Transpose(Tensor(reader, f"{prefix}experts.{e}.{name}.weight"))
             for e in range(features.num_experts)]
        )

    return dict(
        gate_weight=gate,
        wi_0_weight=experts("gate_proj"),
        wi_1_weight=experts("up_proj"),
        wo_weight=experts("down_proj"),
    )


def _layer_views(reader: Any, i: int, dims: LlamaDims, features: Features) -> dict[str, Any]:
    """Our parameters of transformer layer i as views of the HF tensors."""
    prefix = f"model.layers.{i}."
    n, k, h = dims.num_heads, dims.num_kv_heads, dims.head_dim

    def tensor(name: str) -> TensorView:
        return Tensor(reader, prefix + name)

    def heads(name: str, num: int) -> TensorView:  # [num*H, D] -> [D, num, H]
        return SplitAxis(Transpose(tensor(name)), 1, (num, h))

    qkv = dict(
        weight=Concat(
            [heads("self_attn.q_proj.weight", n), heads("self_attn.k_proj.weight", k),
             heads("self_attn.v_proj.weight", k)],
            axis=1,
        )
    )
    if features.qkv_bias:
        qkv["bias"] = Concat(
            [SplitAxis(tensor(f"self_attn.{name}_proj.bias"), 0, (num, h))
             for name, num in (("q", n), ("k", k), ("v", k))],
            axis=0,
        )
    i_proj = dict(i_proj=dict(qkv_proj=qkv))
    if features.qk_norm:
        i_proj = dict(
            i_proj=dict(
                i_proj=i_proj["i_proj"],
                q_norm=dict(scale=tensor("self_attn.q_norm.weight")),
                k_norm=dict(scale=tensor("self_attn.k_norm.weight")),
            )
        )
    o_proj = dict(weight=SplitAxis(tensor("self_attn.o_proj.weight"), 1, (n, h)))
    if features.output_bias:
        o_proj["bias"] = tensor("self_attn.o_proj.bias")
    ff = dict(norm=dict(scale=tensor("post_attention_layernorm.weight")))
    if features.num_experts:
        ff.update(_expert_views(reader, i, features))
    else:
        ff.update(
            linear1_0=dict(weight=Transpose(tensor("mlp.gate_proj.weight"))),
            linear1_1=dict(weight=Transpose(tensor("mlp.up_proj.weight"))),
            linear2=dict(weight=Transpose(tensor("mlp.down_proj.weight"))),
        )
    return dict(
        self_attention=dict(
            norm=dict(scale=tensor("input_layernorm.weight")),
            attention=dict(i_proj=i_proj, o_proj=o_proj),
        ),
        feed_forward=ff,
    )


def param_views(reader: Any, cfg: Model.Config, *, model_type: Optional[str] = None) -> Any:
    """Our parameter tree of `cfg` (any family) as views of the HF tensors of `reader`
    (`hf_checkpoint.SafetensorsReader` or `ArrayReader`); KeyError naming a missing one."""
    features, dims = model_dims(cfg, model_type=model_type)
    if features.model_type == "llama":
        return hf_llama.param_views(reader, dims)
    try:
        layers = [_layer_views(reader, i, dims, features) for i in range(dims.num_layers)]
        decoder = dict(
            emb=dict(token_emb=dict(weight=Tensor(reader, "model.embed_tokens.weight"))),
            output_norm=dict(scale=Tensor(reader, "model.norm.weight")),
        )
        if not dims.tied:
            decoder["lm_head"] = dict(weight=Transpose(Tensor(reader, "lm_head.weight")))
    except KeyError as e:
        raise KeyError(
            f"The HF checkpoint lacks {e.args[0]} for a {FAMILIES[features.model_type][1]} "
            f"of {dims}"
        ) from None
    if dims.repeated:
        decoder["transformer"] = dict(
            repeat=dict(layer=hf_llama._stack_views(layers))  # pylint: disable=protected-access
        )
    else:
        decoder["transformer"] = {f"layer{i}": layer for i, layer in enumerate(layers)}
    return dict(decoder=decoder)


def params_from_hf(
    state_dict: Mapping[str, Any], cfg: Model.Config, *, model_type: Optional[str] = None
) -> dict[str, Any]:
    """Our parameter tree (jax arrays of cfg.dtype, default float32) from an HF state dict."""
    views = param_views(hf_checkpoint.ArrayReader(dict(state_dict)), cfg, model_type=model_type)
    dtype = cfg.dtype or jnp.float32
    return hf_checkpoint.map_views(lambda view: jnp.asarray(view.read(), dtype=dtype), views)


class HfWeights(Configurable):
    """The initial parameters of a fresh run (`SpmdTrainer.Config.init_params`): the
    weights of a local Hugging Face directory of a FAMILIES model type other than llama
    (`hf_llama.HfLlamaWeights` reads a Llama's), each device's shard of each parameter
    read on its own."""

    @config_class
    class Config(Configurable.Config):
        """Configures HfWeights."""

        path: Required[str] = REQUIRED  # A local Hugging Face model directory.
        model_type: Required[str] = REQUIRED  # Its config.json's (FAMILIES); export writes it.
        # Fields of its config.json that the model config does not carry (bos_token_id,
        # max_position_embeddings, ...; `hf_llama.source_fields`), which export writes back.
        source_fields: Optional[dict[str, Any]] = None

    def load(self, *, model_config: Model.Config, param_specs: Any, shardings: Any) -> Any:
        """The parameters of `model_config` (the checkpoint's sizes) in the shapes and
        dtypes of `param_specs`, placed by `shardings`."""
        cfg = self.config
        reader = hf_checkpoint.SafetensorsReader(cfg.path)
        log.info("Loading the weights of %s, each device's shard on its own", cfg.path)
        views = param_views(reader, model_config, model_type=cfg.model_type)
        return hf_llama.load_views(reader.directory, views, param_specs, shardings)


def warm_start(recipe: Model.Config, hf_directory: str) -> tuple[Model.Config, ConfigBase]:
    """(the model of the Hugging Face directory with `recipe`'s function-neutral settings
    (`hf_llama.warm_start_model_config`), the `init_params` config that loads it)."""
    config = hf_checkpoint.read_config(hf_directory)
    model_type = config.get("model_type", "llama")
    source = hf_llama.source_fields(hf_directory)
    if model_type != "llama" and lora.lora_layer_configs(recipe):
        raise ConfigError(
            f"{hf_directory}/{hf_checkpoint.CONFIG_FILE}: model_type {model_type!r}; LoRA "
            "configs (e.g. llama_lora) take a Llama directory"
        )
    if model_type == "llama":
        model = hf_llama.warm_start_model_config(recipe, hf_directory)
        weights = hf_llama.HfLlamaWeights.default_config().set(
            path=hf_directory, source_fields=source
        )
        return model, weights
    repeated = getattr(recipe.decoder.transformer, "klass", None) is not StackedTransformerLayer
    try:
        model = model_config_from_hf(
            config,
            generation_config=hf_checkpoint.read_generation_config(hf_directory),
            repeated=repeated,
        )
    except ConfigError as e:
        raise ConfigError(f"{hf_directory}/{hf_checkpoint.CONFIG_FILE}: {e}") from e
    hf_llama._copy_neutral_fields(recipe, model)  # pylint: disable=protected-access
    if recipe.decoder.lm_head is None and model.decoder.lm_head is not None:
        table = recipe.decoder.emb.token_emb.param_partition_spec
        if table is not None:  # An untied head for a tied recipe: split like the table.
            model.decoder.lm_head.param_partition_spec = tuple(reversed(tuple(table)))
    weights = HfWeights.default_config().set(
        path=hf_directory, model_type=model_type, source_fields=source
    )
    return model, weights


# ----- our parameters to HF tensors -----


def _layer_to_hf(
    layer: dict[str, Any], i: int, dims: LlamaDims, features: Features, *, fused: bool
) -> dict[str, np.ndarray]:
    prefix = f"model.layers.{i}."
    d, n, k, h = dims.dim, dims.num_heads, dims.num_kv_heads, dims.head_dim
    attention = layer["self_attention"]["attention"]
    i_proj = attention["i_proj"]["i_proj"]
    if features.qk_norm:
        out = {
            prefix + "self_attn.q_norm.weight": i_proj["q_norm"]["scale"],
            prefix + "self_attn.k_norm.weight": i_proj["k_norm"]["scale"],
        }
        i_proj = i_proj["i_proj"]
    else:
        out = {}
    qkv = i_proj["qkv_proj"]
    weight = qkv["weight"]
    parts = (("q", 0, n), ("k", n, k), ("v", n + k, k))
    for name, start, num in parts:
        out[f"{prefix}self_attn.{name}_proj.weight"] = (
            weight[:, start : start + num].reshape(d, num * h).T
        )
        if features.qkv_bias:
            out[f"{prefix}self_attn.{name}_proj.bias"] = (
                qkv["bias"][start : start + num].reshape(num * h)
            )
    out[prefix + "self_attn.o_proj.weight"] = attention["o_proj"]["weight"].reshape(d, n * h)
    if features.output_bias:
        out[prefix + "self_attn.o_proj.bias"] = attention["o_proj"]["bias"]
    out[prefix + "input_layernorm.weight"] = layer["self_attention"]["norm"]["scale"]
    ff = layer["feed_forward"]
    out[prefix + "post_attention_layernorm.weight"] = ff["norm"]["scale"]
    if features.num_experts:
        mlp = prefix + "mlp."
        out[mlp + "gate.weight"] = ff["gate_weight"].T
        if fused:
            gate_up = np.concatenate([ff["wi_0_weight"], ff["wi_1_weight"]], axis=2)
            out[mlp + "experts.gate_up_proj"] = gate_up.transpose(0, 2, 1)
            out[mlp + "experts.down_proj"] = ff["wo_weight"].transpose(0, 2, 1)
        else:
            for e in range(features.num_experts):
                out[f"{mlp}experts.{e}.gate_proj.weight"] = ff["wi_0_weight"][e].T
                out[f"{mlp}experts.{e}.up_proj.weight"] = ff["wi_1_weight"][e].T
                out[f"{mlp}experts.{e}.down_proj.weight"] = ff["wo_weight"][e].T
    else:
        out[prefix + "mlp.gate_proj.weight"] = ff["linear1_0"]["weight"].T
        out[prefix + "mlp.up_proj.weight"] = ff["linear1_1"]["weight"].T
        out[prefix + "mlp.down_proj.weight"] = ff["linear2"]["weight"].T
    return out


def params_to_hf(
    params: dict[str, Any],
    cfg: Model.Config,
    *,
    model_type: Optional[str] = None,
    framework: str = "pt",
    fused: bool = True,
) -> dict:
    """The HF state dict of our parameters (any family; see `model_dims`).

    framework 'pt': float32 torch tensors (for `load_state_dict`); 'np': numpy arrays.
    fused: experts in transformers 5's fused tensors (its state dict), else one tensor per
    expert (the Hub's files)."""
    features, _ = model_dims(cfg, model_type=model_type)

    def layer_to_hf(layer: dict[str, Any], i: int, dims: LlamaDims) -> dict[str, Any]:
        return _layer_to_hf(layer, i, dims, features, fused=fused)

    return hf_llama.params_to_hf(
        params, llama_view(cfg), framework=framework, layer_to_hf=layer_to_hf
    )


# ----- export -----


def write_hf_model(
    params: dict[str, Any],
    cfg: Model.Config,
    directory: str,
    *,
    model_type: Optional[str] = None,
    dtype: str = "bfloat16",
    max_shard_size: int = hf_checkpoint.parse_size(hf_checkpoint.DEFAULT_MAX_SHARD_SIZE),
    tokenizer: Optional[str] = None,
    source: Optional[Mapping[str, Any]] = None,
) -> list[str]:
    """Writes our model as a Hugging Face directory of its family (`model_dims`), as
    `hf_llama.write_hf_model` writes a Llama's (experts one tensor each, as on the Hub).
    Returns the names written."""
    features, _ = model_dims(cfg, model_type=model_type)
    if features.model_type == "llama":
        return hf_llama.write_hf_model(
            params, cfg, directory, dtype=dtype, max_shard_size=max_shard_size,
            tokenizer=tokenizer, source=source,
        )
    hf_llama.check_export_dtype(dtype)
    config = hf_config_dict(cfg, model_type=features.model_type, dtype=dtype, source=source)
    return hf_llama.write_hf_directory(
        directory,
        config,
        lambda: params_to_hf(
            params, cfg, model_type=features.model_type, framework="np", fused=False
        ),
        cfg=cfg,
        dtype=dtype,
        max_shard_size=max_shard_size,
        tokenizer=tokenizer,
        source=source,
    )


def export_trainer_dir(
    trainer_dir: str,
    output: str,
    *,
    step: Optional[int] = None,
    dtype: Optional[str] = None,
    max_shard_size: str = hf_checkpoint.DEFAULT_MAX_SHARD_SIZE,
    tokenizer: Optional[str] = None,
    merge_lora: bool = False,
) -> tuple[int, str, str, list[str]]:
    """`hf_llama.export_trainer_dir` for any family: the run's model at `step` written as
    the family it started from (or its config's, module doc). Returns (step, the family,
    the weights' dtype, the files written). A LoRA run (a Llama) is exported by
    `hf_llama.export_trainer_dir`: a PEFT adapter, or merged with `merge_lora`."""
    # pylint: disable-next=import-outside-toplevel
    from axlearn.common import trainer_dir as trainer_dir_lib

    trainer_cfg = trainer_dir_lib.read_trainer_config(trainer_dir)
    if merge_lora or lora.lora_layer_configs(trainer_cfg.model):
        step, dtype, written = hf_llama.export_trainer_dir(
            trainer_dir, output, step=step, dtype=dtype, max_shard_size=max_shard_size,
            tokenizer=tokenizer, merge_lora=merge_lora,
        )
        return step, "llama", dtype, written
    init_params = trainer_cfg.init_params
    model_type = getattr(init_params, "model_type", None) if init_params is not None else None
    features, _ = model_dims(trainer_cfg.model, model_type=model_type)  # Before reading.
    if features.model_type == "llama":
        step, dtype, written = hf_llama.export_trainer_dir(
            trainer_dir, output, step=step, dtype=dtype, max_shard_size=max_shard_size,
            tokenizer=tokenizer,
        )
        return step, "llama", dtype, written
    limit = hf_checkpoint.parse_size(max_shard_size)
    if dtype is None:
        dtype = jnp.dtype(trainer_cfg.model.dtype or jnp.float32).name
        log.info("Writing %s weights, the run's parameter dtype (--dtype to choose)", dtype)
    source = getattr(init_params, "source_fields", None) if init_params is not None else None
    tokenizer = hf_llama.export_tokenizer(trainer_cfg, tokenizer)
    restored_step, params = trainer_dir_lib.restore_model_params(trainer_dir, step=step)
    written = write_hf_model(
        params, trainer_cfg.model, output, model_type=features.model_type, dtype=dtype,
        max_shard_size=limit, tokenizer=tokenizer, source=source,
    )
    return restored_step, features.model_type, dtype, written


def main(argv: Optional[Sequence[str]] = None) -> None:
    """`export`: writes a trainer directory's model as a Hugging Face directory."""

    def export(*args, **kwargs) -> tuple[int, str, str, list[str]]:
        step, model_type, dtype, written = export_trainer_dir(*args, **kwargs)
        return step, FAMILIES[model_type][0], dtype, written

    hf_llama.run_export_command(
        argv, program="axlearn.common.hf_models", doc=__doc__, export=export
    )


if __name__ == "__main__":
    main()
