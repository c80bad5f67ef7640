"""A causal language model: a `Decoder` plus the next-token loss and its summaries.

`Model.forward(input_batch)` returns `(loss, aux)`. The loss is the mean cross-entropy
over live targets (label >= 0 and != pad_token_id; without a pad id, in a document:
input_segment_ids != 0), computed in float32, plus
`z_loss_scale * mean(logsumexp(logits)^2)`, which keeps the softmax normalizer near one.
With `loss_chunk_size` set, logits and per-token losses are computed a chunk of the
sequence at a time under `jax.checkpoint`, so the [batch, seq, vocab] float32 logits never
exist at once, in the forward pass or the backward pass.

`count_parameters` and `matmul_parameter_count` read parameter specs (no allocation);
`Model.model_flops_per_token` turns the latter into the model FLOPs of DESIGN.md.
"""

import math
from collections.abc import Sequence
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp

from axlearn.common.base_layer import BaseLayer, ParameterSpec, is_parameter_spec
from axlearn.common.config import InstantiableConfig, config_class
from axlearn.common.decoder import Decoder
from axlearn.common.module import Module, Tensor, functional
from axlearn.common.sharding import maybe_shard
from axlearn.common.summary import WeightedScalar
from axlearn.common.utils import flatten_with_paths

AxisNames = Optional[Union[str, Sequence[str]]]


