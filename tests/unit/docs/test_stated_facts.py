"""What the docs state about the code is the code's, so that a change to the one fails here until
the other follows: README's set-up matches the scripts and pins it describes, its default ports the
services', its account of the default model that model's card, its lists of result fields and of
the gateway flags `epd serve` passes on the code's; the shipped files say how to make them again;
every list of the served families names each one the loader serves; and the figures and lists of
docs/architecture.md and docs/security.md (token cache format version, the fuzzed RPCs, the
gateway's memory at the prompt logprobs bound, the error statuses, the routes and paths guarded)
are the code's."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shlex

import pytest

from tests.unit.docs.doc_reading import (
    FLAG,
    VLLM_GUIDE,
    epd_parsers,
    flags_of,
    markdown_table,
    proto_messages_and_services,
    read,
    spans,
)


def test_the_readmes_set_up_is_the_scripts_and_the_pins():
    """README's two commands are the scripts CI runs, and the versions it says they install are
    requirements/ci.txt's pins."""
    text = " ".join(read("README.md").split())
    for script in ("scripts/setup.sh", "scripts/test.sh"):
        assert f"bash {script}" in text, f"README.md no longer gives `bash {script}`"
    assert "exec bash scripts/test.sh" in read(".ci/run") and "bash scripts/setup.sh" in read(
        "scripts/test.sh"
    )
    assert "-r requirements/ci.txt -e ." in read("scripts/setup.sh"), (
        "README says setup.sh installs the pins, editable"
    )
    pins = dict(re.findall(r"^([\w-]+)==(\S+)", read("requirements/ci.txt"), re.M))
    stated = re.search(
        r"`requirements/ci\.txt` \(torch (\S+) \+ torchvision (\S+), transformers (\S+?);", text
    )
    assert stated, (
        "README.md no longer says which versions requirements/ci.txt pins where this test reads them"
    )
    assert stated.groups() == (pins["torch"], pins["torchvision"], pins["transformers"])


