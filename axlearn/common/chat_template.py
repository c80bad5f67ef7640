"""Chat and instruction records as token ids with a per-token loss mask.

A Hugging Face tokenizer carries its chat template (a Jinja program) in
`chat_template.jinja` or in the `chat_template` field of `tokenizer_config.json`, beside
its `tokenizer.json`. `ChatTemplate` renders it as transformers' `apply_chat_template`
does by default: a sandboxed Jinja environment with `trim_blocks` and `lstrip_blocks`,
the `loopcontrols` extension, transformers' `tojson` filter (no HTML escaping),
`raise_exception`, `strftime_now`, `dict` and `namespace` globals; the template sees
`messages`, `add_generation_prompt`, `tools` and `documents` (None) and the tokenizer's
named special tokens (`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`,
`cls_token`, `mask_token`) from `tokenizer_config.json`. Message keys whose value is
None are dropped and a message's reasoning is given under all three names templates read
(`reasoning_content`, `thinking`, `reasoning`), as transformers does. The rendered text
is tokenized whole without added special tokens (`add_special_tokens=False`), so the ids
equal `apply_chat_template(messages, tokenize=True)`.

The loss mask (`encode_conversation`) says which targets train, by role
(`--train_on`):
- `all`: every token of the rendered conversation.
- `assistant` (default): every assistant turn: from the end of the generation prompt
  before it (what `add_generation_prompt=True` appends, e.g. `<|im_start|>assistant\\n`)
  to the end of the turn as the template renders it (the end-of-turn tokens included, so
  that the model learns to stop).
- `last_turn`: the last assistant turn only.
A turn's characters are located by rendering the conversation's beginnings: turn k spans
`[len(render(messages[:k], add_generation_prompt=True)), len(render(messages[:k+1])))`,
which needs each of those renderings to begin the whole one (templates that rewrite
earlier turns, e.g. drop an earlier turn's reasoning, are refused with `assistant` and
`last_turn`). A token trains when its characters overlap a trained span (the rule of
transformers' `return_assistant_tokens_mask`). The EOS a shard appends after each
document trains where the conversation's last token does.

Records (JSON objects, one per line): `messages` (a list of `{role, content}`), or
`prompt` and `completion` (strings, or lists of messages; a string prompt is one user
turn and a string completion one assistant turn). Preference pairs
(`encode_preference_pair`): `prompt` with `chosen` and `rejected` in the same forms;
each of prompt+chosen and prompt+rejected trains on its response only.

Errors (`ChatDataError`, one line): a record that is no conversation, an unknown role, a
conversation without an assistant turn, a template that fails to render, a tokenizer
with no chat template; each names the file and record (`path:line`).
"""

import datetime
import json
import os
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from axlearn.common.input_base import InputError

