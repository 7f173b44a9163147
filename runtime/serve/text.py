"""Token ids -> text, incrementally: byte-level BPE tokens can split a UTF-8 character, so text is
released only once it decodes whole; stop strings are searched in the released text, and a tail
that could still become a stop string is held back until it cannot."""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str] = ()):
        self.tok = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0                  # characters of the decoded text already released
        self.stopped = False           # a stop string was found: nothing more is released

    def _text(self) -> str:
        return self.tok.decode(self.ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Add one token; -> the text that can be released now ('' while held back)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        text = self._text()
        if text.endswith("\ufffd"):                 # an incomplete UTF-8 sequence: wait for the rest
            return ""
        for s in self.stop:
            at = text.find(s, max(0, self.sent - len(s) + 1))
            if at >= 0:
                self.stopped = True
                out, self.sent = text[self.sent:at], at
                return out
        hold = max((len(s) - 1 for s in self.stop), default=0)
        end = max(self.sent, len(text) - hold)
        out, self.sent = text[self.sent:end], end
        return out

    def flush(self) -> str:
        """At the end of generation: release whatever was held back."""
        if self.stopped:
            return ""
        text = self._text()
        out, self.sent = text[self.sent:], len(text)
        return out
