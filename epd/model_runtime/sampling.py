"""Token sampling: greedy, temperature, top-k, top-p, with a seeded generator; vLLM's allowed_token_ids,
bad_words, penalties, logit bias, min_tokens and min_p through `epd.model_runtime.logits_processors`
when a request asks; vLLM's structured outputs (a grammar's token mask) through
`epd.model_runtime.structured_output`."""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch  # imported where sampling runs: the gateway reads GenerationConfig without torch

    from epd.model_runtime.grammar_state import CompiledGrammar
    from epd.model_runtime.logits_processors import LogitsProcessors


MAX_NEW_TOKENS = 4096
"""The stages' default bound on a request's max_new_tokens (OpenAI's max_tokens): decode reserves
KV room for the prompt plus all of them before it pulls the cache, so one request asking for the
whole context would hold that room for its whole life (vLLM's paged cache grows as tokens come)."""

GREEDY_BELOW_TEMPERATURE = 1e-5
"""vLLM's `_SAMPLING_EPS`: a temperature this small is greedy. Dividing by a tinier one (1e-45
passes every check of a finite number >= 0) sends the logits to inf and the sampler to NaN."""

MAX_CHOICES = 16
"""The most choices one request may ask for (OpenAI's and vLLM's `n`). vLLM sets none; each choice
is a decode request of its own (a batch row, its KV room in a decoder), so the bound keeps one
request from taking a decoder's whole batch; more choices are more requests."""

INT64_SPAN = 2**64

MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 512
"""At most this many stop strings of at most this many characters each: each is compared with the
end of the answer after every token (OpenAI takes 4; vLLM has no bound, and a list of megabytes
would pass its way to every stage)."""


MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOP_TOKEN_IDS = 256
"""At most this many logit_bias entries and stop_token_ids: they travel with the request to every
stage (the front door cannot check them against a vocabulary it does not load)."""

MAX_ALLOWED_TOKEN_IDS = 65536
"""At most this many allowed_token_ids (vLLM has no bound): enough to allow a script's or a
language's share of a 151,936-token vocabulary, and at most 0.5 MB on the wire to every stage."""

MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 512
"""At most this many bad_words of at most this many characters each: prefill and decode tokenise
each twice (with and without a leading space) on their model thread, and the words' token ids are
compared with the end of the answer before every token."""

MAX_ABS_LOGIT_BIAS = 100.0
"""OpenAI's range of a logit_bias value: [-100, 100]."""

MAX_ABS_PENALTY = 2.0
"""OpenAI's and vLLM's range of presence_penalty and frequency_penalty: [-2, 2]."""


MAX_STRUCTURED_OUTPUT_CHARS = 64 * 1024
"""At most this many characters in a request's structured-output constraint (schema text, regex,
grammar, or its choices together): it travels with the request to every stage and is compiled
against the whole vocabulary by prefill and by decode."""

MAX_CHOICE_STRINGS = 1024
"""At most this many strings in a structured output's `choice`."""