TRAIN_ON = ("all", "assistant", "last_turn")  # Which targets of a conversation train.
# Roles a message may have; others are refused (a typo would otherwise silently render).
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # Where newer transformers save the template.
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"  # Older saves' special tokens.
# The named special tokens transformers hands a template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatDataError(InputError):
    """A chat record, template or tokenizer that cannot make a training example."""


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _environment() -> Any:
    """The Jinja environment transformers renders chat templates in (see the module doc)."""
    try:
        import jinja2  # pylint: disable=import-outside-toplevel
        import jinja2.ext  # pylint: disable=import-outside-toplevel
        import jinja2.sandbox  # pylint: disable=import-outside-toplevel
    except ImportError:
        raise ChatDataError(
            "chat templates need the 'jinja2' package: pip install 'axlearn[data]'"
        ) from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):  # pylint: disable=redefined-builtin
        return datetime.datetime.now().strftime(format)

    class Namespace(jinja2.utils.Namespace):
        """jinja2's namespace without underscore-prefixed attributes (no dunder access)."""

        def __init__(*args, **kwargs):  # pylint: disable=no-method-argument
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                Namespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot set the attribute {name!r} on a namespace"
                )

    class Dict:
        """`dict(...)` for templates, without the type's attributes."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers marks
        assistant text with it; the mask here comes from the turns instead)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller):
            return caller()

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = Dict()
    env.globals["namespace"] = Namespace
    return env


def _token_content(value: Any) -> Optional[str]:
    """A special token's text from tokenizer_config.json (a string or a serialized AddedToken)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    def __init__(
        self, source: str, *, special_tokens: Optional[dict[str, str]] = None, origin: str
    ):
        """`origin` names where the template came from, for errors."""
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})
        import jinja2  # pylint: disable=import-outside-toplevel

        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise ChatDataError(
                f"{origin}: the chat template does not compile ({_first_line(e)})"
            ) from None

    def __reduce__(self):  # Worker processes compile the template again.
        return (_make_template, (self.source, self.special_tokens, self.origin))

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = False) -> str:
        """The text of `messages` (raises jinja2/Python errors; see `render_or_raise`)."""
        return self._template.render(
            messages=_template_messages(messages),
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )

    def render_or_raise(
        self, messages: Sequence[dict], *, where: str, add_generation_prompt: bool = False
    ) -> str:
        """`render`, a failure being one ChatDataError line naming `where` and the template."""
        try:
            return self.render(messages, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # pylint: disable=broad-except
            raise ChatDataError(
                f"{where}: the chat template ({self.origin}) fails to render this record: "
                f"{type(e).__name__}: {_first_line(e)}"
            ) from None


def _make_template(source: str, special_tokens: dict[str, str], origin: str) -> ChatTemplate:
    return ChatTemplate(source, special_tokens=special_tokens, origin=origin)


def _template_messages(messages: Sequence[dict]) -> list[dict]:
    """Messages as transformers hands them to a template: None values dropped, reasoning
    under each of its names."""
    result = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        given = [message[k] for k in _REASONING_FIELDS if message.get(k) is not None]
        reasoning = given[0] if given else None
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        result.append(message)
    return result


def load_chat_template(
    vocab_file: Optional[str], *, chat_template_file: Optional[str] = None
) -> ChatTemplate:
    """The chat template of a tokenizer: `chat_template_file` if given, else
    `chat_template.jinja` or `tokenizer_config.json`'s `chat_template` beside `vocab_file`
    (a tokenizer.json; of a list of named templates, the one named 'default'). Special
    tokens come from that tokenizer_config.json (or, for a config without
    `added_tokens_decoder`, special_tokens_map.json over it), as transformers reads them.
    Raises ChatDataError naming the tokenizer where it has no template."""
    directory = os.path.dirname(os.path.abspath(vocab_file)) if vocab_file else None
    config: dict[str, Any] = {}
    config_path = os.path.join(directory, TOKENIZER_CONFIG_FILE) if directory else None
    if config_path and os.path.isfile(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise ChatDataError(
                f"{config_path}: unreadable tokenizer config ({_first_line(e)})"
            ) from None
        if not isinstance(config, dict):
            raise ChatDataError(f"{config_path}: not a JSON object")
    named = dict(config)
    map_path = os.path.join(directory, SPECIAL_TOKENS_MAP_FILE) if directory else None
    if "added_tokens_decoder" not in config and map_path and os.path.isfile(map_path):
        # A config without its added tokens is an older save: transformers then takes the
        # special tokens from special_tokens_map.json, over the config's.
        try:
            with open(map_path, encoding="utf-8") as f:
                named.update(json.load(f))
        except (OSError, ValueError) as e:
            raise ChatDataError(f"{map_path}: unreadable ({_first_line(e)})") from None
    special_tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        content = _token_content(named.get(name))
        if content is not None:
            special_tokens[name] = content
    if chat_template_file is not None:
        if not os.path.isfile(chat_template_file):
            raise ChatDataError(f"--chat_template={chat_template_file}: no such file")
        with open(chat_template_file, encoding="utf-8") as f:
            source = f.read()
        return ChatTemplate(source, special_tokens=special_tokens, origin=chat_template_file)
    jinja_path = os.path.join(directory, CHAT_TEMPLATE_FILE) if directory else None
    if jinja_path and os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return ChatTemplate(f.read(), special_tokens=special_tokens, origin=jinja_path)
    source = config.get("chat_template")
    if isinstance(source, list):  # Named templates: [{"name": ..., "template": ...}].
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if isinstance(source, str) and source:
        return ChatTemplate(source, special_tokens=special_tokens, origin=config_path)
    where = vocab_file or "the vocabulary"
    raise ChatDataError(
        f"{where}: the tokenizer has no chat template (none in {CHAT_TEMPLATE_FILE} or "
        f"{TOKENIZER_CONFIG_FILE} beside it); give one with --chat_template=FILE"
    )


# ----- records -----


def _as_messages(value: Any, *, role: str, field: str, where: str) -> list[dict]:
    """A string as one message of `role`, or a list of messages checked."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return check_messages(value, where=where, field=field)
    raise ChatDataError(
        f"{where}: field '{field}' must be a string or a list of messages, not "
        f"{type(value).__name__}"
    )


def check_messages(messages: Any, *, where: str, field: str = "messages") -> list[dict]:
    """`messages` if it is a list of {role, content} objects with known roles."""
    if not isinstance(messages, list) or not messages:
        raise ChatDataError(f"{where}: '{field}' must be a non-empty list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatDataError(f"{where}: {field}[{i}] is not an object with a string 'role'")
        if message["role"] not in ROLES:
            raise ChatDataError(
                f"{where}: {field}[{i}] has unknown role {message['role']!r} (known: "
                f"{', '.join(ROLES)})"
            )
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ChatDataError(f"{where}: {field}[{i}].content must be a string or a list")
    return messages


def conversation_of_record(record: Any, *, where: str) -> list[dict]:
    """The messages of an SFT record: `messages`, or `prompt` + `completion`."""
    if not isinstance(record, dict):
        raise ChatDataError(f"{where}: expected a JSON object, found {type(record).__name__}")
    if "messages" in record:
        messages = check_messages(record["messages"], where=where)
    elif "prompt" in record and "completion" in record:
        messages = _as_messages(record["prompt"], role="user", field="prompt", where=where)
        messages = messages + _as_messages(
            record["completion"], role="assistant", field="completion", where=where
        )
    else:
        raise ChatDataError(
            f"{where}: expected a field 'messages', or 'prompt' and 'completion' (found fields "
            f"{sorted(record)})"
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatDataError(f"{where}: the conversation has no assistant turn to train on")
    return messages


def pair_of_record(record: Any, *, where: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) messages of a preference-pair record."""
    if not isinstance(record, dict):
        raise ChatDataError(f"{where}: expected a JSON object, found {type(record).__name__}")
    missing = [f for f in ("prompt", "chosen", "rejected") if f not in record]
    if missing:
        raise ChatDataError(
            f"{where}: a preference pair needs 'prompt', 'chosen' and 'rejected'; missing "
            f"{', '.join(repr(f) for f in missing)} (found fields {sorted(record)})"
        )
    prompt = _as_messages(record["prompt"], role="user", field="prompt", where=where)
    responses = []
    for field in ("chosen", "rejected"):
        response = _as_messages(record[field], role="assistant", field=field, where=where)
        if not any(m["role"] == "assistant" for m in response):
            raise ChatDataError(f"{where}: '{field}' has no assistant turn")
        responses.append(response)
    return prompt, responses[0], responses[1]


# ----- tokens and masks -----


def encode_with_offsets(vocab: Any, text: str) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """(int32 ids of `text`, [n, 2] character (start, end) of each token), or offsets None
    for a vocabulary that gives none."""
    if hasattr(vocab, "encode_with_offsets"):
        ids, offsets = vocab.encode_with_offsets(text)
        return np.asarray(ids, np.int32), np.asarray(offsets, np.int64).reshape(-1, 2)
    if getattr(vocab, "kind", "") == "bytes":
        lengths = np.array([len(c.encode("utf-8")) for c in text], dtype=np.int64)
        char = np.repeat(np.arange(len(text), dtype=np.int64), lengths)
        return vocab.encode_array(text), np.stack([char, char + 1], axis=1)
    return np.asarray(vocab.encode(text), np.int32), None


def _mask_of_spans(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose characters [start, end) overlap a span."""
    mask = np.zeros(len(offsets), np.uint8)
    for start, end in spans:
        mask |= ((offsets[:, 1] > start) & (offsets[:, 0] < end)).astype(np.uint8)
    return mask


def _encode_spans(
    vocab: Any, text: str, spans: Sequence[tuple[int, int]]
) -> tuple[np.ndarray, np.ndarray]:
    """(ids of `text`, 1 on tokens in `spans`): by offsets, or for a vocabulary without
    them by encoding the pieces between span boundaries one at a time."""
    ids, offsets = encode_with_offsets(vocab, text)
    if offsets is not None:
        return ids, _mask_of_spans(offsets, spans)
    cuts = sorted({0, len(text), *(p for span in spans for p in span)})
    pieces, masks = [], []
    for start, end in zip(cuts[:-1], cuts[1:]):
        piece = np.asarray(vocab.encode(text[start:end]), np.int32)
        trained = any(s <= start and end <= e for s, e in spans)
        pieces.append(piece)
        masks.append(np.full(piece.size, int(trained), np.uint8))
    if not pieces:
        return np.empty(0, np.int32), np.empty(0, np.uint8)
    return np.concatenate(pieces), np.concatenate(masks)


def _prefix_length(
    template: ChatTemplate, messages: Sequence[dict], full: str, *, where: str, **kwargs
) -> int:
    """len(render(messages)), which must begin `full`."""
    text = template.render_or_raise(messages, where=where, **kwargs)
    if not full.startswith(text):
        raise ChatDataError(
            f"{where}: the chat template ({template.origin}) renders the conversation's first "
            f"{len(messages)} messages as other than a beginning of the whole, so its assistant "
            "turns cannot be located; use --train_on=all, or a template that renders "
            "conversations incrementally"
        )
    return len(text)


def trained_spans(
    template: ChatTemplate, messages: Sequence[dict], full: str, *, train_on: str, where: str
) -> list[tuple[int, int]]:
    """Character spans of `full` (the rendered `messages`) whose tokens train."""
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on={train_on!r} is not one of {TRAIN_ON}")
    if train_on == "all":
        return [(0, len(full))]
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on == "last_turn":
        turns = turns[-1:]
    spans = []
    for k in turns:
        start = _prefix_length(
            template, messages[:k], full, where=where, add_generation_prompt=True
        )
        end = len(full) if k == len(messages) - 1 else _prefix_length(
            template, messages[: k + 1], full, where=where
        )
        if end > start:
            spans.append((start, end))
    return spans


def _span_bytes(text: str, spans: Sequence[tuple[int, int]]) -> int:
    return sum(len(text[start:end].encode("utf-8")) for start, end in spans)


def encode_conversation(
    template: ChatTemplate, vocab: Any, messages: Sequence[dict], *, train_on: str, where: str
) -> tuple[np.ndarray, np.ndarray, int, str]:
    """(int32 ids, uint8 loss mask [ids + 1] whose last entry is the appended EOS's,
    UTF-8 bytes of the trained text, the rendered text) of a conversation."""
    full = template.render_or_raise(messages, where=where)
    spans = trained_spans(template, messages, full, train_on=train_on, where=where)
    ids, mask = _encode_spans(vocab, full, spans)
    if not mask.any():
        raise ChatDataError(f"{where}: no token of the conversation trains (train_on={train_on})")
    eos = mask[-1:] if mask.size else np.ones(1, np.uint8)
    return ids, np.concatenate([mask, eos]), _span_bytes(full, spans), full


def encode_preference_pair(
    template: ChatTemplate,
    vocab: Any,
    prompt: Sequence[dict],
    chosen: Sequence[dict],
    rejected: Sequence[dict],
    *,
    where: str,
) -> list[tuple[np.ndarray, np.ndarray, int, int]]:
    """[(ids, loss mask [ids + 1], trained bytes, prompt tokens)] of prompt+chosen and
    prompt+rejected, each training on its response (the turns after the prompt) only.
    `prompt tokens` counts the ids before the first trained one."""
    results = []
    for response in (chosen, rejected):
        messages = [*prompt, *response]
        full = template.render_or_raise(messages, where=where)
        start = _prefix_length(template, prompt, full, where=where, add_generation_prompt=True)
        spans = [(start, len(full))]
        ids, mask = _encode_spans(vocab, full, spans)
        if not mask.any():
            raise ChatDataError(f"{where}: the response renders as no token")
        prompt_tokens = int(np.argmax(mask))
        mask = np.concatenate([mask, mask[-1:]])
        results.append((ids, mask, _span_bytes(full, spans), prompt_tokens))
    return results


# (ids, loss mask [ids + 1], trained bytes, prompt tokens) of one stored document.
Encoded = tuple[np.ndarray, np.ndarray, int, int]


def encode_record(
    template: ChatTemplate,
    vocab: Any,
    record: Any,
    *,
    where: str,
    train_on: str,
    pairs: bool,
    max_sequence_length: Optional[int] = None,
) -> list[Encoded]:
    """The documents of one JSON record: an SFT conversation's one (prompt tokens 0), or
    a preference pair's two (`encode_preference_pair`), whose prompt must leave a response
    target within `max_sequence_length` where given."""
    if pairs:
        prompt, chosen, rejected = pair_of_record(record, where=where)
        documents = encode_preference_pair(
            template, vocab, prompt, chosen, rejected, where=where
        )
        prompt_tokens = max(document[3] for document in documents)
        if max_sequence_length is not None and prompt_tokens >= max_sequence_length:
            raise ChatDataError(
                f"{where}: the prompt is {prompt_tokens} tokens, leaving no response token in "
                f"a row of --max_sequence_length={max_sequence_length}"
            )
        return documents
    messages = conversation_of_record(record, where=where)
    ids, mask, num_bytes, _ = encode_conversation(
        template, vocab, messages, train_on=train_on, where=where
    )
    return [(ids, mask, num_bytes, 0)]


_worker: dict[str, Any] = {}  # A build worker's template, vocabulary and options.


def init_record_worker(
    template: ChatTemplate,
    vocab: Any,
    train_on: str,
    pairs: bool,
    max_sequence_length: Optional[int] = None,
) -> None:
    """Sets what `encode_records` uses (in a worker process, or in this one)."""
    _worker.update(
        template=template,
        vocab=vocab,
        train_on=train_on,
        pairs=pairs,
        max_sequence_length=max_sequence_length,
    )


def encode_records(items: Sequence[tuple[str, Any]]) -> list[list[Encoded]]:
    """`encode_record` of each (where, record), with `init_record_worker`'s settings."""
    return [
        encode_record(
            _worker["template"],
            _worker["vocab"],
            record,
            where=where,
            train_on=_worker["train_on"],
            pairs=_worker["pairs"],
            max_sequence_length=_worker["max_sequence_length"],
        )
        for where, record in items
    ]
