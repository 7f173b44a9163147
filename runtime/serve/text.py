"""Token ids -> text, incrementally: each token decodes only a small window of the ids before it (as
vLLM's incremental detokenizer does), never the whole output again; byte-level BPE tokens can split a
UTF-8 character, so text is released only once it decodes whole. Stop strings are searched in the
released text, the earliest match wins (not the first in the list), and a tail that could still become
a stop string is held back until it cannot. A match is acted on only once no stop starting before it
can still complete: with stops "on " and "n", the text "on" waits for the next character (" " then
cuts before "on ", "x" before "n")."""
from __future__ import annotations

WINDOW = 6             # ids decoded before the new ones, so a token's leading space or merge is right


class TextStream:
    def __init__(self, tokenizer, stop: list[str] = ()):
        self.tok = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.prefix = self.read = 0    # ids[prefix:read] decoded already (context); ids[read:] not yet
        self.text = ""                 # all decoded text so far
        self.sent = 0                  # characters of it already released
        self.stopped = False           # a stop string was found: nothing more is released

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def _advance(self) -> None:
        """Decode the new ids against their window; keep an incomplete UTF-8 tail for later."""
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        if now.endswith("\ufffd") or len(now) < len(before):
            return                                  # an incomplete UTF-8 sequence: wait for the rest
        self.text += now[len(before):]
        self.prefix, self.read = max(0, len(self.ids) - WINDOW), len(self.ids)

    def _earliest_stop(self) -> int:
        start = max((self.sent - len(s) + 1 for s in self.stop), default=0)
        hits = [at for s in self.stop if (at := self.text.find(s, max(0, start))) >= 0]
        return min(hits) if hits else -1

    def _pending_before(self, at: int) -> bool:
        """Whether a stop could still match starting before `at`: the text from some j < at is a proper
        prefix of it (the next characters decide)."""
        n = len(self.text)
        return any(s.startswith(self.text[j:]) for s in self.stop for j in range(max(0, n - len(s) + 1), at))

    def push(self, token_id: int) -> str:
        """Add one token; -> the text that can be released now ('' while held back)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        self._advance()
        at = self._earliest_stop()
        if at >= 0 and not self._pending_before(at):
            self.stopped = True
            out, self.sent = self.text[self.sent:at], at
            return out
        hold = max((len(s) - 1 for s in self.stop), default=0)
        end = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent:end], end
        return out

    def flush(self) -> str:
        """At the end of generation: release whatever was held back (an incomplete tail as decoded)."""
        if self.stopped:
            return ""
        now = self._decode(self.ids[self.prefix:])
        self.text += now[len(self._decode(self.ids[self.prefix:self.read])):]
        self.read = len(self.ids)
        at = self._earliest_stop()
        end = at if at >= 0 else len(self.text)
        self.stopped = at >= 0
        out, self.sent = self.text[self.sent:end], end
        return out