@dataclass(frozen=True)
class StructuredOutputs:
    """vLLM's structured outputs (its `StructuredOutputsParams`): exactly one constraint. The
    answer's tokens are only those the constraint allows next, and the answer ends ("stop") when
    the constraint is complete; `epd.model_runtime.structured_output` compiles it with xgrammar."""

    json_schema: str = ""
    """A JSON Schema as JSON text (vLLM's `json`, OpenAI's response_format json_schema.schema)."""
    json_object: bool = False
    """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
    regex: str = ""
    """A regular expression the whole answer matches."""
    choice: tuple[str, ...] = ()
    """The answer is exactly one of these."""
    grammar: str = ""
    """An EBNF grammar in xgrammar's form (GBNF-like, start symbol `root`)."""
    disable_any_whitespace: bool = False
    """vLLM's: JSON without free whitespace between its tokens (off: any whitespace is allowed)."""
    after_reasoning: bool = False
    """The constraint starts after the model's end-of-reasoning token (`</think>`), as vLLM's does
    under a reasoning parser (its default, `enable_in_reasoning` false): the model thinks freely,
    and the tokens after its `</think>` keep to the constraint; from the first token when the
    prompt already closed the thinking block. Set by the front door when it runs
    `--reasoning-parser` (`epd.model_runtime.grammar_state.reasoning_ended`)."""

    @property
    def kind(self) -> str:
        """The one constraint set: "json_schema", "json_object", "regex", "choice" or "grammar"
        (ValueError for none or several)."""
        kinds = [
            name
            for name, value in (
                ("json_schema", self.json_schema),
                ("json_object", self.json_object),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value
        ]
        if len(kinds) != 1:
            raise ValueError(
                "structured outputs take exactly one constraint of json (a schema), json_object, regex, "
                f"choice and grammar; got {', '.join(kinds) if kinds else 'none'}"
            )
        return kinds[0]

    def validate(self) -> None:
        """ValueError naming what to change: one constraint, within the size bounds (whether it
        compiles is checked where it is compiled: `structured_output.GrammarCompiler`)."""
        kind = self.kind
        if kind == "choice":
            if len(self.choice) > MAX_CHOICE_STRINGS:
                raise ValueError(
                    f"choice has {len(self.choice)} strings; at most {MAX_CHOICE_STRINGS} are accepted"
                )
            if any(not c for c in self.choice):
                raise ValueError("choice cannot contain an empty string")
        size = len(self.json_schema) + len(self.regex) + len(self.grammar) + sum(len(c) for c in self.choice)
        if size > MAX_STRUCTURED_OUTPUT_CHARS:
            raise ValueError(
                f"the structured-output {kind} has {size} characters; at most "
                f"{MAX_STRUCTURED_OUTPUT_CHARS} are accepted"
            )


class SamplingFailed(ValueError):
    """This request's scores for its next token are not finite numbers (NaN or infinity), so no
    token can be drawn from them: the request's own failure (its settings or its input), not the
    server's. Mapped to INVALID_ARGUMENT (`epd.transport.errors`); the stage serves on."""


class ConstraintBusy(Exception):
    """A structured-output spec that needs compiling came while this server's compiles that ran past
    their deadline (`structured_output.MAX_ABANDONED_COMPILES`, which cannot be stopped) still
    run: retry later. Mapped to RESOURCE_EXHAUSTED with a retry hint (`epd.transport.errors`), as
    a full stage queue is (HTTP 429 + Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class InvalidConstraint(ValueError):
    """A request's structured-output constraint cannot be used: it does not compile against the
    model's vocabulary, the model's family exposes no tokenizer for it, or xgrammar is not
    installed. The request's to change (or the operator's to install); mapped to INVALID_ARGUMENT
    (`epd.transport.errors`), as the front door's own checks of the request are."""


def sampling_failed(config: GenerationConfig) -> SamplingFailed:
    """The error for scores that cannot be sampled, with what to change: a repetition_penalty far
    below 1 is the one setting that sends finite scores to infinity (a positive score is divided by
    it), so it is named when it is on."""
    message = (
        "the model's scores for this request's next token are not finite numbers (NaN or infinity), so "
        f"no token can be sampled from them at temperature {config.temperature:g}"
    )
    if config.repetition_penalty < 1.0:
        return SamplingFailed(
            f"{message}: repetition_penalty {config.repetition_penalty:g} divides the positive scores past "
            "the largest float; use a repetition_penalty nearer 1 (1 is off)"
        )
    return SamplingFailed(
        f"{message}: the model's numbers overflowed on this request's input; ask about other media or text"
    )


def no_token_left(config: GenerationConfig) -> SamplingFailed:
    """The error for a step at which the request's own masks leave no token: argmax would return
    token 0, which the request never allowed, and a draw would have nothing to draw from."""
    names = [
        name for name in ("allowed_token_ids", "bad_words", "min_tokens") if getattr(config, name)
    ]  # fmt: skip
    return SamplingFailed(
        f"{', '.join(names)} leave no token this request may generate next; allow more tokens, ban "
        "fewer words" + (" or ask for fewer min_tokens" if config.min_tokens else "")
    )


def check_stop_strings(stop: tuple[str, ...] | list[str]) -> None:
    """ValueError naming the bound a request's stop strings pass."""
    if any(not s for s in stop):  # vLLM's refusal too: "" would end every answer at once, or be ignored
        raise ValueError("stop cannot contain an empty string; leave it out (no stop strings: omit stop)")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are accepted")
    if (longest := max((len(s) for s in stop), default=0)) > MAX_STOP_CHARS:
        raise ValueError(f"a stop string has {longest} characters; at most {MAX_STOP_CHARS} are accepted")


