"""epd: disaggregated Encode / Prefill / Decode serving for video question answering.

Layers, bottom to top (tests/unit/test_layers.py keeps them so):

    epd.v1                      wire types, generated from protos/epd/v1/*.proto
    epd.video, epd.token_pruning, epd.model_runtime   libraries: decoding, token dropping, model adapters
    epd.stages                  domain types, errors and the three stage contracts (no gRPC)
    epd.{encoder,prefill,decode}_svc engines          the work of each stage (no gRPC)
    epd.transport, epd.*_svc servicers/servers        protobuf <-> domain, status codes, gRPC servers/clients
    epd.gateway, epd.client, epd.cli, epd.bench       front doors and tools

In the repository the folders the project was specified with (protos/, video/, token_pruning/,
encoder_svc/, prefill_svc/, decode_svc/) and bench/ stay at the top level; pyproject.toml maps them
under `epd.` so that an installed epd claims only this one import name.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("epd")
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"
