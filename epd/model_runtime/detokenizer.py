"""Incremental detokenisation with stop strings, for streaming text to a client, and the rules
that end a generation."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from typing import Protocol

from epd.model_runtime.sampling import GenerationConfig


class Detokenize(Protocol):
    """A model's text of token ids (`VLMAdapter.detokenize`), with vLLM's two decode options."""

    def __call__(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str: ...


StopReason = str | int | None
"""vLLM's `stop_reason` of a finished answer: the stop string that matched, the stop token id
(of `stop_token_ids`) that ended it, or None (end-of-sequence, length limit)."""


class IncrementalText:
    """Turns a growing list of token ids into text deltas.

    Text is withheld while it ends in an incomplete UTF-8 character ("\ufffd") or could still be
    the start of a stop string, so a client never sees text that is later taken back.

    include_stop: keep the matched stop string in the text (vLLM's include_stop_str_in_output;
    nothing is withheld for stop strings then, as a match is released whole). min_tokens: stop
    strings are looked for only once more than this many tokens are in, and only where they end in
    the text those later tokens added (vLLM's detokenizer).
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop
        self._hold = 0 if include_stop else max((len(s) for s in self._stop), default=1) - 1
        self._min_tokens = min_tokens
        self._unchecked_chars = 0  # the text of the first min_tokens tokens: no stop string ends in it
        self.token_ids: list[int] = []
        self.text = ""  # text released so far
        self.stopped = False
        self.matched_stop = ""
        """The stop string that ended the text (the earliest match), once `stopped`."""

    def add(self, token_id: int) -> str:
        """Append one token; returns the newly released text."""
        self.token_ids.append(token_id)
        full = self._decode(self.token_ids)
        if len(self.token_ids) <= self._min_tokens:
            self._unchecked_chars = len(full)
            found: list[tuple[int, int, str]] = []
        else:
            # The earliest match, not the first stop string's: one token can complete two, and the
            # answer must hold neither ("ye" with stop ["llow", "e"] is "y"); (start, end) of each.
            found = [
                (at, at + len(s), s)
                for s in self._stop
                if (at := full.find(s, max(0, len(self.text) - len(s), self._unchecked_chars - len(s) + 1)))
                != -1
            ]
        if found:
            self.stopped = True
            start, end, self.matched_stop = min(found)
            return self._release(full[:end] if self._include_stop else full[:start])
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
    `ignore_eos`; the model's others than the tokenizer's end it as stop tokens, vLLM's), one of
    `stop_token_ids` (the text of either left out unless `include_stop_str_in_output`, as vLLM's),
    `max_new_tokens`; before `min_tokens` tokens are out, only the last (as vLLM's). The text is
    `detokenize` with the request's `skip_special_tokens` and `spaces_between_special_tokens`. Decode runs one
    per request; prefill runs one over the first token alone, so that the gateway can stream that
    token before the KV cache reaches a decoder (the same rules from the same state give the same
    text; `PrefillHandle.first_text`)."""

    def __init__(
        self,
        detokenize: Detokenize,
        eos_token_ids: Collection[int],
        config: GenerationConfig,
        *,
        eos_token_id: int | None,
    ) -> None:
        """eos_token_ids: every id that ends an answer; eos_token_id: the tokenizer's among them
        (`VLMAdapter.eos_token_id`), the one whose answer has no `stop_reason`."""
        # The request's decode options travel in its GenerationConfig, so prefill's first token and
        # decode's tokens are detokenised alike.
        decode = functools.partial(
            detokenize,
            skip_special_tokens=config.skip_special_tokens,
            spaces_between_special_tokens=config.spaces_between_special_tokens,
        )
        self.text = IncrementalText(decode, config.stop, config.include_stop_str_in_output, config.min_tokens)
        self.eos_token_ids = eos_token_ids
        self.eos_token_id = eos_token_id
        self.stop_token_ids = frozenset(config.stop_token_ids)
        self.config = config
        self.num_tokens = 0
        self.finish_reason = ""
        self.stop_reason: StopReason = None
        """vLLM's `stop_reason`, once finished: the stop string that matched, or the id of the
        `stop_token_ids` token (or end-of-sequence token other than the tokenizer's) that ended the
        answer; None when the tokenizer's end-of-sequence token or the length limit ended it (or
        while going on)."""

    def add(self, token_id: int) -> tuple[str, str]:
        """Append one token: (the newly released text, the finish reason: "" while going on, else
        "stop" or "length"; what was held back is released with it)."""
        self.num_tokens += 1
        may_stop = self.num_tokens >= self.config.min_tokens
        # vLLM's order (`check_stop` since it moved min_tokens there, then its detokenizer): the
        # end-of-sequence and stop tokens before the length cap, so that either drawn as the last
        # allowed token ends the answer "stop", as a stop string found in that token's text does.
        length = self.num_tokens >= self.config.max_new_tokens
        stop_token = may_stop and token_id in self.stop_token_ids
        # With a structured-output constraint the end-of-sequence token is the constraint's end
        # (allowed only once it is complete), so it ends the answer even under ignore_eos.
        ends_at_eos = not self.config.ignore_eos or self.config.structured_outputs is not None
        eos = may_stop and token_id in self.eos_token_ids and ends_at_eos
        # The text of a stop token, or of the end-of-sequence token that ends the answer, is not
        # the answer's unless asked for (vLLM's detokenizer leaves out the token that stopped the
        # request: "<|im_end|>" does not end an answer decoded with skip_special_tokens false);
        # the text held back before it is released by the flush below.
        ends = stop_token or eos
        delta = "" if ends and not self.config.include_stop_str_in_output else self.text.add(token_id)
        if self.text.stopped or stop_token or eos:
            self.finish_reason = "stop"
            # A stop string found in a stop token's own text (include_stop_str_in_output) is the
            # one the text was cut at. The tokenizer's end-of-sequence token that ends the answer
            # is None even when the client also listed it in stop_token_ids: vLLM's check_stop
            # tests it before stop_token_ids (under ignore_eos it is a plain stop token again,
            # and its id). The model's other end-of-sequence ids are stop tokens to vLLM (added
            # to stop_token_ids from the generation config): their id.
            primary_eos = eos and token_id == self.eos_token_id
            self.stop_reason = (
                self.text.matched_stop if self.text.stopped else None if primary_eos else token_id
            )
        elif length:
            self.finish_reason = "length"
        if self.finish_reason:
            delta += self.text.flush()
        return delta, self.finish_reason
