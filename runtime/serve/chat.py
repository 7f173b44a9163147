"""The chat template: messages -> prompt token ids, in DeepSeek's conversation format.

DeepSeek-V4.1's own prompt encoder (`encoding/encoding.py` in the release) is not available on these
machines; the stand-in follows the published DeepSeek-V3 format, whose markers are special tokens of
the tokenizer (runtime/tokenizer.py SPECIAL):
  <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜>{assistant}<｜end▁of▁sentence｜><｜User｜>...<｜Assistant｜>
A template is Jinja2 over `messages` (each {role, content}), `add_generation_prompt`, `bos_token` and
`eos_token`; `dsv41-serve --chat-template FILE` swaps in another (e.g. the real one when published).
Encoding is structural: each message's content is replaced by a sentinel before rendering, the
template's own text is encoded with the markers as special tokens, and each content with a tokenizer
that has no special tokens, so text a user sends can never forge a turn marker."""
from __future__ import annotations

from pathlib import Path

import jinja2

from runtime.tokenizer import SPECIAL, without_specials

STAND_IN = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'system' %}{{ m.content }}"
    "{% elif m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% else %}<｜Assistant｜>{{ m.content }}{{ eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
ROLES = ("system", "user", "assistant")
SENTINEL = "\x00dsv41-content-{}\x00"


class ChatTemplate:
    def __init__(self, path: str | Path | None = None):
        source = STAND_IN if path is None else Path(path).read_text()
        env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{path}: not a valid Jinja2 chat template: {e}") from None
        self.name = "stand-in (DeepSeek-V3 format)" if path is None else str(path)
        self._plain = {}

    def _check(self, messages: list[dict]) -> None:
        for i, m in enumerate(messages):
            if m.get("role") not in ROLES:
                raise ValueError(f"messages[{i}].role must be one of {ROLES}, got {m.get('role')!r}")

    def render(self, messages: list[dict]) -> str:
        """The prompt as text (markers included)."""
        self._check(messages)
        return self.template.render(messages=messages, add_generation_prompt=True, bos_token=SPECIAL["bos"],
                                    eos_token=SPECIAL["eos"])

    def encode(self, messages: list[dict], tokenizer) -> list[int]:
        """The prompt's token ids: the template's text with its markers as special tokens, every
        message's content as plain text (a marker string typed by a user stays text)."""
        self._check(messages)
        masked = [{**m, "content": SENTINEL.format(i)} for i, m in enumerate(messages)]
        text = self.template.render(messages=masked, add_generation_prompt=True, bos_token=SPECIAL["bos"],
                                    eos_token=SPECIAL["eos"])
        plain = self._plain.setdefault(id(tokenizer), without_specials(tokenizer))
        ids, rest = [], text
        for i, m in enumerate(messages):
            mark = SENTINEL.format(i)
            if mark not in rest:                       # a template that drops a message's content
                continue
            head, rest = rest.split(mark, 1)
            if SENTINEL.split("{}")[0] in head:
                raise ValueError("the chat template reorders messages; it must render them in order")
            ids += tokenizer.encode(head).ids if head else []
            ids += plain.encode(m["content"]).ids if m["content"] else []
        return ids + (tokenizer.encode(rest).ids if rest else [])
