"""Incremental detokenisation with stop strings, for streaming text to a client, and the rules
that end a generation."""

from __future__ import annotations

from collections.abc import Callable, Collection

from epd.model_runtime.sampling import GenerationConfig


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
        # The earliest match, not the first stop string's: one token can complete two, and the
        # answer must hold neither ("ye" with stop ["llow", "e"] is "y").
        found = [at for s in self._stop if (at := full.find(s, max(0, len(self.text) - len(s)))) != -1]
        if found:
            self.stopped = True
            return self._release(full[: min(found)])
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


class OutputText:
    """A request's generated tokens, one at a time -> (text delta, finish reason): `IncrementalText`
    and the rules that end a generation: a stop string, an end-of-sequence token (unless
    `ignore_eos`), `max_new_tokens`. Decode runs one per request; prefill runs one over the first
    token alone, so that the gateway can stream that token before the KV cache reaches a decoder
    (the same rules from the same state give the same text; `PrefillHandle.first_text`)."""

    def __init__(
        self, decode: Callable[[list[int]], str], eos_token_ids: Collection[int], config: GenerationConfig
    ) -> None:
        self.text = IncrementalText(decode, config.stop)
        self.eos_token_ids = eos_token_ids
        self.config = config
        self.finish_reason = ""

    def add(self, token_id: int) -> tuple[str, str]:
        """Append one token: (the newly released text, the finish reason: "" while going on, else
        "stop" or "length"; what was held back is released with it)."""
        delta = self.text.add(token_id)
        if self.text.stopped:
            self.finish_reason = "stop"
        elif token_id in self.eos_token_ids and not self.config.ignore_eos:
            self.finish_reason = "stop"
        elif len(self.text.token_ids) >= self.config.max_new_tokens:
            self.finish_reason = "length"
        if self.finish_reason:
            delta += self.text.flush()
        return delta, self.finish_reason
