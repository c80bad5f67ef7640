"""A causal language model: a `Decoder` plus the next-token loss and its summaries.

`Model.forward(input_batch)` returns `(loss, aux)`. The loss is the mean cross-entropy
over live targets (label >= 0 and != pad_token_id; without a pad id, in a document:
input_segment_ids != 0), each weighted by `target_weights` where the batch has them
(chat data: 1 on the turns that train, 0 elsewhere), computed in float32, plus
`z_loss_scale * mean(logsumexp(logits)^2)`, which keeps the softmax normalizer near one.
With `loss_chunk_size` set, logits and per-token losses are computed a chunk of the
sequence at a time under `jax.checkpoint`, so the [batch, seq, vocab] float32 logits never
exist at once, in the forward pass or the backward pass.

The loss itself is the model's `metrics` child, a `BaseLossMetrics`: by default
`CrossEntropyLossMetrics` (the loss above); `AuxLossMetrics` collects the auxiliary
losses that layers report as module outputs (a mixture of experts' load-balancing loss);
`CompositeLossMetrics` sums named children with weights.

`count_parameters` and `matmul_parameter_count` read parameter specs (no allocation);
`Model.model_flops_per_token` turns the latter into the model FLOPs of DESIGN.md, counting
only the share of a routed layer's weights that a token uses (`active_matmul_parameter_count`).
"""

import math
import re
from collections.abc import Sequence
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp

from axlearn.common.base_layer import BaseLayer, ParameterSpec, is_parameter_spec
from axlearn.common.config import (
    REQUIRED,
    ConfigBase,
    ConfigError,
    InstantiableConfig,
    Required,
    config_class,
)
from axlearn.common.decoder import Decoder
from axlearn.common.module import Module, Tensor, functional
from axlearn.common.sharding import maybe_shard
from axlearn.common.summary import WeightedScalar
from axlearn.common.utils import flatten_with_paths, unflatten_paths

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


# ----- loss metrics -----


def _lift_child_summaries(module: Module, child_name: str) -> None:
    """Moves the summaries child `child_name` added up to `module`'s own level, so that a
    loss's summaries keep their names however the metrics are composed."""
    summaries = module.get_invocation_context().output_collection.summaries
    for name, value in summaries.pop(child_name, {}).items():
        if name in summaries:
            raise ValueError(
                f"{module.path()}: summary '{name}' of {child_name} clashes with one "
                "already there; rename one of them"
            )
        summaries[name] = value


class BaseLossMetrics(BaseLayer):
    """Computes a loss from a model's predictions, and its summaries.

    `forward(input_batch, predict_outputs=..., module_outputs=...)` returns
    `(loss, metrics)`: the loss as a `WeightedScalar` (a mean over live targets, weighted
    by their number) and a dict of arrays the model returns beside it. `predict_outputs`
    holds 'live_targets' [B, T] (1.0 where a target counts) and 'token_statistics' (see
    `_token_statistics`) or 'logits'; `module_outputs` is the model's output collection's
    module outputs so far, nested by module name.
    """

    def forward(
        self,
        input_batch: dict[str, Tensor],
        *,
        predict_outputs: dict[str, Tensor],
        module_outputs: dict[str, Any],
    ) -> tuple[WeightedScalar, dict[str, Tensor]]:
        raise NotImplementedError(type(self))