def check_bad_words(words: tuple[str, ...] | list[str]) -> None:
    """ValueError naming the bound a request's bad_words pass. A word of spaces alone is refused
    here, as vLLM refuses it (it tokenises to nothing once its leading spaces are stripped)."""
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words has {len(words)} words; at most {MAX_BAD_WORDS} are accepted")
    if (longest := max((len(w) for w in words), default=0)) > MAX_BAD_WORD_CHARS:
        raise ValueError(f"a bad word has {longest} characters; at most {MAX_BAD_WORD_CHARS} are accepted")
    if any(not w.lstrip() for w in words):
        raise ValueError(
            "bad_words cannot contain an empty string or one of spaces alone; leave it out "
            "(no bad words: omit bad_words)"
        )


def check_logprobs(
    logprobs: int | None,
    max_logprobs: int | None,
    bound: str = "--max-logprobs",
    field: str = "logprobs (chat completions' top_logprobs)",
) -> None:
    """ValueError unless `logprobs` (None: not asked) is 0 to `max_logprobs` (None: unbounded),
    the message naming the `field` and where the bound comes from."""
    if logprobs is None:
        return
    if logprobs < 0 or (max_logprobs is not None and logprobs > max_logprobs):
        allowed = "0 or more" if max_logprobs is None else f"between 0 and {max_logprobs} ({bound})"
        raise ValueError(f"{field} must be {allowed}, got {logprobs}")


