"""DPO training end to end: the trainer on pairs made here raises the reward accuracy
and the chosen-minus-rejected margin; synthetic pairs share their prompt."""

import json
import os

import numpy as np
import pytest

from axlearn.common.input_fake import FakePairInput
from experiments import llama_dpo

PAIRS, LENGTH, PROMPT, VOCAB = 8, 16, 6, 128


class _FixedPairs(FakePairInput):
    """The same 8 pairs every step: the chosen response counts up from the prompt's last
    token, the rejected one is random."""

    def host_batch(self, step: int):
        del step
        rng = np.random.default_rng(0)
        prompts = rng.integers(3, VOCAB, size=(PAIRS, PROMPT))
        counting = (prompts[:, -1:] + np.arange(1, LENGTH + 2 - PROMPT)) % (VOCAB - 3) + 3
        random = rng.integers(3, VOCAB, size=counting.shape)
        batch = {}
        for side, response in (("chosen", counting), ("rejected", random)):
            tokens = np.concatenate([prompts, response], axis=1).astype(np.int32)
            weights = np.zeros((PAIRS, LENGTH), np.float32)
            weights[:, PROMPT - 1 :] = 1.0
            batch[f"{side}_input_ids"] = tokens[:, :-1]
            batch[f"{side}_target_labels"] = tokens[:, 1:]
            batch[f"{side}_target_weights"] = weights
        return batch


def _metrics(trainer_dir):
    with open(os.path.join(trainer_dir, "summaries", "train", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_dpo_raises_reward_accuracy_and_margin_within_100_steps(tmp_path):
    cfg = llama_dpo.llama_dpo_test_trainer()
    cfg.dir = str(tmp_path)
    cfg.input = _FixedPairs.default_config().set(
        global_batch_size=PAIRS, max_sequence_length=LENGTH, vocab_size=VOCAB, is_training=True
    )
    cfg.summary_writer.write_every_n_steps = 1
    trainer = cfg.instantiate(parent=None)
    trainer.run()
    rows = _metrics(str(tmp_path))
    first, last = rows[0], rows[-1]
    # Step 1 scores the starting weights, which the reference equals: no reward yet.
    assert first["step"] == 1 and first["model/rewards/accuracies"] == 0.0
    assert last["step"] <= 100
    assert last["model/rewards/accuracies"] > 0.9
    assert last["model/rewards/margins"] > first["model/rewards/margins"] + 1.0


def test_fake_pairs_share_their_prompt_and_weigh_only_the_response():
    pairs = FakePairInput.default_config().set(
        name="input", global_batch_size=2, max_sequence_length=8, vocab_size=50,
        prompt_length=3, is_training=True,
    ).instantiate(parent=None)
    batch = pairs.host_batch(0)
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
        k: (v.shape, v.dtype) for k, v in pairs.element_spec().items()
    }
    np.testing.assert_array_equal(batch["chosen_input_ids"][:, :3], batch["rejected_input_ids"][:, :3])
    assert np.any(batch["chosen_input_ids"][:, 3:] != batch["rejected_input_ids"][:, 3:])
    for side in ("chosen", "rejected"):
        np.testing.assert_array_equal(batch[f"{side}_target_weights"][0], [0, 0, 1, 1, 1, 1, 1, 1])
        np.testing.assert_array_equal(batch[f"{side}_input_ids"][:, 1:], batch[f"{side}_target_labels"][:, :-1])