@jax.custom_vjp
def _cross_entropy(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token float32 (cross-entropy, log-normalizer) of logits [..., vocab].

    Dead (negative) labels pick any column; the caller masks them. The backward pass is
    one expression in the logits' dtype: autodiff would write a float32 copy of the
    logits' gradient, scatter the target term into it and convert it: extra passes over
    the largest tensor of the step.
    """
    return _cross_entropy_fwd(logits, labels)[0]


def _cross_entropy_fwd(logits, labels):
    x = logits.astype(jnp.float32)
    log_normalizer = jax.nn.logsumexp(x, axis=-1)
    target = jnp.take_along_axis(x, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    return (log_normalizer - target, log_normalizer), (logits, labels, log_normalizer)


def _cross_entropy_bwd(residuals, cotangents):
    logits, labels, log_normalizer = residuals
    d_cross_entropy, d_log_normalizer = cotangents
    probs = jnp.exp(logits.astype(jnp.float32) - log_normalizer[..., None])
    is_target = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == (
        jnp.maximum(labels, 0)[..., None]
    )
    d_logits = (d_cross_entropy + d_log_normalizer)[..., None] * probs - jnp.where(
        is_target, d_cross_entropy[..., None], 0.0
    )
    return d_logits.astype(logits.dtype), None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def _token_statistics(logits: Tensor, labels: Tensor) -> dict[str, Tensor]:
    """Per-token float32 cross-entropy, log-normalizer and argmax hit, each [..., seq]."""
    cross_entropy, log_normalizer = _cross_entropy(logits, labels)
    return dict(
        cross_entropy=cross_entropy,
        log_normalizer=log_normalizer,
        correct=(jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32),
    )


class Model(BaseLayer):
    """Decoder-only causal LM trained with next-token cross-entropy (+ z-loss)."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures Model."""

        decoder: InstantiableConfig = Decoder.default_config()
        # Mesh axes of the batch dimension of inputs (None: no constraint).
        batch_axis_names: AxisNames = "data"
        # Mesh axes of the sequence dimension of inputs (None: no constraint).
        seq_axis_names: AxisNames = None
        z_loss_scale: float = 0.0  # Weight of mean(logsumexp(logits)^2) in the loss.
        # If set, the sequence is cut into chunks of this many tokens for the LM head and
        # the loss, each recomputed in the backward pass (aux then has no 'logits').
        loss_chunk_size: Optional[int] = None
        # True: packed documents see each other (plain causal attention over the whole
        # row, positions 0..T-1), which lets cuDNN's flash kernel run without a mask.
        # None or False: attention and positions stay within each document.
        attend_across_documents: Optional[bool] = None

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        cfg = self.config
        if cfg.loss_chunk_size is not None and cfg.loss_chunk_size < 1:
            raise ValueError(f"{self.path()}.loss_chunk_size must be >= 1 or None")
        self._add_child("decoder", cfg.decoder)

    def _shard_tokens(self, x: Optional[Tensor]) -> Optional[Tensor]:
        """Constrains a [batch, seq] input to the batch and sequence mesh axes."""
        cfg = self.config
        if x is None or (cfg.batch_axis_names is None and cfg.seq_axis_names is None):
            return x
        return maybe_shard(x, (cfg.batch_axis_names, cfg.seq_axis_names))

    def forward(self, input_batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Any]]:
        """Returns (loss, aux) for input_batch with 'input_ids' and 'target_labels' [B, T].

        Optional keys: 'input_segment_ids', 'input_positions' [B, T] (packed documents) and
        'target_num_bytes' [B] (adds a 'bits_per_byte' summary). aux holds 'per_token_loss'
        (cross-entropy + z-loss term, zero at dead targets), 'live_targets' and, unless the
        loss is chunked, 'logits'.
        """
        cfg = self.config
        input_ids = self._shard_tokens(input_batch["input_ids"])
        labels = self._shard_tokens(input_batch["target_labels"])
        decoder_kwargs = {}
        if not cfg.attend_across_documents:
            decoder_kwargs = dict(
                segment_ids=self._shard_tokens(input_batch.get("input_segment_ids")),
                positions=self._shard_tokens(input_batch.get("input_positions")),
            )
        aux: dict[str, Any] = {}
        if cfg.loss_chunk_size is None:
            logits = self.decoder(input_ids, **decoder_kwargs)["logits"]
            stats = _token_statistics(logits, labels)
            aux["logits"] = logits
        else:
            hidden_states = self.decoder.compute_hidden_states(input_ids, **decoder_kwargs)
            stats = self._chunked_token_statistics(hidden_states, labels)

        pad_token_id = cfg.decoder.pad_token_id
        live = labels >= 0
        if pad_token_id is not None:
            live &= labels != pad_token_id
        elif input_batch.get("input_segment_ids") is not None:
            # Without a pad id, padding is where the inputs mark no document (segment 0).
            live &= self._shard_tokens(input_batch["input_segment_ids"]) != 0
        live = live.astype(jnp.float32)
        num_live = jnp.sum(live)
        denominator = jnp.maximum(num_live, 1.0)
        z_per_token = cfg.z_loss_scale * jnp.square(stats["log_normalizer"])
        total_nats = jnp.sum(stats["cross_entropy"] * live)
        cross_entropy = total_nats / denominator
        z_loss = jnp.sum(z_per_token * live) / denominator
        loss = cross_entropy + z_loss

        self.add_summary("loss", WeightedScalar(loss, num_live))
        self.add_summary("cross_entropy", WeightedScalar(cross_entropy, num_live))
        self.add_summary("z_loss", WeightedScalar(z_loss, num_live))
        self.add_summary("perplexity", WeightedScalar(jnp.exp(cross_entropy), num_live))
        accuracy = jnp.sum(stats["correct"] * live) / denominator
        self.add_summary("accuracy", WeightedScalar(accuracy, num_live))
        if "target_num_bytes" in input_batch:
            num_bytes = jnp.sum(input_batch["target_num_bytes"]).astype(jnp.float32)
            bits_per_byte = total_nats / math.log(2.0) / jnp.maximum(num_bytes, 1.0)
            self.add_summary("bits_per_byte", WeightedScalar(bits_per_byte, num_bytes))

        aux["per_token_loss"] = (stats["cross_entropy"] + z_per_token) * live
        aux["live_targets"] = live
        return loss, aux

    def _chunked_token_statistics(self, hidden_states: Tensor, labels: Tensor) -> dict[str, Tensor]:
        """`_token_statistics` of the decoder's logits, `loss_chunk_size` tokens at a time."""
        cfg = self.config
        batch_size, seq_len, dim = hidden_states.shape
        chunk = min(cfg.loss_chunk_size, seq_len)
        num_chunks = -(-seq_len // chunk)
        padding = num_chunks * chunk - seq_len
        if padding:
            hidden_states = jnp.pad(hidden_states, ((0, 0), (0, padding), (0, 0)))
            labels = jnp.pad(labels, ((0, 0), (0, padding)), constant_values=-1)
        # [num_chunks, B, chunk, ...]: scan walks the leading axis.
        hidden_chunks = hidden_states.reshape(batch_size, num_chunks, chunk, dim).swapaxes(0, 1)
        label_chunks = labels.reshape(batch_size, num_chunks, chunk).swapaxes(0, 1)
        decoder = self.decoder
        decoder_state = self.state["decoder"]
        is_training = self.is_training

        @jax.checkpoint
        def chunk_statistics(hidden_chunk, label_chunk):
            # A detached call: the LM head adds no summaries, and a scan body must not
            # write into this call's output collection.
            logits, _ = functional(
                decoder,
                state=decoder_state,
                inputs=(hidden_chunk,),
                prng_key=None,
                is_training=is_training,
                method="compute_logits",
            )
            return _token_statistics(logits, label_chunk)

        def body(carry, chunk_inputs):
            return carry, chunk_statistics(*chunk_inputs)

        _, stats = jax.lax.scan(body, None, (hidden_chunks, label_chunks))
        return {
            name: value.swapaxes(0, 1).reshape(batch_size, num_chunks * chunk)[:, :seq_len]
            for name, value in stats.items()
        }

    # ----- accounting -----

    def model_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward and backward) per token of `seq_len`-token sequences.

        The DESIGN.md formula: 6 x matmul parameters (`matmul_parameter_count`: the LM head
        included, the embedding lookup not) + 6 x layers x seq_len x dim, the second term
        being causal attention's QK^T and AV over half the [seq_len, seq_len] matrix.
        """
        decoder = self.decoder.config
        num_layers = self.decoder.transformer.config.num_layers
        return 6.0 * matmul_parameter_count(self) + 6.0 * num_layers * seq_len * decoder.dim

    # ----- generation -----

    def greedy_decode(self, prompt_ids: Tensor, **kwargs) -> dict[str, Tensor]:
        """See `Decoder.greedy_decode`."""
        return self.decoder.greedy_decode(prompt_ids, **kwargs)

    def sample_decode(self, prompt_ids: Tensor, **kwargs) -> dict[str, Tensor]:
        """See `Decoder.sample_decode`."""
        return self.decoder.sample_decode(prompt_ids, **kwargs)


# ----- parameter counts -----


def _parameter_specs(model_or_specs: Any) -> list[tuple[str, Any]]:
    """[(path, leaf)] of a layer's specs, or of a tree of ParameterSpecs or arrays."""
    tree = model_or_specs
    if isinstance(tree, BaseLayer):
        tree = tree.create_parameter_specs_recursively()
    return flatten_with_paths(tree, is_leaf=is_parameter_spec)


def _size(leaf: Union[ParameterSpec, Any]) -> int:
    return math.prod(leaf.shape)


def count_parameters(model_or_specs: Any) -> int:
    """Number of parameters of a layer (from its specs) or of a tree of specs or arrays."""
    return sum(_size(leaf) for _, leaf in _parameter_specs(model_or_specs))


def matmul_parameter_count(model_or_specs: Any) -> int:
    """Parameters that take part in matmuls: the per-token FLOPs are 6x this (DESIGN.md).

    Counts every `weight` except embedding lookup tables (token and position), and counts
    the LM head even when it is tied to the token table (then the table counts once, as
    the head). Norm scales and biases are left out.
    """
    total = 0
    token_table = 0
    has_lm_head = False
    for path, leaf in _parameter_specs(model_or_specs):
        parts = path.split("/")
        if parts[-1] != "weight":
            continue
        if "lm_head" in parts:
            has_lm_head = True
        if "emb" in parts:  # Lookup tables (decoder/emb/token_emb, decoder/emb/pos_emb).
            if "token_emb" in parts:
                token_table += _size(leaf)
            continue
        total += _size(leaf)
    return total + (0 if has_lm_head else token_table)
