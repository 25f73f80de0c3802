"""The `epd` command line, one module per command: `root` (the commands, `epd bench` and `epd
health`), `ask`, `serve` (the stack and its roles)."""