class CrossEntropyLossMetrics(BaseLossMetrics):
    """Mean next-token cross-entropy over live targets plus the z-loss
    `z_loss_scale * mean(logsumexp(logits)^2)`; summaries 'cross_entropy', 'z_loss',
    'perplexity', 'accuracy' and, given 'target_num_bytes', 'bits_per_byte'."""

    @config_class
    class Config(BaseLossMetrics.Config):
        """Configures CrossEntropyLossMetrics."""

        z_loss_scale: Optional[float] = None  # None: the model's `z_loss_scale`.

    def forward(
        self,
        input_batch: dict[str, Tensor],
        *,
        predict_outputs: dict[str, Tensor],
        module_outputs: dict[str, Any],
    ) -> tuple[WeightedScalar, dict[str, Tensor]]:
        """Returns (loss, dict(per_token_loss=[B, T] zero at dead targets, live_targets))."""
        del module_outputs
        live = predict_outputs["live_targets"]
        stats = predict_outputs.get("token_statistics")
        if stats is None:
            stats = _token_statistics(predict_outputs["logits"], input_batch["target_labels"])
        z_loss_scale = self.config.z_loss_scale or 0.0
        num_live = jnp.sum(live)
        denominator = jnp.maximum(num_live, 1.0)
        z_per_token = z_loss_scale * jnp.square(stats["log_normalizer"])
        total_nats = jnp.sum(stats["cross_entropy"] * live)
        cross_entropy = total_nats / denominator
        z_loss = jnp.sum(z_per_token * live) / denominator
        loss = cross_entropy + z_loss

        self.add_summary("cross_entropy", WeightedScalar(cross_entropy, num_live))
        self.add_summary("z_loss", WeightedScalar(z_loss, num_live))
        self.add_summary("perplexity", WeightedScalar(jnp.exp(cross_entropy), num_live))
        accuracy = jnp.sum(stats["correct"] * live) / denominator
        self.add_summary("accuracy", WeightedScalar(accuracy, num_live))
        if "target_num_bytes" in input_batch:
            num_bytes = jnp.sum(input_batch["target_num_bytes"]).astype(jnp.float32)
            bits_per_byte = total_nats / math.log(2.0) / jnp.maximum(num_bytes, 1.0)
            self.add_summary("bits_per_byte", WeightedScalar(bits_per_byte, num_bytes))
        per_token_loss = (stats["cross_entropy"] + z_per_token) * live
        metrics = dict(per_token_loss=per_token_loss, live_targets=live)
        return WeightedScalar(loss, num_live), metrics


class AuxLossMetrics(BaseLossMetrics):
    """The auxiliary losses that layers report with `add_module_output` (e.g. a mixture of
    experts' 'aux_loss'), averaged over the layers that report one; summary 'aux_loss'.

    Each module output whose '/'-joined path (e.g.
    'decoder/transformer/layer0/feed_forward/aux_loss') fully matches `aux_loss_regex`
    counts once, by its mean: a scanned stack's output, stacked over its layers, gives
    their mean. Outputs under a `Repeat` are dropped unless its `drop_output` keeps them.
    """

    @config_class
    class Config(BaseLossMetrics.Config):
        """Configures AuxLossMetrics."""

        # E.g. '.*/aux_loss'. None (as AXLearn's dense configs leave it): no auxiliary loss.
        aux_loss_regex: Optional[str] = None

    def forward(
        self,
        input_batch: dict[str, Tensor],
        *,
        predict_outputs: dict[str, Tensor],
        module_outputs: dict[str, Any],
    ) -> tuple[WeightedScalar, dict[str, Tensor]]:
        """Returns (the mean auxiliary loss, dict(aux_loss=the same, a scalar))."""
        del input_batch
        regex = self.config.aux_loss_regex
        if regex is None:
            zero = jnp.zeros((), jnp.float32)
            return WeightedScalar(zero, jnp.sum(predict_outputs["live_targets"])), dict(aux_loss=zero)
        outputs = flatten_with_paths(module_outputs)
        found = [value for path, value in outputs if re.fullmatch(regex, path)]
        if not found:
            raise ValueError(
                f"{self.path()}.aux_loss_regex={regex!r} matches none of the module outputs "
                f"{[path for path, _ in outputs]} (a Repeat drops module outputs unless its "
                "drop_output keeps them)"
            )
        aux_loss = sum(jnp.mean(value.astype(jnp.float32)) for value in found) / len(found)
        num_live = jnp.sum(predict_outputs["live_targets"])
        self.add_summary("aux_loss", WeightedScalar(aux_loss, num_live))
        return WeightedScalar(aux_loss, num_live), dict(aux_loss=aux_loss)


