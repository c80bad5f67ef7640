"""Gala with sigmoid attention: GPTs whose attention is `attention.SigmoidAttention` with
ALiBi position biases (`attention.ALiBiAttentionLogitBiasLayer`) in place of RoPE, as in
AXLearn's sigmoid Gala experiments (https://arxiv.org/abs/2409.04431).

Each config is a GPT of `experiments/gpt.py` converted by `sigmoid_alibi`: every
self-attention keeps its projections, norms and heads, loses RoPE (its input linear is
the fused projection RoPE wrapped), and computes sigmoid(q k^T / sqrt(H) + ALiBi bias -
log(seq_len)) per key; the decoder's `attention_mask` layer supplies the ALiBi biases,
which also mask later positions and other packed documents.

- `gala_sigmoid_test`: gpt_test converted; trains on the Python standard library on the CPU.
- `gala_sigmoid_125m`: gpt_125m converted, on the reference corpora with its mesh rules.
"""

from collections.abc import Callable

from axlearn.common.attention import (
    ALiBiAttentionLogitBiasLayer,
    RoFormerQKVLinear,
    SigmoidAttention,
    TransformerLayer,
)
from axlearn.common.config import ConfigBase
from axlearn.common.trainer import SpmdTrainer
from experiments import gpt


def sigmoid_alibi(cfg: SpmdTrainer.Config, *, seq_len: int) -> SpmdTrainer.Config:
    """`cfg` with every TransformerLayer's self-attention turned into SigmoidAttention of
    training length `seq_len` without RoPE, and ALiBi biases from the decoder."""
    decoder = cfg.model.decoder
    num_heads = set()

    def enter(path: str, value) -> bool:
        del path
        if isinstance(value, TransformerLayer.Config):
            value.self_attention.attention = _sigmoid(value.self_attention.attention, seq_len)
            num_heads.add(value.self_attention.attention.num_heads)
            return False
        return True

    decoder.transformer.visit(lambda *_: None, enter)
    if len(num_heads) != 1:
        raise ValueError(f"sigmoid_alibi: expected one head count in the layers, got {num_heads}")
    decoder.attention_mask = ALiBiAttentionLogitBiasLayer.default_config().set(
        num_heads=num_heads.pop()
    )
    _rename_scaled_weights(cfg.learner, _ROPE_QKV_WEIGHT, _QKV_WEIGHT)
    return cfg


# The fused QKV weight's path with RoPE's wrapper (i_proj/i_proj) and without it.
_ROPE_QKV_WEIGHT = ".*attention/i_proj/i_proj/qkv_proj/weight"
_QKV_WEIGHT = ".*attention/i_proj/qkv_proj/weight"


def _rename_scaled_weights(learner: ConfigBase, old: str, new: str) -> None:
    """Points the learner's per-parameter scales (`scale_by_path`, e.g. muP's) at the QKV
    weight's new path, so that it is scaled as before."""

    def enter(path: str, value) -> bool:
        del path
        if isinstance(value, ConfigBase) and "scale_by_path" in value.keys():
            value.scale_by_path = [
                (new if regex == old else regex, scale) for regex, scale in value.scale_by_path
            ]
        return True

    learner.visit(lambda *_: None, enter)


def _sigmoid(attention: ConfigBase, seq_len: int) -> SigmoidAttention.Config:
    """SigmoidAttention with `attention`'s fields (but causal: the ALiBi biases mask)."""
    sigmoid = SigmoidAttention.default_config()
    for name in attention.keys():
        if name != "klass" and name in sigmoid.keys():
            setattr(sigmoid, name, getattr(attention, name))
    if isinstance(sigmoid.input_linear, RoFormerQKVLinear.Config):
        sigmoid.input_linear = sigmoid.input_linear.input_linear
    return sigmoid.set(causal=None, seq_len=seq_len)


def gala_sigmoid_test_trainer() -> SpmdTrainer.Config:
    """gpt_test with sigmoid attention and ALiBi; trains on the CPU."""
    cfg = gpt.gpt_test_trainer().set(name="gala_sigmoid_test")
    return sigmoid_alibi(cfg, seq_len=cfg.input.max_sequence_length)


def gala_sigmoid_125m_trainer() -> SpmdTrainer.Config:
    """gpt_125m with sigmoid attention and ALiBi, on the reference corpora."""
    cfg = gpt.gpt_trainer("125M").set(name="gala_sigmoid_125m")
    return sigmoid_alibi(cfg, seq_len=gpt.SIZES["125M"].max_sequence_length)


def named_trainer_configs() -> dict[str, Callable[[], SpmdTrainer.Config]]:
    return {
        "gala_sigmoid_test": gala_sigmoid_test_trainer,
        "gala_sigmoid_125m": gala_sigmoid_125m_trainer,
    }


# One line each for `--list_configs`, which prints it beside the parameter count.
DESCRIPTIONS = {
    "gala_sigmoid_test": "gpt_test with sigmoid attention and ALiBi position biases instead of "
    "RoPE; trains on the Python standard library on the CPU.",
    "gala_sigmoid_125m": "gpt_125m with sigmoid attention and ALiBi position biases instead of "
    "RoPE, on the reference corpora.",
}
