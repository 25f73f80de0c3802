"""The `epd` command's flags, one module per component they configure, and their value types
(`arg_types`). `epd/cli/configs.py` builds each component's typed config from them."""