class CompositeLossMetrics(BaseLossMetrics):
    """The weighted sum of named child metrics' losses; their summaries and metrics are
    merged under their own names (a clash is an error)."""

    @config_class
    class Config(BaseLossMetrics.Config):
        """Configures CompositeLossMetrics."""

        # Child name -> a BaseLossMetrics config.
        metrics: Required[dict[str, InstantiableConfig]] = REQUIRED
        loss_weights: Optional[dict[str, float]] = None  # Name -> weight of its loss; None: all 1.

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        cfg = self.config
        if not cfg.metrics:
            raise ConfigError(f"{self.path()}.metrics: needs at least one child metrics config")
        unknown = sorted(set(cfg.loss_weights or {}) - set(cfg.metrics))
        if unknown:
            raise ConfigError(
                f"{self.path()}.loss_weights names {unknown}, which are not among its "
                f"metrics {sorted(cfg.metrics)}"
            )
        for name, child in cfg.metrics.items():
            self._add_child(name, child)

    def forward(
        self,
        input_batch: dict[str, Tensor],
        *,
        predict_outputs: dict[str, Tensor],
        module_outputs: dict[str, Any],
    ) -> tuple[WeightedScalar, dict[str, Tensor]]:
        """Returns (sum of weight x child loss, weighted as the children are: by the live
        targets; the children's metrics merged)."""
        cfg = self.config
        total, weight, merged = 0.0, None, {}
        for name in cfg.metrics:
            loss, metrics = getattr(self, name)(
                input_batch, predict_outputs=predict_outputs, module_outputs=module_outputs
            )
            _lift_child_summaries(self, name)
            total = total + (cfg.loss_weights or {}).get(name, 1.0) * loss.mean
            weight = loss.weight if weight is None else weight
            for key, value in metrics.items():
                if key in merged and merged[key] is not value:
                    raise ValueError(
                        f"{self.path()}: metric '{key}' of {name} clashes with another"
                    )
                merged[key] = value
        return WeightedScalar(total, weight), merged


def metrics_config(
    *, z_loss_scale: Optional[float] = None, aux_loss_regex: Optional[str] = None
) -> InstantiableConfig:
    """A causal LM's loss: CrossEntropyLossMetrics (z_loss_scale None: the model's), plus
    with `aux_loss_regex` the auxiliary losses it matches (`AuxLossMetrics`), summed in a
    CompositeLossMetrics of children 'lm' and 'aux'."""
    lm = CrossEntropyLossMetrics.default_config().set(z_loss_scale=z_loss_scale)
    if aux_loss_regex is None:
        return lm
    return CompositeLossMetrics.default_config().set(
        metrics=dict(lm=lm, aux=AuxLossMetrics.default_config().set(aux_loss_regex=aux_loss_regex))
    )


