"""Input embeddings of a text transformer: token ids -> vectors of width `dim`.

`TransformerTextEmbeddings` looks tokens up in a table (`token_emb`), optionally adds
learned absolute position embeddings (`pos_emb`; rotary models leave it None), optionally
normalizes, and applies dropout. `attend(x)` multiplies by the transposed token table,
which is how a decoder with tied input and output embeddings computes its logits.
"""

from typing import Optional

import jax.numpy as jnp

from axlearn.common.base_layer import BaseLayer
from axlearn.common.config import REQUIRED, InstantiableConfig, Required, config_class
from axlearn.common.layers import Dropout, Embedding
from axlearn.common.module import Tensor


class TransformerTextEmbeddings(BaseLayer):
    """Token (and optional position) embeddings followed by optional norm and dropout."""

    @config_class
    class Config(BaseLayer.Config):
        """Configures TransformerTextEmbeddings."""

        dim: Required[int] = REQUIRED  # Embedding width; the decoder sets it to its `dim`.
        vocab_size: Required[int] = REQUIRED  # Rows of the token table; set by the decoder.
        token_emb: InstantiableConfig = Embedding.default_config()
        # Learned absolute positions: an Embedding config whose `num_embeddings` is the longest
        # position + 1. None for models that encode positions elsewhere (RoPE).
        pos_emb: Optional[InstantiableConfig] = None
        norm: Optional[InstantiableConfig] = None  # Applied to the summed embeddings, if set.
        dropout: InstantiableConfig = Dropout.default_config()

    def __init__(self, cfg: Config, *, parent):
        super().__init__(cfg, parent=parent)
        cfg = self.config
        self._add_child(
            "token_emb", cfg.token_emb.clone(num_embeddings=cfg.vocab_size, dim=cfg.dim)
        )
        if cfg.pos_emb is not None:
            self._add_child("pos_emb", cfg.pos_emb.clone(dim=cfg.dim))
        if cfg.norm is not None:
            self._add_child("norm", cfg.norm.clone(input_dim=cfg.dim))
        self._add_child("dropout", cfg.dropout)

    def forward(self, input_ids: Tensor, *, positions: Optional[Tensor] = None) -> Tensor:
        """Embeds `input_ids` [batch, seq] into [batch, seq, dim].

        `positions` [batch, seq] (default: 0, 1, ... per row) index `pos_emb` when it is set.
        """
        x = self.token_emb(input_ids)
        if "pos_emb" in self.children:
            if positions is None:
                positions = jnp.broadcast_to(
                    jnp.arange(input_ids.shape[-1], dtype=jnp.int32), input_ids.shape
                )
            x = x + self.pos_emb(positions)
        if "norm" in self.children:
            x = self.norm(x)
        return self.dropout(x)

    def attend(self, x: Tensor) -> Tensor:
        """Logits of a tied output layer: [..., dim] @ token_table.T -> [..., vocab_size]."""
        return self.token_emb.attend(x)
