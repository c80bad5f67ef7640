"""A synthetic input for benchmarks (`--data_dir=FAKE`): random tokens, no I/O.

Token (row r, column c) of global batch s is a hash of (seed, s, r, c), so any process
computes its own rows of any batch directly: batches are deterministic, resumable and
tile the global batch across processes like every other input. Each row is one
document: `input_ids = tokens[:T]`, `target_labels = tokens[1:]`, segment ids 1,
positions 0..T-1, and `target_num_bytes = T` (as if every token were one byte).
"""

from collections.abc import Iterator
from typing import Optional

import jax
import numpy as np

from axlearn.common.config import REQUIRED, ConfigError, Required, config_class
from axlearn.common.input_base import BaseInput, Batch
from axlearn.common.module import Module

_FIRST_TOKEN = 3  # Ids below are pad, eos and unk.
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A well-mixed 64-bit hash of each element (uint64 in, uint64 out)."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return x ^ (x >> np.uint64(31))


def fake_tokens(
    *, seed: int, step: int, rows: np.ndarray, length: int, vocab_size: int
) -> np.ndarray:
    """Tokens [len(rows), length] of global batch `step`, in [3, vocab_size)."""
    with np.errstate(over="ignore"):
        key = _splitmix64(np.uint64(seed) * np.uint64(0x100000001B3) + np.uint64(step))
        columns = np.arange(length, dtype=np.uint64)
        cell = rows.astype(np.uint64)[:, None] * np.uint64(length) + columns
        hashed = _splitmix64(cell ^ key)
    span = np.uint64(vocab_size - _FIRST_TOKEN)
    return (hashed % span).astype(np.int32) + _FIRST_TOKEN


class FakeLmInput(BaseInput):
    """Deterministic random LM batches (see the module docstring)."""

    @config_class
    class Config(BaseInput.Config):
        """Configures FakeLmInput."""

        global_batch_size: Required[int] = REQUIRED  # Rows of a global batch, all processes.
        max_sequence_length: Required[int] = REQUIRED  # T: tokens per row.
        vocab_size: Required[int] = REQUIRED  # Token ids are drawn from [3, vocab_size).
        seed: int = 0
        # Batches of one evaluation pass (is_training=False). Training never ends.
        num_eval_batches: int = 1

    def __init__(self, cfg: Config, *, parent: Optional[Module], **kwargs):
        super().__init__(cfg, parent=parent, **kwargs)
        cfg = self.config
        if cfg.vocab_size <= _FIRST_TOKEN:
            raise ConfigError(
                f"{self.path()}.vocab_size: must exceed {_FIRST_TOKEN}, got {cfg.vocab_size}"
            )

    def host_batch(self, step: int) -> Batch:
        """This process's rows of global batch `step`."""
        cfg = self.config
        host_rows = self.host_rows()
        rows = np.arange(host_rows.start, host_rows.stop)
        length = cfg.max_sequence_length
        tokens = fake_tokens(
            seed=cfg.seed, step=step, rows=rows, length=length + 1, vocab_size=cfg.vocab_size
        )
        shape = (rows.size, length)
        return {
            "input_ids": tokens[:, :-1],
            "target_labels": tokens[:, 1:],
            "input_segment_ids": np.ones(shape, dtype=np.int32),
            "input_positions": np.broadcast_to(np.arange(length, dtype=np.int32), shape).copy(),
            "target_num_bytes": np.full(rows.size, length, dtype=np.int32),
        }

    def _host_batches(self, start: int) -> Iterator[Batch]:
        cfg = self.config
        step = start
        while cfg.is_training or step < cfg.num_eval_batches:
            yield self.host_batch(step)
            step += 1


class FakePairInput(FakeLmInput):
    """Deterministic random preference pairs (DPO batches, `dpo.DPOModel`): each row's
    chosen and rejected sequences share their first `prompt_length` tokens (the prompt)
    and differ after it; `*_target_weights` are 1 on the targets after the prompt (the
    response tokens), 0 on the prompt. `max_sequence_length` is each side's length."""

    @config_class
    class Config(FakeLmInput.Config):
        """Configures FakePairInput."""

        prompt_length: Optional[int] = None  # Tokens of the shared prompt; None: half of T.

    def __init__(self, cfg: Config, *, parent: Optional[Module], **kwargs):
        super().__init__(cfg, parent=parent, **kwargs)
        cfg = self.config
        prompt = cfg.prompt_length
        if prompt is not None and not 1 <= prompt < cfg.max_sequence_length:
            raise ConfigError(
                f"{self.path()}.prompt_length must be in [1, max_sequence_length="
                f"{cfg.max_sequence_length}), got {prompt}"
            )

    def element_spec(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes and dtypes of one global batch of pairs."""
        shape = (self.global_batch_size, self.max_sequence_length)
        return {
            f"{side}_{key}": jax.ShapeDtypeStruct(shape, np.float32 if key == "target_weights" else np.int32)
            for side in ("chosen", "rejected")
            for key in ("input_ids", "target_labels", "target_weights")
        }

    def host_batch(self, step: int) -> Batch:
        """This process's pairs of global batch `step`."""
        cfg = self.config
        host_rows = self.host_rows()
        rows = np.arange(host_rows.start, host_rows.stop)
        length = cfg.max_sequence_length
        prompt = cfg.prompt_length or length // 2
        batch = {}
        for side, salt in (("chosen", 0), ("rejected", 1)):
            tokens = fake_tokens(
                seed=cfg.seed + salt, step=step, rows=rows, length=length + 1,
                vocab_size=cfg.vocab_size,
            )
            if salt:  # The same prompt as the chosen side's.
                tokens[:, :prompt] = batch["chosen_input_ids"][:, :prompt]
            weights = np.zeros((rows.size, length), np.float32)
            weights[:, prompt - 1 :] = 1.0  # Targets prompt..T: the response's tokens.
            batch[f"{side}_input_ids"] = tokens[:, :-1]
            batch[f"{side}_target_labels"] = tokens[:, 1:]
            batch[f"{side}_target_weights"] = weights
        return batch
