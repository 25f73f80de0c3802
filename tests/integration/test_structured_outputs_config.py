"""vLLM's `--structured-outputs-config` through the real stack: the gateway started with its
dotted form (`--structured-outputs-config.disable_any_whitespace true`) holds every JSON constraint,
over HTTP and gRPC, to xgrammar's grammar without free whitespace, a request's own false too (vLLM's
xgrammar backend reads the server's alone): every token is the argmax of the unsplit model's logits
under that grammar's mask (`masked_references`, xgrammar's own matcher)."""

from __future__ import annotations

from epd.client import EpdClient
from tests.integration.structured_cases import (
    CASES,
    MAX_TOKENS,
    NUM_FRAMES,
    QUESTION,
    SCHEMA,
    chat,
    masked_references,
)
from tests.reference import decode_for_test
from tests.stack import Stack


def test_the_servers_disable_any_whitespace_holds_every_json_constraint(tiny_models, media_files, tmp_path):
    model = tiny_models["qwen2_vl"]
    refs = masked_references(
        model, decode_for_test(media_files["mp4"], NUM_FRAMES), ["json_schema", "response_format"]
    )
    # the reference without whitespace ("json_schema") is not the one with it: the test can fail
    assert refs["json_schema"] != refs["response_format"]
    extra = {"gateway": ["--structured-outputs-config.disable_any_whitespace", "true"]}
    with Stack(model, tmp_path / "logs", extra=extra, http=True) as stack:
        response_format = CASES["response_format"][0]
        own_false = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": False}}
        for fields in (response_format, own_false):
            status, body = chat(stack.http_port, media_files, **fields)
            assert status == 200, body
            assert body["choices"][0]["token_ids"] == refs["json_schema"], fields
        with EpdClient(stack.gateway, timeout_s=120) as client:
            result = client.ask(media_files["mp4"], QUESTION, num_frames=NUM_FRAMES, max_new_tokens=MAX_TOKENS,
                                **response_format)  # fmt: skip
        assert result.token_ids == refs["json_schema"]