def _fill_z_loss_scale(
    metrics: ConfigBase, z_loss_scale: Optional[float], path: str
) -> ConfigBase:
    """`metrics` with `z_loss_scale` set in each CrossEntropyLossMetrics config that leaves
    it None; one that sets its own conflicts with a nonzero model-level scale."""
    metrics = metrics.clone()

    def visit(cfg: Any) -> None:
        if isinstance(cfg, ConfigBase):
            if getattr(cfg, "klass", None) is not None and issubclass(
                cfg.klass, CrossEntropyLossMetrics
            ):
                if cfg.z_loss_scale is None:
                    cfg.z_loss_scale = z_loss_scale
                elif z_loss_scale and cfg.z_loss_scale != z_loss_scale:
                    raise ConfigError(
                        f"{path}.z_loss_scale={z_loss_scale} and a z_loss_scale="
                        f"{cfg.z_loss_scale} in {path}.metrics: set it in one place"
                    )
            for name in cfg.keys():
                visit(getattr(cfg, name))
        elif isinstance(cfg, dict):
            for value in cfg.values():
                visit(value)
        elif isinstance(cfg, (list, tuple)):
            for value in cfg:
                visit(value)

    visit(metrics)
    return metrics


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
        # Weight of mean(logsumexp(logits)^2) in the loss; None: no z-loss (or the one
        # the metrics set).
        z_loss_scale: Optional[float] = None
        # If set, the sequence is cut into chunks of this many tokens for the LM head and
        # the loss, each recomputed in the backward pass (aux then has no 'logits').
        loss_chunk_size: Optional[int] = None
        # True: packed documents see each other (plain causal attention over the whole
        # row, positions 0..T-1), which lets cuDNN's flash kernel run without a mask.
        # None or False: attention and positions stay within each document.
        attend_across_documents: Optional[bool] = None
        # The loss: a BaseLossMetrics config (e.g. CompositeLossMetrics of cross entropy and
        # a mixture of experts' auxiliary losses). None: CrossEntropyLossMetrics.
        metrics: Optional[InstantiableConfig] = None

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        cfg = self.config
        if cfg.loss_chunk_size is not None and cfg.loss_chunk_size < 1:
            raise ValueError(f"{self.path()}.loss_chunk_size must be >= 1 or None")
        self._add_child("decoder", cfg.decoder)
        metrics = cfg.metrics or CrossEntropyLossMetrics.default_config()
        self._add_child("metrics", _fill_z_loss_scale(metrics, cfg.z_loss_scale, self.path()))

    def _shard_tokens(self, x: Optional[Tensor]) -> Optional[Tensor]:
        """Constrains a [batch, seq] input to the batch and sequence mesh axes."""
        cfg = self.config
        if x is None or (cfg.batch_axis_names is None and cfg.seq_axis_names is None):
            return x
        return maybe_shard(x, (cfg.batch_axis_names, cfg.seq_axis_names))

    def forward(self, input_batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Any]]:
        """Returns (loss, aux) for input_batch with 'input_ids' and 'target_labels' [B, T].

        Optional keys: 'input_segment_ids', 'input_positions' [B, T] (packed documents),
        'target_weights' [B, T] (each live target's weight in the loss and its summaries:
        a loss mask) and 'target_num_bytes' [B] (adds a 'bits_per_byte' summary; with a
        loss mask, the bytes of the trained text). The `metrics` child computes
        the loss; aux holds its arrays (by default 'per_token_loss': cross-entropy + z-loss
        term, zero at dead targets, and 'live_targets') and, unless the loss is chunked,
        'logits'.
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
        if input_batch.get("target_weights") is not None:
            live = live * self._shard_tokens(input_batch["target_weights"]).astype(jnp.float32)
        predict_outputs = dict(token_statistics=stats, live_targets=live)
        if "logits" in aux:
            predict_outputs["logits"] = aux["logits"]
        loss, metrics = self.metrics(
            dict(input_batch, target_labels=labels),
            predict_outputs=predict_outputs,
            module_outputs=self.get_invocation_context().output_collection.module_outputs,
        )
        _lift_child_summaries(self, "metrics")
        self.add_summary("loss", loss)
        aux.update(metrics)
        return loss.mean, aux

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

        The DESIGN.md formula: 6 x matmul parameters a token uses
        (`active_matmul_parameter_count`: the LM head included, the embedding lookup not,
        routed experts at the share a token goes through) + 6 x layers x seq_len x dim, the
        second term being causal attention's QK^T and AV over half the [seq_len, seq_len]
        matrix.
        """
        decoder = self.decoder.config
        num_layers = self.decoder.transformer.config.num_layers
        return 6.0 * active_matmul_parameter_count(self) + 6.0 * num_layers * seq_len * decoder.dim

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


def active_matmul_parameter_count(model: BaseLayer) -> float:
    """`matmul_parameter_count` for one token: a layer that routes each token through part
    of its weights (a mixture of experts) says with `matmul_parameter_fraction(name)` which
    of its own parameters take part in matmuls and what share of each a token uses (None:
    not a matmul weight); every other parameter counts as `matmul_parameter_count` says."""
    specs = model.create_parameter_specs_recursively()
    owners = model._owners_of_specs()  # pylint: disable=protected-access
    dense, routed = {}, 0.0
    for path, spec in flatten_with_paths(specs, is_leaf=is_parameter_spec):
        fraction_of = getattr(owners[path], "matmul_parameter_fraction", None)
        if fraction_of is None:
            dense[path] = spec
            continue
        fraction = fraction_of(path.split("/")[-1])
        if fraction is not None:
            routed += fraction * _size(spec)
    return matmul_parameter_count(unflatten_paths(dense)) + routed

