"""chat_template: rendering equals transformers' apply_chat_template; masks by role."""

import json
import random

import numpy as np
import pytest

from axlearn.common.chat_template import (
    ChatDataError,
    conversation_of_record,
    encode_conversation,
    encode_preference_pair,
    load_chat_template,
    pair_of_record,
)
from axlearn.common.input_token_format import TokenShard
from axlearn.common.input_tokens import main
from axlearn.common.input_vocab import load_vocabulary

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "[INST]", "[/INST]"]

# Templates written for these tests, in the styles of common model families.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
INST = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system = none %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system is not none %}
            {{- '[INST] ' + system + '\\n\\n' + message['content'] | trim + ' [/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] | trim + ' [/INST]' }}
        {%- endif %}
    {%- else %}
        {{- ' ' + message['content'] | trim + eos_token }}
    {%- endif %}
{%- endfor %}"""
# Block tags with trim_blocks/lstrip_blocks, namespace, loop controls, tojson.
HEADERS = """{% set ns = namespace(turns=0) %}
{% for message in messages %}
    {% if message.role == 'tool' %}
<s>tool {{ message.content | tojson }}</s>
        {% continue %}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
<s>{{ message.role }} {{ ns.turns }}
{{ message.content }}</s>
{% endfor %}
{% if add_generation_prompt %}
<s>assistant {{ ns.turns + 1 }}
{% endif %}"""
# transformers marks assistant text with {% generation %}: its mask is the reference.
GENERATION = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n"
    "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _words(rng: random.Random, n: int) -> str:
    vocab = ["hello", "world", "the", "cat", "sat", "on", "mat", "é", "naïve", "2+2", "=", "4"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def _conversation(seed: int, *, turns: int = 3, system: bool = True) -> list[dict]:
    rng = random.Random(seed)
    messages = [{"role": "system", "content": _words(rng, 5)}] if system else []
    for _ in range(turns):
        messages.append({"role": "user", "content": _words(rng, rng.randint(1, 8))})
        messages.append({"role": "assistant", "content": _words(rng, rng.randint(1, 8))})
    return messages


@pytest.fixture(name="tokenizer_dir", scope="module")
def fixture_tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer.json made here, with a tokenizer_config.json."""
    directory = tmp_path_factory.mktemp("tok")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=_SPECIALS,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = random.Random(0)
    tokenizer.train_from_iterator([_words(rng, 20) for _ in range(200)], trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def _write_config(directory, template) -> None:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": template,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def _setup(tmp_path, tokenizer_dir, template):
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    _write_config(directory, template)
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    vocab = load_vocabulary(str(directory / "tokenizer.json"), any_special_ids=True)
    return load_chat_template(str(directory / "tokenizer.json")), vocab, reference


@pytest.mark.parametrize("name", ["CHATML", "INST", "HEADERS"])
def test_rendering_and_ids_equal_transformers_apply_chat_template(tmp_path, tokenizer_dir, name):
    template, vocab, reference = _setup(tmp_path, tokenizer_dir, globals()[name])
    messages = _conversation(1, system=name != "HEADERS")
    if name == "HEADERS":
        messages.insert(2, {"role": "tool", "content": "<b>42</b> é"})
    for prompt in (False, True):
        expected = reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=prompt
        )
        assert template.render(messages, add_generation_prompt=prompt) == expected
    ids, mask, _, _ = encode_conversation(
        template, vocab, messages, train_on="all", where="test"
    )
    expected_ids = reference.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert ids.tolist() == list(expected_ids)
    assert mask.tolist() == [1] * (len(ids) + 1)


def test_assistant_mask_equals_transformers_generation_mask(tmp_path, tokenizer_dir):
    template, vocab, reference = _setup(tmp_path, tokenizer_dir, GENERATION)
    messages = _conversation(2, turns=4)
    ids, mask, _, _ = encode_conversation(
        template, vocab, messages, train_on="assistant", where="test"
    )
    out = reference.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert ids.tolist() == list(out["input_ids"])
    assert mask[:-1].tolist() == list(out["assistant_masks"])
    assert mask[-1] == 1  # The appended EOS follows the last (assistant) token.


def _runs(mask) -> list[tuple[int, int]]:
    """(start, end) of each run of ones."""
    padded = np.concatenate([[0], np.asarray(mask), [0]])
    edges = np.flatnonzero(np.diff(padded))
    return list(zip(edges[::2], edges[1::2]))


def test_last_turn_mask_is_the_last_assistant_turn_only(tmp_path, tokenizer_dir):
    template, vocab, reference = _setup(tmp_path, tokenizer_dir, GENERATION)
    messages = _conversation(3, turns=3)
    _, mask, _, _ = encode_conversation(
        template, vocab, messages, train_on="last_turn", where="test"
    )
    out = reference.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    runs = _runs(out["assistant_masks"])
    assert len(runs) == 3
    expected = np.zeros(len(out["input_ids"]), np.uint8)
    expected[runs[-1][0] : runs[-1][1]] = 1
    np.testing.assert_array_equal(mask[:-1], expected)


def test_mask_counts_by_role_cover_each_assistant_turn_and_its_end(tmp_path, tokenizer_dir):
    template, vocab, _ = _setup(tmp_path, tokenizer_dir, CHATML)
    messages = _conversation(4, turns=2)
    ids, mask, num_bytes, full = encode_conversation(
        template, vocab, messages, train_on="assistant", where="test"
    )
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    turns = [m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]
    expected = sum(len(tok.encode(t, add_special_tokens=False).ids) for t in turns)
    assert int(mask[:-1].sum()) == expected
    assert num_bytes == sum(len(t.encode("utf-8")) for t in turns)
    assert full.count("<|im_start|>assistant\n") == 2


def test_prompt_completion_records_are_one_user_and_one_assistant_turn():
    messages = conversation_of_record({"prompt": "hi", "completion": "yo"}, where="f:1")
    assert messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


@pytest.mark.parametrize(
    "record, message",
    [
        ({"messages": [{"role": "user", "content": "hi"}]},
         "f.jsonl:7: the conversation has no assistant turn"),
        ({"messages": [{"role": "robot", "content": "hi"}]},
         "f.jsonl:7: messages[0] has unknown role 'robot'"),
        ({"text": "hi"}, "f.jsonl:7: expected a field 'messages', or 'prompt' and 'completion'"),
    ],
)
def test_bad_sft_record_is_one_line_naming_file_and_record(record, message):
    with pytest.raises(ChatDataError) as e:
        conversation_of_record(record, where="f.jsonl:7")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_pair_record_missing_rejected_is_named():
    with pytest.raises(ChatDataError, match=r"^p.jsonl:3: .*missing 'rejected'"):
        pair_of_record({"prompt": "q", "chosen": "a"}, where="p.jsonl:3")


def test_template_that_fails_to_render_names_the_record(tmp_path, tokenizer_dir):
    template, vocab, _ = _setup(tmp_path, tokenizer_dir, INST)
    messages = [{"role": "assistant", "content": "first"}]  # INST wants user first.
    with pytest.raises(ChatDataError, match=r"^d.jsonl:2: .*fails to render.*must alternate"):
        encode_conversation(template, vocab, messages, train_on="assistant", where="d.jsonl:2")


def test_tokenizer_without_a_chat_template_needs_chat_template_flag(tmp_path, tokenizer_dir):
    path = tmp_path / "tokenizer.json"
    path.write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    with pytest.raises(ChatDataError, match=r"has no chat template.*--chat_template=FILE"):
        load_chat_template(str(path))
    (tmp_path / "t.jinja").write_text(CHATML)
    given = load_chat_template(str(path), chat_template_file=str(tmp_path / "t.jinja"))
    assert given.source == CHATML


def test_pair_responses_train_and_prompts_do_not(tmp_path, tokenizer_dir):
    template, vocab, reference = _setup(tmp_path, tokenizer_dir, CHATML)
    prompt = [{"role": "user", "content": "which is 2+2"}]
    chosen = [{"role": "assistant", "content": "4"}]
    rejected = [{"role": "assistant", "content": "5 no"}]
    encoded = encode_preference_pair(template, vocab, prompt, chosen, rejected, where="p:1")
    prefix = reference.apply_chat_template(
        prompt, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    for (ids, mask, _, prompt_tokens), response in zip(encoded, (chosen, rejected)):
        full = reference.apply_chat_template(prompt + response, tokenize=True, return_dict=False)
        assert ids.tolist() == list(full)
        assert prompt_tokens == len(prefix)
        assert mask[: len(prefix)].sum() == 0 and mask[len(prefix) :].all()


def test_build_chat_from_a_hugging_face_directory_stores_transformers_ids_and_mask(
    tmp_path, tokenizer_dir
):
    _, _, reference = _setup(tmp_path, tokenizer_dir, GENERATION)
    conversations = [_conversation(seed, turns=2) for seed in (5, 6)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    main(["build", "--chat", f"--vocab={tmp_path / 'hf'}", f"--output={tmp_path / 'out'}/",
          str(data)])
    shard = TokenShard(str(tmp_path / "out" / "train-00000.tok"))
    tokens, mask = [], []
    for messages in conversations:
        out = reference.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        tokens += list(out["input_ids"]) + [reference.eos_token_id]
        mask += list(out["assistant_masks"]) + [1]
    np.testing.assert_array_equal(shard.tokens, tokens)
    np.testing.assert_array_equal(shard.loss_mask, mask)
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()  # Beside the shards.


def test_chat_template_jinja_beside_the_tokenizer_comes_before_tokenizer_config(
    tmp_path, tokenizer_dir
):
    template, _, _ = _setup(tmp_path, tokenizer_dir, CHATML)
    (tmp_path / "hf" / "chat_template.jinja").write_text(INST)
    assert load_chat_template(str(tmp_path / "hf" / "tokenizer.json")).source == INST
    assert template.source == CHATML


def test_special_tokens_map_of_an_older_save_names_the_tokens_as_transformers_reads_them(
    tmp_path, tokenizer_dir
):
    _setup(tmp_path, tokenizer_dir, "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}")
    directory = tmp_path / "hf"
    (directory / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    template = load_chat_template(str(directory / "tokenizer.json"))
    messages = [{"role": "user", "content": "hi"}]
    assert template.render(messages) == reference.apply_chat_template(messages, tokenize=False)