@dataclass(frozen=True)
class GenerationConfig:
    """How tokens are generated. The defaults are greedy and match `generate(do_sample=False)`."""

    max_new_tokens: int = 32
    """Most tokens to generate, the first token (made by prefill) included."""
    temperature: float = 0.0
    """0 is greedy, and so is anything below `GREEDY_BELOW_TEMPERATURE`; above it samples from
    softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 is off."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 is off."""
    seed: int | None = None
    """Seed of the sampler (prefill's for the first token, decode's for the rest: two streams of
    it, `stream_seed`); None is a fresh random draw for each request, as OpenAI's and vLLM's
    (the front door draws it once, `with_drawn_seed`, so a repeated prefill draws the same)."""
    stop: tuple[str, ...] = field(default_factory=tuple)
    """Stop when the text ends with one of these strings (the string is cut from the answer)."""
    ignore_eos: bool = False
    """Keep going past end-of-sequence (benchmarks)."""
    repetition_penalty: float = 1.0
    """vLLM's: > 1 discourages, < 1 encourages every token of the prompt and of the output so far
    (a positive logit is divided by it, a negative one multiplied); 1 is off."""
    presence_penalty: float = 0.0
    """OpenAI's, in [-2, 2]: subtracted from the logit of every token the output holds; 0 is off."""
    frequency_penalty: float = 0.0
    """OpenAI's, in [-2, 2]: subtracted once per occurrence in the output so far; 0 is off."""
    min_p: float = 0.0
    """vLLM's, in [0, 1]: after temperature, drop tokens whose probability is below min_p times the
    top token's; 0 is off, and greedy decoding ignores it."""
    min_tokens: int = 0
    """vLLM's: end-of-sequence and `stop_token_ids` cannot be generated, and stop strings are not
    looked for, before this many tokens are out; at most max_new_tokens. 0 is off."""
    allowed_token_ids: tuple[int, ...] = ()
    """vLLM's: only these tokens may be generated (every other logit is -inf before anything else
    runs); () is off (the HTTP API refuses an empty list, as vLLM's). Token ids are checked against
    the vocabulary by the stages that load it."""
    bad_words: tuple[str, ...] = ()
    """vLLM's: words never generated. Each is tokenised with and without a leading space
    (`epd.model_runtime.bad_words`); a word of one token is banned outright, a longer one has its
    last token banned when the answer's last tokens are the rest of the word."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """OpenAI's, as (token id, bias) pairs, bias in [-100, 100]: added to the token's logit after
    allowed_token_ids and bad_words (vLLM's order; a banned token stays banned). Token ids are
    checked against the vocabulary by the stages that load it."""
    stop_token_ids: tuple[int, ...] = ()
    """vLLM's: stop when one of these is generated (finish reason "stop"; its text is left out
    unless include_stop_str_in_output)."""
    include_stop_str_in_output: bool = False
    """vLLM's: keep the stop string (or stop token's text) that ended the answer in it."""
    skip_special_tokens: bool = True
    """vLLM's: the answer's text leaves out the tokenizer's special tokens (`<|im_end|>`, an
    added `<think>`); False keeps them, as `tokenizer.decode(ids, skip_special_tokens=False)`."""
    spaces_between_special_tokens: bool = True
    """vLLM's: passed to `tokenizer.decode` with the above. A slow (Python) tokenizer puts a space
    between special tokens and the text around them when it is true; a fast one (every family epd
    serves: byte-level BPE) decodes alike either way, as transformers' and vLLM's do."""
    n: int = 1
    """OpenAI's and vLLM's: how many choices to sample from the one prompt (1 to `MAX_CHOICES`). The
    media is encoded and the prompt prefilled once; choice i samples its first token (at prefill)
    and the rest (at decode) with its own sampler, seeded `choice_seed(seed, i)`
    (`for_choice`)."""
    fit_max_new_tokens: bool = False
    """`max_new_tokens` is a ceiling, not a demand: prefill lowers it to what the served context
    leaves after the prompt instead of refusing the request. The front door sets it when the
    client left max_tokens unset (vLLM's default max_tokens is max_model_len minus the prompt)."""
    logprobs: int | None = None
    """Return each generated token's log-probability and the `logprobs` most likely tokens' at its
    position (OpenAI's chat `top_logprobs` with `logprobs: true`, its legacy completions'
    `logprobs`); 0: the sampled token's alone; None: none (`epd.model_runtime.logprobs`)."""
    structured_outputs: StructuredOutputs | None = None
    """vLLM's structured outputs: a constraint every token of the answer keeps to (None: none)."""
    prompt_logprobs: int | None = None
    """vLLM's `prompt_logprobs`: each prompt token's log-probability given the tokens before it, its
    rank and the k most likely tokens there (the first token has none); None: not asked. Bounded
    as `logprobs`. Prefill computes the whole prompt then (no prefix-cache reuse)."""
    priority: int = 0
    """vLLM's: under `--scheduling-policy priority` each stage serves its waiting requests lowest
    value first, ties in arrival order; under fcfs (the default) only 0 is taken
    (`epd.stages.scheduling`). Not a sampling setting, but it travels with them to every stage."""
    return_prompt_token_ids: bool = False
    """vLLM's `return_token_ids`, its prompt half: prefill sends back the prompt's token ids
    (`PrefillHandle.prompt_token_ids`), which the gateway, holding no tokenizer, has no other way to
    know. Not a sampling setting either: prefill's alone."""

    def validate(
        self, max_new_tokens_limit: int, vocab_size: int | None = None, max_logprobs: int | None = None
    ) -> None:
        """ValueError naming the field and its accepted range. `vocab_size`: also check the token
        ids of logit_bias, stop_token_ids and allowed_token_ids against it (None: the front door,
        without a model). `max_logprobs`: the server's --max-logprobs (None: no bound but the
        vocabulary's, the decoder's check: prefill and the front door hold requests to the
        configured one, and to the vocabulary too, which --max-logprobs may pass: a request the
        decoder would refuse must not get its first token from prefill)."""
        check_logprobs(self.logprobs, max_logprobs)
        check_logprobs(self.logprobs, vocab_size, "this model's vocabulary size")
        check_logprobs(self.prompt_logprobs, max_logprobs, field="prompt_logprobs")
        check_logprobs(self.prompt_logprobs, vocab_size, "this model's vocabulary size", "prompt_logprobs")
        if not 1 <= self.max_new_tokens <= max_new_tokens_limit:
            raise ValueError(
                f"max_new_tokens must be between 1 and {max_new_tokens_limit} (the OpenAI API's max_tokens "
                f"or max_completion_tokens), got {self.max_new_tokens}"
            )
        check_stop_strings(self.stop)
        # A NaN temperature passes `< 0` (every comparison with NaN is false).
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(
                f"n must be between 1 and {MAX_CHOICES} (choices per request), got {self.n}: "
                "send more requests for more choices"
            )
        self._validate_processors(vocab_size)
        if self.structured_outputs is not None:
            self.structured_outputs.validate()

    def _validate_processors(self, vocab_size: int | None) -> None:
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1 is off), got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:  # NaN fails both
                raise ValueError(
                    f"{name} must be in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}] (0 is off), got {value}"
                )
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 is off), got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(
                # An HTTP client knows the limit as max_tokens, and may not have sent one at all.
                f"min_tokens must be between 0 and max_new_tokens ({self.max_new_tokens}: the OpenAI API's "
                f"max_tokens or max_completion_tokens, the server's default when neither is sent), "
                f"got {self.min_tokens}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(
                f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are accepted"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids has {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are accepted"
            )
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
            raise ValueError(
                f"allowed_token_ids has {len(self.allowed_token_ids)} ids; at most {MAX_ALLOWED_TOKEN_IDS} "
                "are accepted (to keep a few tokens out, use bad_words or a logit_bias of -100)"
            )
        check_bad_words(self.bad_words)
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token id twice")
        for token, bias in self.logit_bias:
            if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias of token {token} must be in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}], got {bias}"
                )
        for field_name, ids in (
            ("logit_bias", [t for t, _ in self.logit_bias]),
            ("stop_token_ids", self.stop_token_ids),
            ("allowed_token_ids", self.allowed_token_ids),
        ):
            bad = next((t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
            if bad is not None:
                upper = (
                    f"{vocab_size - 1} (this model's vocabulary)"
                    if vocab_size is not None
                    else "the vocabulary's last id"
                )
                raise ValueError(f"{field_name}: token id {bad} is outside 0 to {upper}")

    @property
    def processes_logits(self) -> bool:
        """Whether a logits processor runs before the token is chosen (`LogitsProcessors`); off by
        default, so the default step is the plain argmax or draw."""
        sampled = self.temperature >= GREEDY_BELOW_TEMPERATURE
        return bool(
            self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
            or self.logit_bias
            or self.allowed_token_ids
            or self.bad_words
            or self.min_tokens
            or (self.min_p and sampled)
        )

    def with_drawn_seed(self) -> GenerationConfig:
        """This config with a random seed in place of None, when it samples (drawn once where a
        request comes in: prefill and decode, and a prefill repeated on another replica, then
        sample from the same seed)."""
        if self.seed is not None or self.temperature < GREEDY_BELOW_TEMPERATURE:
            return self
        return replace(self, seed=secrets.randbits(63))

    def for_choice(self, index: int) -> GenerationConfig:
        """The config of choice `index` of this request: one choice (n=1), seeded
        `choice_seed(seed, index)`, so that it draws what a request with that seed alone draws."""
        seed = None if self.seed is None else choice_seed(self.seed, index)
        return replace(self, n=1, seed=seed)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded `seed`: `seed + index`, as vLLM derives its
    choices' seeds, wrapped into the signed 64-bit range a seed takes (so choice 1 of seed
    2**63 - 1 is -2**63). Choice 0 keeps the request's seed."""
    return (seed + index + INT64_SPAN // 2) % INT64_SPAN - INT64_SPAN // 2


def stream_seed(seed: int, stream: int) -> int:
    """The generator seed of one sampling stream (0: prefill's first token, 1: decode's tokens)
    of a request's seed. torch's CPU generator (mt19937) keeps only the low 32 bits of its seed,
    so `seed + stream` made seeds 7 and 2**32 + 7 draw the same tokens, and seed s's decode stream
    seed s + 1's prefill stream; a hash of both spreads every pair over those 32 bits."""
    digest = hashlib.blake2b(f"{seed}/{stream}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


class Sampler:
    """Chooses the next token from logits. One sampler per request (it owns the RNG state, and the
    output so far that penalties and min_tokens read: every token it chooses, and those `seen`)."""

    def __init__(
        self,
        config: GenerationConfig,
        stream: int = 0,
        prompt_token_ids: Sequence[int] = (),
        eos_token_ids: Collection[int] = (),
        bad_words_token_ids: Sequence[Sequence[int]] = (),
        grammar: CompiledGrammar | None = None,
        prompt_ends_reasoning: bool = False,
    ) -> None:
        """prompt_token_ids: the prompt's (distinct) token ids, which repetition_penalty penalises
        (only read when it is on); eos_token_ids: the model's, which min_tokens holds back;
        bad_words_token_ids: the config's bad_words as the model's tokenizer gives them
        (`epd.model_runtime.bad_words.tokenize_bad_words`); grammar: the request's compiled
        structured-output constraint (None: none), whose token mask is applied before anything
        else, as vLLM applies its grammar bitmask; prompt_ends_reasoning: the prompt closed the
        thinking block, so a constraint that waits for the reasoning's end holds at once
        (`CompiledGrammar.prompt_ends_reasoning`)."""
        import torch

        self.config = config
        self._grammar = grammar.matcher(prompt_ends_reasoning) if grammar is not None else None
        self._processors: LogitsProcessors | None = None
        if config.processes_logits:
            from epd.model_runtime.logits_processors import LogitsProcessors

            self._processors = LogitsProcessors(config, prompt_token_ids, eos_token_ids, bad_words_token_ids)
        self._generator: torch.Generator | None = None
        if config.temperature >= GREEDY_BELOW_TEMPERATURE:
            self._generator = torch.Generator(device="cpu")
            if config.seed is None:  # a stage called without the front door's draw
                self._generator.seed()
            else:
                self._generator.manual_seed(stream_seed(config.seed, stream))

    @property
    def constrained(self) -> bool:
        """A structured-output constraint masks this request's logits."""
        return self._grammar is not None

    def allowed(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] as the constraint leaves them before this step (every token it does not
        allow next at -inf, on a copy): what vLLM's logprobs are computed from, as it applies a
        grammar's bitmask before its sampler; the logits themselves without a constraint."""
        return logits if self._grammar is None else self._grammar.mask(logits.float())

    def seen(self, token_id: int) -> None:
        """A token of the output that this sampler did not choose (decode's sampler: the first
        token, which prefill sampled)."""
        if self._processors is not None:
            self._processors.seen(token_id)
        if self._grammar is not None:
            self._grammar.accept(token_id, chosen_here=False)

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [vocab] (any float dtype) -> token id."""
        import torch

        logits = logits.float()
        grammar = self._grammar
        if grammar is not None:  # first, on a copy: the tokens the constraint allows next
            logits = grammar.mask(logits)
        processors = self._processors
        if processors is None:  # the default: nothing else runs
            token = int(torch.argmax(logits)) if self._generator is None else self._draw(logits)
            if grammar is not None:
                grammar.accept(token)
            return token
        # vLLM v1's order: allowed_token_ids and bad_words, then logit bias and min_tokens, then the
        # penalties, then greedy or the draw (min_p after temperature, then top-k and top-p).
        logits = processors.before_sampling(logits)
        masking = grammar is not None and grammar.masking
        if (processors.masks_tokens or masking) and float(logits.max()) == float("-inf"):
            # no token survives the masks: argmax would return token 0, which none of them allowed
            raise grammar.nothing_allowed() if grammar is not None and masking else no_token_left(self.config)
        token = int(torch.argmax(logits)) if self._generator is None else self._draw(logits)
        processors.seen(token)
        if grammar is not None:
            grammar.accept(token)
        return token

    def _draw(self, logits: torch.Tensor) -> int:
        """A token drawn from logits [vocab] float32 at the config's temperature, min_p, top-k, top-p."""
        import torch

        largest = logits.max()
        # NaN (max propagates it) or infinity: the shift below would make NaN of every score, and
        # torch.multinomial would raise a RuntimeError that reads as the server's failure.
        if not math.isfinite(float(largest)):
            if self._grammar is not None and self._grammar.masking and float(largest) == float("-inf"):
                raise self._grammar.nothing_allowed()  # the constraint and min_tokens leave nothing
            raise sampling_failed(self.config)
        # Shifted first, so the largest is 0 and nothing overflows whatever the temperature.
        logits = (logits - largest) / self.config.temperature
        if self._processors is not None:
            logits = self._processors.min_p(logits)
        if self.config.top_k > 0:
            k = min(self.config.top_k, logits.shape[-1])
            kth = torch.topk(logits, k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.config.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep tokens until the mass before them reaches top_p (the first is always kept).
            drop = torch.cumsum(sorted_probs, 0) - sorted_probs >= self.config.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        token = torch.multinomial(probs.cpu(), 1, generator=self._generator)
        return int(token)
