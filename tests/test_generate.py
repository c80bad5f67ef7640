"""generate: batched decoding against transformers' `generate`, and the command."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from axlearn.common import generate, hf_llama
from axlearn.common.decoder import prompt_lengths_of

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 64


def _hf_model(seed=1):
    """A random Llama without pad, bos or eos ids; weights of std 0.2 (the default 0.02
    makes a tiny model repeat its last token)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
        initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _hf_greedy(hf, prompt, max_new_tokens, eos_ids):
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_ids,
            pad_token_id=eos_ids[0] if eos_ids else 0,
        )
    return out[0, len(prompt):].tolist()


def test_prompt_lengths_count_pad_ids_inside_a_prompt():
    prompts = jnp.asarray([[5, 0, 7, 0, 0], [0, 0, 3, 4, 9], [6, 0, 0, 0, 0]])
    np.testing.assert_array_equal(prompt_lengths_of(prompts, 0), [3, 5, 1])
    np.testing.assert_array_equal(prompt_lengths_of(prompts, None), [5, 5, 5])


def test_batched_greedy_generation_equals_transformers_with_a_list_of_eos_ids():
    hf = _hf_model()
    # Prompts of different lengths holding token 0 (a real token: there is no pad id).
    prompts = [[0, 12, 0, 40], [7, 0], [0], [33, 21, 0, 5, 0, 9, 0]]
    free = [_hf_greedy(hf, p, 8, None) for p in prompts]
    # End-of-turn style ids: tokens that the greedy continuations produce part-way.
    eos_ids = sorted({free[0][3], free[1][2]})
    expected = [_hf_greedy(hf, p, 8, eos_ids) for p in prompts]
    lengths = sorted(len(e) for e in expected)
    assert lengths[0] < 8 and lengths[-1] == 8, lengths  # Rows stop at either id, or run on.
    cfg = hf_llama.llama_config_from_hf(hf.config)
    cfg.decoder.eos_token_id = eos_ids
    assert cfg.decoder.pad_token_id is None
    generator = generate.Generator(cfg, hf_llama.params_from_hf(hf.state_dict(), cfg))
    outputs, stats = generator.generate(prompts, max_new_tokens=8, batch_size=4)
    assert outputs == expected
    assert stats.new_tokens == sum(len(e) for e in expected)


@pytest.mark.slow
def test_sampling_with_top_k_1_equals_greedy():
    hf = _hf_model(seed=2)
    cfg = hf_llama.llama_config_from_hf(hf.config)
    generator = generate.Generator(cfg, hf_llama.params_from_hf(hf.state_dict(), cfg))
    prompts = [[1, 2, 3], [4, 0]]
    greedy, _ = generator.generate(prompts, max_new_tokens=5, batch_size=2)
    sampled, _ = generator.generate(
        prompts, max_new_tokens=5, batch_size=2,
        sampling=generate.Sampling(temperature=0.7, top_k=1, seed=3),
    )
    assert sampled == greedy


def _tokenizer_files(directory):
    """A word-level tokenizer.json: '!' is id 0, then <s>, </s>, then w0..w60."""
    tokenizers = pytest.importorskip("tokenizers")
    words = ["!", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tokenizer = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="!")
    )
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )


@pytest.mark.slow
def test_the_command_generates_from_a_hf_directory_with_its_tokenizer(tmp_path, capsys):
    hf = _hf_model(seed=3)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")  # Sharded, with an index.
    _tokenizer_files(tmp_path)
    prompts = ["w3 ! w7", "! w12"]
    args = generate.parse_flags([
        f"--hf_dir={tmp_path}", f"--prompt={prompts[0]}", f"--prompt={prompts[1]}",
        "--max_new_tokens=6", "--batch_size=2", "--dtype=float32",
    ])
    stats = generate.run(args)
    printed = capsys.readouterr().out
    assert f"{stats.new_tokens} tokens generated" in printed and "tokens/s" in printed
    # The same ids through transformers: <s> (id 1) then the words' ids.
    for text in prompts:
        ids = [1] + [0 if w == "!" else int(w[1:]) + 3 for w in text.split()]
        new = _hf_greedy(hf, ids, 6, None)
        words = ["!" if i == 0 else f"w{i - 3}" for i in new]
        assert " ".join(text.split() + words) in printed
