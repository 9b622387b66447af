"""New tokens -> text deltas, cut at the first stop string (the CLI's stream and the server's).

The whole answer is re-decoded each step and only what is new is released (a byte-level token can
end inside a UTF-8 character, shown as U+FFFD until the next one completes it). Text that could be
the start of a stop string is held back until it is known not to be one, so a client never sees
part of a stop string.
"""
from __future__ import annotations

from collections.abc import Iterable


class StopText:
    def __init__(self, tokenizer, stops: Iterable[str] = ()):
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.ids: list[int] = []
        self.sent = 0  # characters of the answer released so far
        self._answer = ""
        self.stopped = False  # a stop string appeared: the answer ends before it

    def push(self, token: int) -> str:
        """Add one token; returns the text it releases (may be empty)."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        return self._release(text, final=False)

    def finish(self) -> str:
        """The rest of the answer, once no token follows."""
        if self.stopped:
            return ""
        return self._release(self.tokenizer.decode(self.ids), final=True)

    @property
    def text(self) -> str:
        """The answer released so far."""
        return self._answer[:self.sent]

    def _release(self, text: str, final: bool) -> str:
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, text, end = True, text[:cut], cut
        elif final:
            end = len(text)
        else:
            end = len(text) - self._held(text)
        self._answer = text
        new, self.sent = text[self.sent:max(end, self.sent)], max(end, self.sent)
        return new

    def _held(self, text: str) -> int:
        """Characters at the end of `text` that begin some stop string."""
        longest = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
