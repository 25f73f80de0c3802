"""Command-line words read as vLLM reads them (`flexible`: --flag_name, --config FILE.yaml, a JSON
flag's dotted keys; `keyword_help`: --help=KEYWORD), below every front door so that `epd`'s
commands (`epd.cli`) and the bench suites run as modules (`python -m epd.bench.serve`) share one
implementation; `epd.bench` may not import `epd.cli` (which imports it)."""
