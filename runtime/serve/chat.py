"""The chat template: messages -> one prompt string.

DeepSeek-V4.1's own prompt format (`encoding/encoding.py` in the release) is not available on these
machines, so this is a documented stand-in with the same shape: a Jinja2 template over `messages`
(each {role, content}) that ends with the assistant's turn opened. Swap it for the real one with
`dsv41-serve --chat-template FILE` (any Jinja2 file with the same inputs: `messages`,
`add_generation_prompt`)."""
from __future__ import annotations

from pathlib import Path

import jinja2

STAND_IN = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatTemplate:
    def __init__(self, path: str | Path | None = None):
        source = STAND_IN if path is None else Path(path).read_text()
        env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{path}: not a valid Jinja2 chat template: {e}") from None
        self.name = "stand-in" if path is None else str(path)

    def render(self, messages: list[dict]) -> str:
        for i, m in enumerate(messages):
            if m.get("role") not in ROLES:
                raise ValueError(f"messages[{i}].role must be one of {ROLES}, got {m.get('role')!r}")
        return self.template.render(messages=messages, add_generation_prompt=True)
