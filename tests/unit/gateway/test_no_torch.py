"""The gateway process starts without torch or transformers (issue #22 item 3: a short start-up),
nor numpy (~15 MB RSS in a process that holds no tensor; the web demo's thumbnails import it when
they are asked for).

Each check imports in a fresh interpreter (tests/import_log.py), so what this test session already
loaded does not hide an import; `-X importtime` names the module that pulled a forbidden one in."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.import_log import imported_packages, who_imported

FORBIDDEN = ("torch", "transformers", "numpy")


@pytest.mark.parametrize(
    "module",
    [
        "epd.gateway.server",  # `epd serve gateway`: gRPC, remote stages
        "epd.gateway.http_api",  # the HTTP API that `epd serve gateway --http-port` adds
    ],
)
def test_gateway_imports_neither_torch_nor_transformers_nor_numpy(module):
    loaded, log = imported_packages(f"import {module}")
    assert "epd" in loaded and "grpc" in loaded, "the check must see the real import"
    for name in FORBIDDEN:
        assert name not in loaded, f"importing {module} loads {name}:\n{who_imported(log, name)}"


def test_the_relay_path_builds_no_torch_tensor():
    """An encoder's result relayed to prefill and a prefill result relayed to decode, in a process
    without torch: what the gateway does per request (its remote stages' converters)."""
    code = """
import sys
from epd.stages.contracts import EncodedMedia
from epd.model_runtime.adapter import VisualMeta
from epd.transport import convert
from epd.transport.tensor_wire import TensorAssembler, WireTensor, tensor_to_chunks
from epd.v1 import prefill_pb2

embeds = WireTensor("bfloat16", (3, 2), bytes(range(12)))
media = EncodedMedia(embeds, VisualMeta("video", (1, 2, 6), 1.0, 3), 2, [0.0, 0.5], 1.0, 2.0,
                     token_index=WireTensor.from_list([0, 2, 3], "int64"),
                     key_mask=WireTensor.from_list([False, True, False], "bool"))
asm = TensorAssembler(1 << 20)
for chunk in tensor_to_chunks("visual_embeds", media.embeds, chunk_bytes=5):
    asm.add(chunk)
back = convert.encoded_media_from_proto(convert.encode_result_to_proto(media), asm.wire_tensors()["visual_embeds"])
assert back.embeds == embeds and back.token_index.tolist() == [0, 2, 3]
assert back.key_mask.tolist() == [False, True, False]
result = prefill_pb2.PrefillResult(kv_handle="h", next_position_ids=[1, 2, 3, 4], visual_entry_mask=bytes([1, 0, 1]))
handle = convert.handle_from_proto(result, relay=True)
assert convert.handle_to_proto(handle).visual_entry_mask == bytes([1, 0, 1])
assert "torch" not in sys.modules and "transformers" not in sys.modules, "the relay imported torch"
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
