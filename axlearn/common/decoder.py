"""A decoder-only transformer language model and generation over its KV cache.

`Decoder` maps token ids to next-token logits: embeddings -> transformer stack ->
output norm -> output dropout -> LM head (the transposed token table when `lm_head` is
None, i.e. tied embeddings). It also runs incrementally: `init_states` allocates the
transformer's KV cache and `extend_step` appends tokens to it.

`DecodingLayer` holds the generation loop: prefill the prompt into the cache in one
`extend_step`, then choose one token per step (argmax, or a sample from the
temperature / top-k / top-p filtered distribution) inside `jax.lax.while_loop`, until
every sequence has produced one of the `eos_token_id`s or reached `max_len`. Positions
after a sequence's end hold `pad_token_id` (the first eos id where there is no pad id).
"""

import numbers
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp

from axlearn.common.attention import StackedTransformerLayer
from axlearn.common.base_layer import BaseLayer, ParameterSpec, weight_einsum
from axlearn.common.config import (
    ConfigBase,
    ConfigError,
    InstantiableConfig,
    Required,
    REQUIRED,
    config_class,
)
from axlearn.common.embedding import TransformerTextEmbeddings
from axlearn.common.layers import Dropout, RMSNorm
from axlearn.common.module import Module, Tensor
from axlearn.common.param_init import FanAxes
from axlearn.common.sharding import MeshAxes, maybe_shard

# step(cache, token_ids [B, S], time_step [B]) -> (new_cache, logits [B, S, vocab]).
StepFn = Callable[[Any, Tensor, Tensor], tuple[Any, Tensor]]
# choose(logits [B, vocab] float32, prng_key) -> token ids [B] int32.
ChooseFn = Callable[[Tensor, Tensor], Tensor]
# One token id or several (e.g. end-of-text and end-of-turn).
TokenIds = Union[int, Sequence[int]]


def token_id_list(ids: TokenIds) -> list[int]:
    """`ids` as a non-empty list of ints."""
    ids = [int(ids)] if isinstance(ids, numbers.Integral) else [int(i) for i in ids]
    if not ids:
        raise ValueError("Expected at least one token id, got none")
    return ids


def prompt_lengths_of(prompt_ids: Tensor, pad_token_id: Optional[int]) -> Tensor:
    """The lengths [B] of right-padded prompts [B, P]: up to the last token that is not
    `pad_token_id` (so pad ids inside a prompt count); P for every row when there is no
    pad id. A prompt that ends in the pad id itself needs explicit lengths."""
    batch_size, prompt_len = prompt_ids.shape
    if pad_token_id is None:
        return jnp.full([batch_size], prompt_len, jnp.int32)
    ends = jnp.arange(1, prompt_len + 1, dtype=jnp.int32)[None, :]
    return jnp.max(jnp.where(prompt_ids != pad_token_id, ends, 0), axis=-1)