def test_the_shipped_files_say_how_to_make_them_again():
    """The demo model's card and the sample's JSON give the command that made them: a module that
    exists under that name (they named `train.train_default_model` and `synth.sample` after those
    moved under epd/), and, for the model, flags the trainer takes."""
    from epd.train.train_default_model import parse_args

    def module_exists(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package that is not there
            return False

    card = json.loads(read("models/epd-tiny-videoqa/epd_model_card.json"))
    sample = json.loads(read("samples/sample.json"))
    for command in (card["command"], card["data"]["generator"], sample["made_by"]):
        words = shlex.split(command)
        module = words[words.index("-m") + 1]
        assert module_exists(module), f"{command!r}: no module {module}"
    assert module_exists(card["built_by"]), card["built_by"]
    words = shlex.split(card["command"])
    parse_args(words[words.index("-m") + 2 :])  # argparse exits on a flag the trainer no longer has


def quoted_names(text: str) -> list[str]:
    """The backticked names of a list as README.md writes one ("`a`, `b`, and `c`")."""
    return re.findall(r"`(\w+)`", text)


def test_the_readmes_lists_of_result_fields_are_the_sdks_and_the_http_apis():
    """README.md lists the fields of `epd ask --json` (AskResult.to_dict()) and of the HTTP API's
    `epd` object by name: those lists are the names the code writes, no more, no fewer."""
    from epd.client.types import result_from_proto
    from epd.gateway.ask_types import AskSummary
    from epd.gateway.servicer import summary_to_proto
    from epd.gateway.summary_fields import epd_details

    summary = AskSummary(
        request_id="r",
        answer="a",
        token_ids=[1],
        finish_reason="stop",
        num_frames=2,
        num_visual_tokens=4,
        num_prompt_tokens=9,
        timings_ms={"ttft": 1.0, "total": 2.0},
        kv_num_bytes=0,
        encoder_cache_hit=False,
        media_sha256="",
        frame_timestamps_s=[0.0, 0.5],
    )
    text = " ".join(read("README.md").split())
    ask_json = re.search(r"`--json` prints the SDK's result as one object (.*?) \(see \[Stages", text)
    http_epd = re.search(
        r"carries an `epd` object: the whole summary under the SDK's names (.*?)\. Caches", text
    )
    assert ask_json and http_epd, "README.md no longer lists the result's fields where this test reads them"
    sdk_names = set(quoted_names(ask_json.group(1))) - {"epd", "AskResult"}
    assert sdk_names == set(result_from_proto(summary_to_proto(summary), []).to_dict())
    assert set(quoted_names(http_epd.group(1))) == set(epd_details(summary)) | {"kept_tokens"}


def test_the_readmes_accuracy_of_the_default_model_is_its_cards():
    """README.md's size and accuracy of models/epd-tiny-videoqa (overall and per question type) are
    what its card records: a retrained model must not leave the old numbers behind."""
    card = json.loads(read("models/epd-tiny-videoqa/epd_model_card.json"))
    text = " ".join(read("README.md").split())
    size = re.search(r"`models/epd-tiny-videoqa`: a ([\d.]+)M-parameter", text)
    overall = re.search(
        r"it answers \*\*([\d.]+)%\*\* of its test questions correctly \((.*?)`epd bench quality`\)", text
    )
    assert size and overall, (
        "README.md no longer gives the default model's size and accuracy where this test reads them"
    )
    assert float(size.group(1)) == round(card["num_parameters"] / 1e6, 1)
    assert float(overall.group(1)) == round(100 * card["accuracy"]["test"], 1)
    types = {
        "what happens at the end": "end",
        "which appears first": "first",
        "counts": "count",
        "directions": "direction",
        "colours": "colour",
        "shapes": "shape",
        "exits": "leaves",
        "entries": "enters",
        "which appears last": "last",
    }
    stated = {}
    for percent, names in re.findall(r"(\d+)% ([^,;]+)", overall.group(2)):
        for name in re.split(r" and ", names.strip().strip('"')):
            stated[types[name.strip('"')]] = int(percent)
    by_type = card["accuracy"]["test_by_type"]
    assert stated == {t: int(100 * by_type[t] + 0.5) for t in by_type}, (
        "README's per-type accuracy is not the card's"
    )


def test_the_token_cache_format_version_is_the_codes():
    """docs/architecture.md gives the token cache key's format version (it said 3 after the key
    became 4): a bump must update the paragraph that says what the key holds."""
    from epd.encoder_svc import token_cache

    stated = re.search(
        r"\*\*Token cache\*\* \(`encoder_svc/token_cache\.py`\): key = format version \((\d+)\)",
        read("docs/architecture.md"),
    )
    assert stated, (
        "docs/architecture.md no longer gives the token cache key's format version where this test reads it"
    )
    assert int(stated.group(1)) == token_cache._KEY_VERSION


FAMILY_NAMES = {
    "qwen2_vl": "Qwen2-VL",
    "qwen2_5_vl": "Qwen2.5-VL",
    "qwen3_vl": "Qwen3-VL",
    "qwen3_vl_moe": "Qwen3-VL",
    "qwen3_5": "Qwen3.5",
    "llava_onevision": "LLaVA-OneVision",
    "glm4v": "GLM-4.1V",
    "internvl": "InternVL",
}
"""The name each list of the served families gives a model type the loader serves."""


def test_every_list_of_the_served_families_names_each():
    """README.md's opening and its table, from-vllm.md's "Supported models", every model service's
    and `epd ask`'s --model help and the loader's refusal name every family the loader serves (a
    family added in one place was missing from the others)."""
    from epd.model_runtime.loader import SUPPORTED
    from tests.families import FAMILIES

    assert sorted(FAMILY_NAMES) == sorted(FAMILIES), "name a new family here, then in every list below"
    readme = read("README.md")
    guide = " ".join(read(VLLM_GUIDE).split())
    supported = re.search(r"\*\*Supported models\*\*(.*?)(?: - \*\*|$)", guide)
    assert supported, f"{VLLM_GUIDE} no longer lists the supported models where this test reads them"
    parsers = epd_parsers()
    lists = {
        "README.md's opening": " ".join(readme.split("\n## ", 1)[0].split()),
        f"{VLLM_GUIDE}'s Supported models": supported.group(1),
        "the loader's SUPPORTED": SUPPORTED,
    }
    for command in ("epd ask", "epd serve", "epd serve encoder", "epd serve prefill", "epd serve decode"):
        (model,) = [a for a in parsers[command]._actions if "--model" in a.option_strings]
        lists[f"{command} --model's help"] = model.help or ""
    missing = [
        f"{where}: {name}"
        for where, text in lists.items()
        for name in FAMILY_NAMES.values()
        if name not in text
    ]
    table = {spans(row[1])[0] for row in markdown_table(readme, "family")}
    assert not missing and table == set(FAMILIES), (missing, sorted(table ^ set(FAMILIES)))


def test_the_readmes_ports_are_the_services_defaults():
    """ "Default ports: gateway 50050, ..." and the replicas' "port + 10·i" are what the parsers use."""
    from epd.cli.parsers.serve import REPLICA_PORT_STEP
    from epd.decode_svc.config import DEFAULT_PORT as DECODE
    from epd.encoder_svc.config import DEFAULT_PORT as ENCODER
    from epd.gateway.config import DEFAULT_PORT as GATEWAY
    from epd.prefill_svc.config import DEFAULT_PORT as PREFILL

    text = " ".join(read("README.md").split())
    stated = re.search(r"Default ports: gateway (\d+), encoder (\d+), prefill (\d+), decode (\d+)\.", text)
    step = re.search(r"Replica \*i\* of a stage listens on the stage's port \+ (\d+)·\*i\*", text)
    assert stated and step, "README.md no longer gives the default ports where this test reads them"
    assert tuple(map(int, stated.groups())) == (GATEWAY, ENCODER, PREFILL, DECODE)
    assert int(step.group(1)) == REPLICA_PORT_STEP
    parsers = epd_parsers()
    assert [
        parsers[f"epd serve {role}"].get_default("port")
        for role in ("gateway", "encoder", "prefill", "decode")
    ] == [GATEWAY, ENCODER, PREFILL, DECODE]


def test_the_security_docs_fuzzing_names_every_stage_rpc():
    """docs/security.md's "Fuzzing" lists the stage RPCs the fuzz test calls directly: every RPC of
    the encoder, prefill and decode services, as the test's STAGE_CALLS has them (the list kept
    five after prefill's GetModelInfo, Tokenize, Detokenize and CompileStructuredOutputs were
    fuzzed too)."""
    _, services = proto_messages_and_services()
    stage_rpcs = services["EncoderService"] | services["PrefillService"] | services["DecodeService"]
    fuzzed = set(re.findall(r'Stub, "(\w+)"', read("tests/integration/test_fuzz_front_doors.py")))
    listed = re.search(
        r"each stage's own RPCs called directly: (.*?), with messages",
        " ".join(read("docs/security.md").split()),
    )
    assert listed, "docs/security.md no longer lists the fuzzed stage RPCs where this test reads them"
    assert fuzzed == stage_rpcs, f"the fuzz test's STAGE_CALLS: {sorted(fuzzed ^ stage_rpcs)}"
    assert set(quoted_names(listed.group(1))) == stage_rpcs, sorted(
        set(quoted_names(listed.group(1))) ^ stage_rpcs
    )


def test_the_gateways_memory_at_the_prompt_logprobs_bound_is_the_codes():
    """The gateway's memory for one answer at `MAX_PROMPT_LOGPROB_ENTRIES`, as its docstring gives it
    (measured: docs/benchmarks.md), is what every doc that gives it says (docs/security.md and
    docs/from-vllm.md kept 320 MiB, 640 bytes an entry, after the pieces were kept as protobuf)."""
    stated = re.search(
        r"about (\d+) bytes\s+an entry, so (\d+) MiB at this bound", read("epd/model_runtime/logprobs.py")
    )
    assert stated, "MAX_PROMPT_LOGPROB_ENTRIES' docstring no longer gives the memory where this test reads it"
    per_entry, total = stated.groups()
    prose = {doc: " ".join(read(doc).split()) for doc in ("README.md", "docs/security.md", VLLM_GUIDE)}
    at_bound = r"524,288 (?:entries )?\((?:what the gateway holds for one answer, |the gateway's memory for one answer, )?"
    found = {(doc, "MiB"): re.findall(at_bound + r"about (\d+) MiB", text) for doc, text in prose.items()}
    found["docs/architecture.md", "MiB"] = re.findall(
        r"so about (\d+) MiB at its peak", read("docs/architecture.md")
    )
    found["docs/security.md", "bytes an entry"] = re.findall(
        r"\(about (\d+) bytes an entry at the peak\)", prose["docs/security.md"]
    )
    assert all(found.values()), f"a doc no longer gives the figure where this test reads it: {found}"
    code = {"MiB": total, "bytes an entry": per_entry}
    wrong = {where: sizes for where, sizes in found.items() if set(sizes) != {code[where[1]]}}
    assert not wrong, f"the code says {per_entry} bytes an entry, {total} MiB: {wrong}"


def test_the_errors_section_names_every_status_the_one_mapping_gives():
    """docs/architecture.md's "Errors" says which domain errors become which gRPC status: every
    status `epd.transport.errors` maps one to is there (PERMISSION_DENIED, a media URL or path the
    server refuses, was missing)."""
    from epd.transport.errors import _CODES

    section = re.search(r"\n## Errors\n(.*?)\n## ", read("docs/architecture.md"), re.S)
    assert section, 'docs/architecture.md has no "Errors" section where this test reads it'
    named = set(re.findall(r"\b[A-Z][A-Z_]+\b", section.group(1)))
    missing = sorted({code.name for _, code in _CODES} - named)
    assert not missing, f"docs/architecture.md's Errors section does not name {missing}"


def test_the_readme_lists_every_gateway_flag_epd_serve_passes_on():
    """README.md's list of the gateway's flags `epd serve` takes too (those of `epd serve gateway`
    that no stage has) names each: it left out the API key's and the web demo's."""
    parsers = epd_parsers()
    stages = set().union(*(flags_of(parsers[f"epd serve {r}"]) for r in ("encoder", "prefill", "decode")))
    passed_on = (flags_of(parsers["epd serve"]) & flags_of(parsers["epd serve gateway"])) - stages
    text = " ".join(read("README.md").split())
    listed = re.search(r"`epd serve` \(the stack or `--colocate`, (.*?)`epd serve gateway`'s alone", text)
    assert listed, "README.md no longer lists the gateway flags `epd serve` takes where this test reads them"
    described = {
        "--http-port": "port 8000 by default",
        "--allowed-local-media-path": "the media flags below",
        "--allowed-media-domains": "the media flags below",
    }
    assert all(words in listed.group(1) for words in described.values()), listed.group(1)
    missing = sorted(passed_on - set(FLAG.findall(listed.group(1))) - set(described))
    assert not missing, f"README.md does not say `epd serve` takes {missing}"


def test_the_cross_site_post_refusal_names_every_route_it_guards():
    """docs/architecture.md says which POSTs a page of another site may not make: every route that
    reads a body (`BODY_ROUTES`), which the guard covers (it named chat and /demo/frames alone)."""
    from epd.gateway.web.routes import BODY_ROUTES

    text = " ".join(read("docs/architecture.md").split())
    stated = re.search(r"A POST to (.*?) that a browser says comes from a page of another site", text)
    assert stated, "docs/architecture.md no longer says which POSTs the browser guard refuses"
    named = set(re.findall(r"`(/[\w/]+)`", stated.group(1)))
    assert named == set(BODY_ROUTES), sorted(named ^ set(BODY_ROUTES))


@pytest.mark.parametrize("doc", ["README.md", "docs/security.md"])
def test_the_api_keys_guarded_paths_are_the_codes(doc):
    """The paths the API key guards, as a doc lists them, are `KEYED_PATH_PREFIXES`."""
    from epd.gateway.http_checks import KEYED_PATH_PREFIXES

    stated = re.search(r"under ((?:`/\w+`, )+`/\w+`)", " ".join(read(doc).split()))
    assert stated, f"{doc} no longer lists the paths the API key guards where this test reads them"
    named = set(re.findall(r"`(/\w+)`", stated.group(1)))
    assert named == set(KEYED_PATH_PREFIXES), sorted(named ^ set(KEYED_PATH_PREFIXES))


def flag_list(text: str, known: set[str]) -> set[str]:
    """The flags a list in the docs names, shorthand read out: `--encoders/--prefills/--decodes` are
    three flags, `--encoder/--prefill/--decode-port` the three `-port` flags, `--tls-*` each of `known`
    beginning `--tls-`."""
    named: set[str] = set()
    for group in re.findall(r"--[a-z][a-z0-9*-]*(?:/--[a-z][a-z0-9-]*)*", text):
        words = group.split("/")
        suffix = words[-1][words[-1].rfind("-") :]  # "-port" of --encoder/--prefill/--decode-port
        for word in words:
            if word.endswith("*"):
                named |= {flag for flag in known if flag.startswith(word[:-1])}
            else:
                named.add(word + suffix if word not in known and word + suffix in known else word)
    return named


def test_flag_lists_read_their_shorthand():
    known = {"--encoders", "--prefills", "--encoder-port", "--prefill-port", "--tls-ca", "--tls-cert", "--x"}
    assert flag_list("--encoders/--prefills, --encoder/--prefill-port and --tls-*; --x", known) == known


def test_the_readme_names_every_flag_a_mode_refuses():
    """README.md's usage block lists the flags `epd serve --colocate` and `epd ask --endpoint` refuse
    (and those the stack refuses): each flag declared for the other mode (`serves_only`) is named
    there, so a user reads before running what the usage error would say (its `--endpoint` list left
    out --generation-config and --override-generation-config once embedded `epd ask` took them)."""
    from epd.cli.flags.modes import _SERVES_ONLY, COLOCATED, EMBEDDED, STACK

    parsers = epd_parsers()
    text = " ".join(read("README.md").split()).replace(" # ", " ")
    lists = {
        (
            STACK,
            "epd serve",
        ): r"--colocate refuses \(exit 2, naming them\) the stack's flags it never reads: (.*?); the stack",
        (COLOCATED, "epd serve"): r"the stack refuses --colocate's (.*?) \(EPD_",
        (EMBEDDED, "epd ask"): r"with --endpoint, (.*?) are refused \(exit 2",
    }
    wrong = {}
    for (mode, command), pattern in lists.items():
        listed = re.search(pattern, text)
        assert listed, (
            f"README.md no longer lists the flags {command} refuses outside {mode.name} where this test reads them"
        )
        known = flags_of(parsers[command])
        declared = {
            flag
            for action in parsers[command]._actions
            if (rule := _SERVES_ONLY.get(action)) and rule.mode == mode
            for flag in action.option_strings
            if flag.startswith("--")
        }
        named = flag_list(listed.group(1), known)
        if declared - named or named - known:
            wrong[f"{command} ({mode.name} only)"] = {
                "not named": sorted(declared - named),
                "no such flag": sorted(named - known),
            }
    assert not wrong, wrong
