"""The benches' reader of a streamed OpenAI answer (bench/sse.py): the same chunks however the bytes
are cut into reads, [DONE] the end, comments and other fields skipped, an error event raised. Read
from the gateway's own pinned streams (tests/unit/gateway/streamed_answers.json, the bytes its tests
check it sends) as well as from hand-written ones."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from epd.bench.sse import SseChunks, async_stream_chunks, stream_chunks

PINNED = json.loads((Path(__file__).parent / "gateway" / "streamed_answers.json").read_text())
CHAT = {name: lines for name, lines in PINNED.items() if not name.startswith("responses")}
FAILING = {name for name in CHAT if "error" in name}


def _stream(name: str) -> bytes:
    return "\n".join(PINNED[name]).encode()


def _data_lines(name: str) -> list[dict]:
    """The chunks of a pinned stream as its lines show them, one `data:` line each, up to [DONE]."""
    data = [line.removeprefix("data: ") for line in PINNED[name] if line.startswith("data: ")]
    return [json.loads(d) for d in data[: data.index("[DONE]")]]


def _in_reads(stream: bytes, size: int) -> list[bytes]:
    return [stream[i : i + size] for i in range(0, len(stream), size)]


def _read_all(reads: list[bytes]) -> list[dict]:
    parser = SseChunks()
    return [chunk for data in reads for chunk in parser.feed(data)]


@pytest.mark.parametrize("name", sorted(set(CHAT) - FAILING))
@pytest.mark.parametrize("read_bytes", [1, 2, 7, 64, 1 << 20])
def test_a_pinned_stream_gives_its_chunks_however_it_is_read(name, read_bytes):
    stream = _stream(name)
    expected = _data_lines(name)
    assert expected and len(stream) > 64, "the check must read a real stream"
    assert _read_all(_in_reads(stream, read_bytes)) == expected
    assert list(stream_chunks(_in_reads(stream, read_bytes))) == expected


@pytest.mark.parametrize("line_end", ["\r\n", "\r"])
def test_crlf_and_cr_line_ends_even_split_between_reads(line_end):
    name = "chat, a named tool's arguments"
    # an event of two data lines first: a CRLF's \n read apart from its \r must not end it
    stream = (b'data: {"c":\ndata: 3}\n\n' + _stream(name)).replace(b"\n", line_end.encode())
    expected = [{"c": 3}, *_data_lines(name)]
    for cut in range(len(stream)):  # every place one read ends and the next begins
        assert _read_all([stream[:cut], stream[cut:]]) == expected, cut


def test_done_ends_the_answer_and_nothing_after_it_is_read():
    reads_taken = []

    def reads():
        for data in [b'data: {"choices": []}\n\n', b"data: [DONE]\n\n", b'data: {"late": 1}\n\n']:
            reads_taken.append(data)
            yield data
        raise AssertionError("read past [DONE]")

    assert list(stream_chunks(reads())) == [{"choices": []}]
    assert len(reads_taken) == 2
    parser = SseChunks()
    assert parser.feed(b"data: [DONE]\n\ndata: {}\n\n") == [] and parser.done
    assert parser.feed(b'data: {"late": 1}\n\n') == []


def test_comments_and_fields_other_than_data_carry_no_chunk():
    stream = (
        b": keep-alive\n\n"  # epd's, until the first token
        b":\n"
        b"retry: 1000\nid: 7\n\n"
        b'event: message\nid: 8\ndata: {"a": 1}\n\n'
        b'data:{"b": 2}\n\n'  # no space after the colon
        b'data: {"c":\ndata:  3}\n\n'  # one event's data over two lines, joined by a newline
        b": keep-alive\n\n"
    )
    assert _read_all(_in_reads(stream, 3)) == [{"a": 1}, {"b": 2}, {"c": 3}]


def test_an_event_is_read_at_its_blank_line_not_before():
    parser = SseChunks()
    assert parser.feed(b'data: {"a": 1}\n') == []
    assert parser.feed(b"\n") == [{"a": 1}]


@pytest.mark.parametrize("name", sorted(FAILING))
def test_the_gateways_error_event_raises_its_message(name):
    parser = SseChunks()
    with pytest.raises(RuntimeError, match=r"^error in stream: .*the answer is incomplete"):
        for data in _in_reads(_stream(name), 5):
            parser.feed(data)


@pytest.mark.parametrize(
    "event",
    [
        b'data: {"error": {"message": "boom", "type": "server_error", "code": 500}}\n\n',  # vLLM's, epd's
        b'data: {"object": "error", "message": "boom", "type": "BadRequestError", "code": 400}\n\n',
        b'event: error\ndata: {"type": "error", "code": "server_error", "message": "boom"}\n\n',
    ],
)
def test_each_form_of_error_event_raises(event):
    chunks = []
    with pytest.raises(RuntimeError, match="^error in stream: .*boom"):
        for chunk in stream_chunks([b'data: {"choices": []}\n\n', event, b"data: [DONE]\n\n"]):
            chunks.append(chunk)
    assert chunks == [{"choices": []}]


def test_data_that_is_not_an_object_is_refused():
    with pytest.raises(RuntimeError, match="not a JSON object"):
        SseChunks().feed(b"data: [1, 2]\n\n")


def test_the_asynchronous_reader_gives_the_same_chunks():
    name = "chat n=2, reasoning and tool calls, usage"

    async def reads():
        for data in _in_reads(_stream(name), 13):
            await asyncio.sleep(0)
            yield data

    async def read() -> list[dict]:
        return [chunk async for chunk in async_stream_chunks(reads())]

    assert asyncio.run(read()) == _data_lines(name)