def filter_logits(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
) -> Tensor:
    """Scales `logits` [..., vocab] by 1/temperature and sets filtered-out tokens to -inf.

    top_k keeps the k largest logits (ties with the k-th are kept too). top_p keeps the
    smallest set of most likely tokens whose probability reaches top_p (always at least one).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (use greedy decoding for 0), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")
    logits = logits.astype(jnp.float32) / temperature
    neg_inf = jnp.array(-jnp.inf, dtype=logits.dtype)
    if top_k is not None and top_k < logits.shape[-1]:
        kth_largest = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth_largest, neg_inf, logits)
    if top_p is not None and top_p < 1.0:
        sorted_logits = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)
        sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
        # A token is kept when the mass of the tokens strictly more likely is below top_p.
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        num_kept = jnp.maximum(jnp.sum(mass_before < top_p, axis=-1, keepdims=True), 1)
        cutoff = jnp.take_along_axis(sorted_logits, num_kept - 1, axis=-1)
        logits = jnp.where(logits < cutoff, neg_inf, logits)
    return logits


def greedy_choice(logits: Tensor, prng_key: Optional[Tensor] = None) -> Tensor:
    """The most likely token per row (the key is unused)."""
    del prng_key
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def sampling_choice(
    *, temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None
) -> ChooseFn:
    """A ChooseFn drawing one token per row from the filtered distribution."""

    def choose(logits: Tensor, prng_key: Tensor) -> Tensor:
        filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        return jax.random.categorical(prng_key, filtered, axis=-1).astype(jnp.int32)

    return choose


class DecodingLayer(Module):
    """The generation loop over a KV cache; parameter-free.

    The owner supplies a step function that appends tokens to the cache and returns the
    logits of the next positions, and a function that chooses a token from logits.
    """

    @config_class
    class Config(Module.Config):
        """Configures DecodingLayer."""

    def decode(
        self,
        *,
        step_fn: StepFn,
        cache: Any,
        prompt_ids: Tensor,
        prompt_lengths: Tensor,
        max_len: int,
        choose_fn: ChooseFn,
        prng_key: Optional[Tensor],
        eos_token_id: TokenIds,
        pad_token_id: int,
    ) -> dict[str, Tensor]:
        """Extends right-padded `prompt_ids` [B, P] (of `prompt_lengths` [B]) to `max_len`.

        A row ends at any id of `eos_token_id` (one id or several). Returns
        dict(sequences=[B, max_len] int32: prompt then generated tokens, the EOS included,
        then `pad_token_id`; lengths=[B] int32: tokens before the padding).
        """
        eos_ids = jnp.asarray(token_id_list(eos_token_id), jnp.int32)
        batch_size, prompt_len = prompt_ids.shape
        if prompt_len > max_len:
            raise ValueError(f"The prompt ({prompt_len} tokens) is longer than max_len={max_len}")
        if prng_key is None:
            prng_key = jax.random.PRNGKey(0)  # Only sampling uses it; greedy ignores it.
        prompt_lengths = prompt_lengths.astype(jnp.int32)
        positions = jnp.arange(max_len, dtype=jnp.int32)[None, :]
        sequences = jnp.pad(
            prompt_ids.astype(jnp.int32),
            ((0, 0), (0, max_len - prompt_len)),
            constant_values=pad_token_id,
        )
        sequences = jnp.where(positions < prompt_lengths[:, None], sequences, pad_token_id)

        # Prefill: the whole prompt in one step. Pad slots beyond a short prompt are written
        # to the cache too, but each is overwritten before any query may attend to it.
        cache, logits = step_fn(cache, prompt_ids, jnp.zeros([batch_size], jnp.int32))
        last = jnp.maximum(prompt_lengths - 1, 0)[:, None, None]
        next_logits = jnp.take_along_axis(logits, last, axis=1)[:, 0].astype(jnp.float32)

        def cond(loop):
            return jnp.any(~loop["done"])

        def body(loop):
            prng_key, choose_key = jax.random.split(loop["prng_key"])
            time_step, done = loop["time_step"], loop["done"]
            token = jnp.where(done, pad_token_id, choose_fn(loop["logits"], choose_key))
            write = (positions == time_step[:, None]) & ~done[:, None]
            sequences = jnp.where(write, token[:, None], loop["sequences"])
            # The chosen token enters the cache at its own position; its logits predict the
            # next one. Finished rows re-write a slot past their end, which nothing reads.
            cache, logits = step_fn(
                loop["cache"], token[:, None], jnp.minimum(time_step, max_len - 1)
            )
            new_time_step = jnp.where(done, time_step, time_step + 1)
            return dict(
                cache=cache,
                sequences=sequences,
                logits=logits[:, 0].astype(jnp.float32),
                time_step=new_time_step,
                done=done | jnp.any(token[:, None] == eos_ids, axis=-1)
                | (new_time_step >= max_len),
                prng_key=prng_key,
            )

        final = jax.lax.while_loop(
            cond,
            body,
            dict(
                cache=cache,
                sequences=sequences,
                logits=next_logits,
                time_step=prompt_lengths,
                done=prompt_lengths >= max_len,
                prng_key=prng_key,
            ),
        )
        return dict(sequences=final["sequences"], lengths=final["time_step"])


def _set_causal_attention(cfg: Any) -> None:
    """Sets `causal=True` in every nested config with a `causal` field, except inside
    cross-attention configs (whose keys come from another sequence)."""
    if isinstance(cfg, ConfigBase):
        if "causal" in cfg:
            cfg.causal = True
        for name, value in cfg.items():
            if name != "cross_attention":
                _set_causal_attention(value)
    elif isinstance(cfg, (list, tuple)):
        for value in cfg:
            _set_causal_attention(value)
    elif isinstance(cfg, dict):
        for value in cfg.values():
            _set_causal_attention(value)


def _with_dropout_rate(cfg: InstantiableConfig, rate: float) -> InstantiableConfig:
    """`cfg` with `rate` filled in where it is unset (None)."""
    cfg = cfg.clone()
    if "rate" in cfg and cfg.rate is None:
        cfg.rate = rate
    return cfg


class LmHead(BaseLayer):
    """An untied output layer: logits = x @ weight.T with its own weight [vocab, dim].

    The weight has the token table's layout (one row per token), so a checkpoint's
    `lm_head/weight` reads like `emb/token_emb/weight`.
    """

    @config_class
    class Config(BaseLayer.Config):
        """Configures LmHead."""

        vocab_size: Required[int] = REQUIRED  # Set by the decoder.
        embedding_dim: Required[int] = REQUIRED  # The decoder's dim; set by the decoder.

    @classmethod
    def default_config(cls) -> Config:
        cfg = super().default_config()
        cfg.param_partition_spec = (None, "model")  # Vocab rows replicated, dim by model.
        return cfg

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self.config
        return dict(
            weight=ParameterSpec(
                shape=(cfg.vocab_size, cfg.embedding_dim),
                mesh_axes=cfg.param_partition_spec,
                fan_axes=FanAxes(in_axis=-2, out_axis=-1),
            )
        )

    def forward(self, x: Tensor) -> Tensor:
        """[..., dim] -> [..., vocab]."""
        return weight_einsum(
            "...d,vd->...v", x, self.parameters["weight"],
            partition_spec=self.config.param_partition_spec,
        )


def _lm_head_config(lm_head: InstantiableConfig, *, dim: int, vocab_size: int):
    """`lm_head` with its sizes set: an LmHead's vocab_size/embedding_dim, or a Linear's
    input_dim/output_dim."""
    if "embedding_dim" in lm_head:
        return lm_head.clone(vocab_size=vocab_size, embedding_dim=dim)
    return lm_head.clone(input_dim=dim, output_dim=vocab_size)


class Decoder(BaseLayer):
    """Token ids -> next-token logits, with a KV cache for generation."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures Decoder."""

        vocab_size: Required[int] = REQUIRED
        dim: Required[int] = REQUIRED  # Model width: embeddings, transformer, output norm.
        # 'causal': the decoder turns on `causal` in every attention config of `transformer`;
        # None: the transformer config is used as given (its attention must mask itself);
        # an attention-bias layer config (attention.ALiBiAttentionLogitBiasLayer, ...): its
        # biases [B,1|N,T,T] go to every self-attention (which then need not be causal).
        attention_mask: Optional[Union[str, InstantiableConfig]] = "causal"
        # Fills the `rate` of the embedding and output dropouts where those leave it None.
        dropout_rate: float = 0.0
        emb: InstantiableConfig = TransformerTextEmbeddings.default_config()
        transformer: InstantiableConfig = StackedTransformerLayer.default_config()
        output_norm: Optional[InstantiableConfig] = RMSNorm.default_config()  # None: no norm.
        output_dropout: InstantiableConfig = Dropout.default_config()
        # None: logits = hidden @ emb.token_emb.weight.T (tied). Otherwise an LmHead config
        # (untied `lm_head/weight` [vocab, dim]) or a Linear one (weight [dim, vocab]).
        lm_head: Optional[InstantiableConfig] = None
        # If set, logits = c * tanh(logits / c) with c = logits_soft_cap.
        logits_soft_cap: Optional[float] = None
        # Targets equal to it are not trained on, and it fills sequences after their end.
        # None: the vocabulary has no pad id (Llama 3): every target >= 0 counts, prompts
        # are taken whole unless given lengths, and the first eos id fills.
        pad_token_id: Optional[int] = 0
        # Generation stops at this id, or at any of a list of ids.
        eos_token_id: TokenIds = 1
        logits_partition_spec: Optional[MeshAxes] = None  # Sharding of [batch, seq, vocab].
        decoding: InstantiableConfig = DecodingLayer.default_config()

    def __init__(self, cfg: Config, *, parent: Optional[Module]):
        super().__init__(cfg, parent=parent)
        cfg = self.config
        transformer = cfg.transformer.clone(input_dim=cfg.dim)
        if cfg.attention_mask == "causal":
            _set_causal_attention(transformer)
        elif isinstance(cfg.attention_mask, InstantiableConfig):
            self._add_child("attention_mask", cfg.attention_mask)
        elif cfg.attention_mask is not None:
            raise ConfigError(
                f"{self.path()}.attention_mask: '{cfg.attention_mask}' is not supported; "
                "use 'causal' or None"
            )
        emb = cfg.emb.clone(dim=cfg.dim, vocab_size=cfg.vocab_size)
        emb.dropout = _with_dropout_rate(emb.dropout, cfg.dropout_rate)
        self._add_child("emb", emb)
        self._add_child("transformer", transformer)
        if cfg.output_norm is not None:
            self._add_child("output_norm", cfg.output_norm.clone(input_dim=cfg.dim))
        self._add_child("output_dropout", _with_dropout_rate(cfg.output_dropout, cfg.dropout_rate))
        if cfg.lm_head is not None:
            self._add_child(
                "lm_head", _lm_head_config(cfg.lm_head, dim=cfg.dim, vocab_size=cfg.vocab_size)
            )
        self._add_child("decoding", cfg.decoding)

    # ----- training / scoring -----

    def forward(
        self,
        input_ids: Tensor,
        *,
        segment_ids: Optional[Tensor] = None,
        positions: Optional[Tensor] = None,
    ) -> dict[str, Tensor]:
        """input_ids [B, T] -> dict(logits=[B, T, vocab], hidden_states=[B, T, dim]).

        `segment_ids` [B, T] keep packed documents from attending to each other;
        `positions` [B, T] restart per document (default 0..T-1).
        """
        hidden_states = self.compute_hidden_states(
            input_ids, segment_ids=segment_ids, positions=positions
        )
        return dict(logits=self.compute_logits(hidden_states), hidden_states=hidden_states)

    def compute_hidden_states(
        self,
        input_ids: Tensor,
        *,
        segment_ids: Optional[Tensor] = None,
        positions: Optional[Tensor] = None,
    ) -> Tensor:
        """The states that feed the LM head: [B, T, dim] after output norm and dropout."""
        x = self.emb(input_ids, positions=positions)
        kwargs = {}
        if "attention_mask" in self.children:
            ones = jnp.ones(input_ids.shape, jnp.int32)
            kwargs["attention_logit_biases"] = self.attention_mask(
                segment_ids=ones if segment_ids is None else segment_ids,
                positions=jnp.cumsum(ones, axis=-1) - 1 if positions is None else positions,
            )
        x = self.transformer(x, segment_ids=segment_ids, positions=positions, **kwargs)
        return self._output(x)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """[B, T, dim] -> [B, T, vocab] through the LM head (tied or not) and soft cap,
        sharded by `logits_partition_spec`."""
        return maybe_shard(self._logits(hidden_states), self.config.logits_partition_spec)

    def _logits(self, hidden_states: Tensor) -> Tensor:
        cfg = self.config
        if "lm_head" in self.children:
            logits = self.lm_head(hidden_states)
        else:
            logits = self.emb.attend(hidden_states)
        if cfg.logits_soft_cap is not None:
            cap = cfg.logits_soft_cap
            logits = cap * jnp.tanh(logits / cap)
        return logits

    def _output(self, x: Tensor) -> Tensor:
        if "output_norm" in self.children:
            x = self.output_norm(x)
        return self.output_dropout(x)

    # ----- incremental decoding -----

    def init_states(self, *, batch_size: int, max_len: int) -> Any:
        """An empty KV cache for `batch_size` sequences of up to `max_len` tokens (and,
        with an attention-bias layer, the cache's positions, which its biases need)."""
        states = dict(
            transformer=self.transformer.init_states(batch_size=batch_size, max_len=max_len)
        )
        if "attention_mask" in self.children:
            positions = jnp.arange(max_len, dtype=jnp.int32)
            states["key_positions"] = jnp.broadcast_to(positions, (batch_size, max_len))
        return states

    def extend_step(
        self, cached_states: Any, input_ids: Tensor, *, time_step: Tensor
    ) -> tuple[Any, dict[str, Tensor]]:
        """Appends input_ids [B, S] at positions time_step[b] + (0..S-1) of the cache.

        Returns (new cache, dict(logits=[B, S, vocab], hidden_states=[B, S, dim])); the
        outputs equal `forward` on the whole sequence at the same positions.
        """
        steps = jnp.arange(input_ids.shape[1], dtype=jnp.int32)
        positions = time_step.astype(jnp.int32)[:, None] + steps[None, :]
        x = self.emb(input_ids, positions=positions)
        kwargs = {}
        if "attention_mask" in self.children:
            kwargs["attention_logit_biases"] = self.attention_mask.biases(
                query_positions=positions, key_positions=cached_states["key_positions"]
            )
        transformer_cache, x = self.transformer.extend_step(
            cached_states["transformer"], x, time_step=time_step, **kwargs
        )
        hidden_states = self._output(x)
        # No logits_partition_spec here: a few decoded positions (or a small decoding batch)
        # need not divide the mesh axes that training shards over.
        logits = self._logits(hidden_states)
        return dict(cached_states, transformer=transformer_cache), dict(
            logits=logits, hidden_states=hidden_states
        )

    def _detached_step_fn(self) -> StepFn:
        """`extend_step` as a pure function of (cache, ids, time_step) with this call's state.

        It runs in a fresh, inference-mode context whose outputs (summaries the layers add)
        are dropped, so that a loop body's values never leak out of the loop.
        """
        state = self.get_invocation_context().state

        def step(cache, input_ids, time_step):
            (cache, outputs), _ = self._functional_call(
                type(self).extend_step, state, None, False, (cache, input_ids),
                dict(time_step=time_step),
            )
            return cache, outputs["logits"]

        return step

    def _decode(
        self,
        prompt_ids: Tensor,
        *,
        max_len: int,
        choose_fn: ChooseFn,
        prng_key: Optional[Tensor],
        prompt_lengths: Optional[Tensor],
    ) -> dict[str, Tensor]:
        cfg = self.config
        if prompt_lengths is None:
            prompt_lengths = prompt_lengths_of(prompt_ids, cfg.pad_token_id)
        cache = self.init_states(batch_size=prompt_ids.shape[0], max_len=max_len)
        return self.decoding.decode(
            step_fn=self._detached_step_fn(),
            cache=cache,
            prompt_ids=prompt_ids,
            prompt_lengths=prompt_lengths,
            max_len=max_len,
            choose_fn=choose_fn,
            prng_key=prng_key,
            eos_token_id=cfg.eos_token_id,
            pad_token_id=self.fill_token_id,
        )

    @property
    def fill_token_id(self) -> int:
        """The id after a sequence's end: pad_token_id, or the first eos id without one."""
        cfg = self.config
        if cfg.pad_token_id is not None:
            return cfg.pad_token_id
        return token_id_list(cfg.eos_token_id)[0]

    def greedy_decode(
        self, prompt_ids: Tensor, *, max_len: int, prompt_lengths: Optional[Tensor] = None
    ) -> dict[str, Tensor]:
        """Extends each prompt with its most likely next tokens.

        prompt_ids [B, P] are right-padded; `prompt_lengths` [B] (each at least 1) default
        to `prompt_lengths_of(prompt_ids, pad_token_id)`. Generation stops per row at any
        eos_token_id or max_len. Returns dict(sequences=[B, max_len], lengths=[B]).
        """
        return self._decode(
            prompt_ids,
            max_len=max_len,
            choose_fn=greedy_choice,
            prng_key=None,
            prompt_lengths=prompt_lengths,
        )

    def sample_decode(
        self,
        prompt_ids: Tensor,
        *,
        max_len: int,
        prng_key: Tensor,
        num_decodes: int = 1,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        prompt_lengths: Optional[Tensor] = None,
    ) -> dict[str, Tensor]:
        """Draws `num_decodes` continuations per prompt (see `filter_logits` for the knobs).

        Returns dict(sequences=[B, num_decodes, max_len], lengths=[B, num_decodes]).
        """
        cfg = self.config
        batch_size = prompt_ids.shape[0]
        if prompt_lengths is None:
            prompt_lengths = prompt_lengths_of(prompt_ids, cfg.pad_token_id)
        outputs = self._decode(
            jnp.repeat(prompt_ids, num_decodes, axis=0),
            max_len=max_len,
            choose_fn=sampling_choice(temperature=temperature, top_k=top_k, top_p=top_p),
            prng_key=prng_key,
            prompt_lengths=jnp.repeat(prompt_lengths, num_decodes, axis=0),
        )
        return dict(
            sequences=outputs["sequences"].reshape(batch_size, num_decodes, max_len),
            lengths=outputs["lengths"].reshape(batch_size, num_decodes),
        )
