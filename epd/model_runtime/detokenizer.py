"""Incremental detokenisation with stop strings, for streaming text to a client."""

from __future__ import annotations

from collections.abc import Callable


class IncrementalText:
    """Turns a growing list of token ids into text deltas.

    Text is withheld while it ends in an incomplete UTF-8 character ("\ufffd") or could still be
    the start of a stop string, so a client never sees text that is later taken back.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()) -> None:
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # text released so far
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Append one token; returns the newly released text."""
        self.token_ids.append(token_id)
        full = self._decode(self.token_ids)
        for s in self._stop:
            at = full.find(s, max(0, len(self.text) - len(s)))
            if at != -1:
                self.stopped = True
                return self._release(full[:at])
        if full.endswith("\ufffd"):
            return ""
        return self._release(full[: len(full) - self._hold] if self._hold else full)

    def flush(self) -> str:
        """Release what was held back (call when generation ends without a stop string)."""
        if self.stopped:
            return ""
        return self._release(self._decode(self.token_ids))

    def _release(self, upto: str) -> str:
        if len(upto) <= len(self.text) or not upto.startswith(self.text):
            return ""
        delta = upto[len(self.text) :]
        self.text = upto
        return delta
