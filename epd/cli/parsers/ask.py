"""`epd ask`'s command line: the media and the conversation, the gateway to ask (or none:
embedded), tools and TLS, and the request's flags (`epd.cli.flags.request`)."""

from __future__ import annotations

from epd.cli.flags.arg_types import env, positive_seconds
from epd.cli.flags.gateway import add_generation_config_flags, add_structured_outputs_flags
from epd.cli.flags.media import add_sampling_flags
from epd.cli.flags.model import add_model_flags, add_preload_flags
from epd.cli.flags.modes import EMBEDDED, ENDPOINT, serves_only
from epd.cli.flags.request import add_generation_flags, add_pruning_flags
from epd.cli.flags.server import add_close_timeout_flag
from epd.gateway.tool_parsers.stream import TOOL_CALL_PARSERS


def add_ask_command(sub) -> None:
    """`epd ask`: a question about a video or image, to a gateway (--endpoint) or embedded."""
    ask = sub.add_parser("ask", help="ask a question about a video or image")
    ask.add_argument(
        "video",
        nargs="?",
        default=None,
        help="path of a video (MP4, MKV, WebM, MOV, AVI) or image; with --no-video, the question",
    )
    ask.add_argument(
        "--no-video",
        action="store_true",
        help="a text-only conversation, no media: `epd ask --no-video QUESTION` (or --messages FILE "
        "without a video or image part); no encoder runs",
    )
    ask.add_argument(
        "question",
        nargs="?",
        default=None,
        help="the question (one user message: the media, then this text); with --question "
        "or --interactive, the conversation's first question",
    )
    ask.add_argument(
        "--question",
        dest="questions",
        action="append",
        default=[],
        metavar="Q",
        help="a question asked in turn (repeatable): one conversation, each turn sending the "
        "earlier questions and answers too; one answer (--json: one object) per turn",
    )
    ask.add_argument(
        "--interactive",
        action="store_true",
        help="then read questions from stdin, one a line, until EOF or an empty line, "
        "continuing the same conversation",
    )
    ask.add_argument(
        "--messages",
        default="",
        metavar="FILE",
        help="instead of QUESTION, a JSON file (- for stdin) holding the conversation: "
        '[{"role": "user", "content": [{"type": "text", "text": "..."}, {"type": "video"}]}], '
        "roles system/user/assistant, parts in your order, one video or image part (none with --no-video)",
    )
    ask.add_argument(
        "--continue-final-message",
        action="store_true",
        help="with --messages FILE ending with the assistant's message: continue that message "
        "(vLLM's continue_final_message; implies --no-add-generation-prompt); the answer is "
        "the continuation alone",
    )
    ask.add_argument(
        "--chat-template-kwargs",
        default="",
        metavar="JSON",
        help="extra variables of the model's chat template, a JSON object (vLLM's chat_template_kwargs): "
        """'{"enable_thinking": false}' closes a Qwen3.5 template's thinking block; variables the """
        "template does not read are dropped; not with --prompt",
    )
    chat_template = ask.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="embedded mode: the Jinja chat template that renders the prompt instead of the "
        "model's own, a file's path or the template's text (as `epd serve --chat-template`); not "
        "with --prompt, which has no template",
    )
    ask.add_argument(
        "--no-add-generation-prompt",
        action="store_true",
        help="with --messages FILE: render the conversation without the chat template's opening "
        "of a new answer (vLLM's add_generation_prompt false)",
    )
    ask.add_argument(
        "--prompt",
        default=None,
        metavar="TEXT",
        help="instead of VIDEO and QUESTION, a raw prompt continued as it is, without the chat template "
        "(the HTTP API's /v1/completions): tokenised as the model's tokenizer(TEXT), no media",
    )
    ask.add_argument("--endpoint", default="", help="HOST:PORT of a running gateway; default: embedded")
    ask.add_argument(
        "--timeout",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="the deadline of each question, as the OpenAI client's timeout: every stage drops its "
        "work when it passes, and epd ask says so and exits 124 (default: none embedded; with "
        "--endpoint, the SDK's 600 s, the gRPC call's deadline)",
    )
    ask.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    api_key = ask.add_argument(
        "--api-key",
        default=env("EPD_API_KEY", ""),
        help="key of a gateway started with --api-key (default: $EPD_API_KEY)",
    )
    ask.add_argument(
        "--cache-salt",
        default="",
        metavar="SALT",
        help="share cached video tokens and prompt prefixes only with requests of the same salt "
        "(vLLM's cache_salt; a gateway with API keys adds the key's own)",
    )
    g = ask.add_argument_group("tool calling (the chat API's tools and tool_choice, vLLM's meanings)")
    g.add_argument(
        "--tools",
        default="",
        metavar="FILE",
        help='a JSON file holding a list of OpenAI function tools, [{"type": "function", "function": '
        '{"name", "description", "parameters"}}], rendered into the prompt by the chat template; the '
        "answer's calls are printed (--json: content and tool_calls, as the chat API's message)",
    )
    g.add_argument(
        "--tool-choice",
        default=None,
        metavar="CHOICE",
        help="auto (the default with --tools: the calls the model writes, read by --tool-call-parser), "
        "required (forced to one call or more), a function's name (forced to its arguments) or none "
        "(the tools in the prompt, the answer unparsed)",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="how the model writes tool calls, as `epd serve --tool-call-parser` (hermes: Qwen2.5, "
        "Qwen3 and Qwen3-VL; qwen3_coder: Qwen3-Coder and Qwen3.5); needed by --tool-choice auto",
    )
    g.add_argument(
        "--no-parallel-tool-calls",
        dest="parallel_tool_calls",
        action="store_false",
        help="keep the answer's first tool call alone (the chat API's parallel_tool_calls: false, vLLM's)",
    )
    g = ask.add_argument_group("TLS (--endpoint of a gateway started with --tls-cert)")
    tls = [
        g.add_argument(
            "--tls-ca", default="", metavar="PATH", help="PEM CA that signed the gateway's certificate"
        )
    ]
    tls.append(
        g.add_argument(
            "--tls-cert",
            default="",
            metavar="PATH",
            help="PEM client certificate, for a gateway started with --tls-client-ca (mTLS)",
        )
    )
    tls.append(g.add_argument("--tls-key", default="", metavar="PATH", help="PEM private key of --tls-cert"))
    tls.append(
        g.add_argument(
            "--tls-server-name",
            default="",
            metavar="NAME",
            help="name to check the gateway's certificate against, when not the --endpoint host "
            "(TLS: with the system's CAs when no --tls-ca)",
        )
    )
    serves_only(ENDPOINT, "TLS to a gateway's port; embedded mode calls none", *tls)
    serves_only(ENDPOINT, "the key of a gateway started with --api-key; embedded mode calls none", api_key)
    serves_only(
        EMBEDDED,
        "the flags of the model epd ask loads itself; a gateway's services chose theirs when they started",
        *add_model_flags(ask),
    )
    serves_only(
        EMBEDDED,
        "the libraries preloaded where the model runs (this process, in embedded mode); a gateway's "
        "services run it, with the libraries their own epd serve --allocator / --mkl-dispatch chose",
        *add_preload_flags(ask),
    )
    serves_only(
        EMBEDDED,
        "how long the embedded pipeline's close waits for its threads; with --endpoint none run here",
        add_close_timeout_flag(ask),
    )
    serves_only(
        EMBEDDED,
        "the embedded model's prompt template; a gateway's prompts render with the template its prefill "
        "was started with (its --chat-template)",
        chat_template,
    )
    serves_only(
        EMBEDDED,
        "the defaults of the model epd ask loads itself; a gateway's come from its own --generation-config",
        *add_generation_config_flags(ask),
    )
    serves_only(
        EMBEDDED,
        "the structured-output options of the embedded front door; a gateway applies its own "
        "(its --structured-outputs-config)",
        add_structured_outputs_flags(ask),
    )
    add_generation_flags(ask)
    add_sampling_flags(ask)
    add_pruning_flags(ask)
