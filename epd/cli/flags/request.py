"""What one request asks for, as `epd ask`'s flags: generation (`GenerationConfig`: sampling,
penalties, stops, logprobs), structured outputs (`StructuredOutputs`) and token dropping
(`PruningConfig`)."""

from __future__ import annotations

import argparse

from epd.cli.flags.arg_types import json_schema_file, knob, logit_bias, text_file


def add_generation_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation")
    # Unset (None), the sampling flags take the defaults of the model's generation_config.json
    # (--generation-config), as a request's unset fields do: vLLM's `LLM.generate` and its server alike.
    unset = " (default: the model's generation_config.json, see --generation-config; else {})"
    g.add_argument("--max-new-tokens", type=int, default=None, help="tokens at most" + unset.format(32))
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy" + unset.format(0))
    g.add_argument(
        "--top-p", type=float, default=None, help="nucleus sampling's mass" + unset.format("1, off")
    )
    g.add_argument(
        "--top-k", type=int, default=None, help="the k most likely tokens" + unset.format("0, off")
    )
    g.add_argument("--seed", type=int, default=None, help="sampling's seed (default: a random one)")
    g.add_argument(
        "--priority",
        type=int,
        default=0,
        help="vLLM's request priority, lower served earlier, for a gateway whose stages run "
        "--scheduling-policy priority (with fcfs, anything but 0 is refused); embedded, the one "
        "request per turn has nothing to go ahead of (default 0)",
    )
    g.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="after the answer, a table of each generated token's log-probability and the K most "
        "likely tokens' at its position (0: the token's own alone; at most the server's "
        "--max-logprobs, 20 by default; raw model distribution, vLLM's default)",
    )
    g.add_argument(
        "--prompt-logprobs",
        type=int,
        default=None,
        metavar="K",
        help="after the answer, a table of each prompt token's log-probability given the tokens "
        "before it, its rank and the K most likely tokens' there (vLLM's prompt_logprobs; bounded "
        "as --logprobs; not with --pruning)",
    )
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="vLLM's, over the prompt's and the output's tokens: > 1 discourages repeats"
        + unset.format("1, off"),
    )
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (0 = off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (0 = off)")
    g.add_argument(
        "--min-p",
        type=float,
        default=None,
        help="when sampling, drop tokens below MIN_P x the top token's probability" + unset.format("0, off"),
    )
    g.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        help="no end-of-sequence, stop token or stop string before this many tokens (0 = off)",
    )
    g.add_argument(
        "--logit-bias",
        type=logit_bias,
        action="append",
        default=[],
        metavar="TOKEN_ID=BIAS",
        help="add BIAS (in [-100, 100]) to a token's logit (repeatable)",
    )
    g.add_argument(
        "--stop-token-id",
        type=int,
        action="append",
        default=[],
        metavar="TOKEN_ID",
        help="stop when this token is generated (repeatable)",
    )
    g.add_argument(
        "--include-stop-str-in-output",
        action="store_true",
        help="keep the stop string or stop token that ended the answer in it",
    )
    g.add_argument(
        "--allowed-token-id",
        type=int,
        action="append",
        default=[],
        metavar="TOKEN_ID",
        help="generate only tokens given with this flag (repeatable; default: every token)",
    )
    g.add_argument(
        "--bad-word",
        action="append",
        default=[],
        metavar="WORD",
        help="never generate this word, with or without a leading space (repeatable)",
    )
    # Structured outputs (vLLM's; xgrammar: pip install 'epd[structured]'): one constraint at most.
    c = g.add_mutually_exclusive_group()
    c.add_argument(
        "--json-schema",
        type=json_schema_file,
        default=None,
        metavar="FILE",
        help="answer with JSON that FILE's JSON Schema accepts (structured outputs)",
    )
    c.add_argument(
        "--json-object", action="store_true", help="answer with a JSON object (structured outputs)"
    )
    c.add_argument("--regex", default=None, help="answer with text REGEX matches whole (structured outputs)")
    c.add_argument(
        "--choice",
        action="append",
        default=None,
        help="answer with exactly one of these strings (repeatable; structured outputs)",
    )
    c.add_argument(
        "--grammar",
        type=text_file,
        default=None,
        metavar="FILE",
        help="answer with text FILE's EBNF grammar accepts (xgrammar's form, start symbol root)",
    )


def add_pruning_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("token dropping and KV compression (off by default)")
    g.add_argument("--pruning", default="off", help="preset: off, light, budget25, balanced, aggressive")
    g.add_argument(
        "--pruning-knob",
        type=knob,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override one knob of token_pruning.PruningConfig (repeatable)",
    )
