"""vLLM's `bad_words`: words a request never generates, as token sequences and as a per-step ban.

A word becomes token sequences as vLLM's `SamplingParams.update_from_tokenizer` makes them: its
text with leading spaces stripped, tokenised without special tokens, always; and with one leading
space (the form the word takes mid-sentence in a BPE vocabulary) when that gives another first
token and as many tokens. At each step the last token of a sequence is banned when the answer's
last tokens are the rest of it (a sequence of one token: always). Only the answer's tokens count,
as vLLM's: a word is never completed across the end of the prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def tokenize_bad_words(
    words: Sequence[str], tokenize: Callable[[str], list[int]], vocab_size: int | None
) -> tuple[tuple[int, ...], ...]:
    """Each word's token sequences (one or two per word, duplicates dropped); `tokenize`: text ->
    ids without special tokens. ValueError for a word that tokenises to nothing, or to an id the
    model's logits do not have (a tokenizer larger than `vocab_size`)."""
    sequences: dict[tuple[int, ...], None] = {}  # insertion-ordered set
    for word in words:
        bare = tuple(tokenize(word.lstrip()))
        if not bare:
            raise ValueError(f"bad_words: {word!r} gives no token with this model's tokenizer; leave it out")
        sequences[bare] = None
        spaced = tuple(tokenize(" " + word.lstrip()))
        # vLLM's rule: the spaced form only when it is a word token of its own (another first
        # token) of the same length.
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences[spaced] = None
    if vocab_size is not None:
        bad = sorted({t for seq in sequences for t in seq if not 0 <= t < vocab_size})
        if bad:
            raise ValueError(
                f"bad_words: this model's tokenizer gives token ids {bad[:8]} outside its logits "
                f"(0 to {vocab_size - 1}); leave out the words that contain them"
            )
    return tuple(sequences)


class BadWords:
    """The tokens one request's bad words ban at its next step, from the answer so far."""

    def __init__(self, sequences: Sequence[Sequence[int]]) -> None:
        self.always = sorted({seq[0] for seq in sequences if len(seq) == 1})
        """Words of one token: banned at every step."""
        # prefix length -> {the word's other tokens: the last tokens they ban}
        self._by_prefix: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for seq in sequences:
            if len(seq) > 1:
                self._by_prefix.setdefault(len(seq) - 1, {}).setdefault(tuple(seq[:-1]), []).append(seq[-1])
        longest = max(self._by_prefix, default=0)
        self._tail: list[int] = []  # the answer's last `longest` tokens
        self._tail_len = longest

    def seen(self, token_id: int) -> None:
        """One more token of the answer."""
        if self._tail_len:
            self._tail.append(token_id)
            del self._tail[: -self._tail_len]

    def banned_now(self) -> list[int]:
        """The token ids banned at the next step (distinct ids of multi-token words whose other
        tokens end the answer; the single-token words are `always`)."""
        banned: list[int] = []
        for length, prefixes in self._by_prefix.items():
            if length <= len(self._tail):
                banned += prefixes.get(tuple(self._tail[-length:]), [])
        return banned
