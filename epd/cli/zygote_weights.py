"""Imported by the stack's zygote after its other preloads and before `epd.cli.zygote_trim`, when the
launcher asked for shared weights (`Zygote(weights=...)`, `epd serve --share-weights`, the default):
the checkpoint named in $EPD_ZYGOTE_WEIGHTS is read once into the zygote's memory, and every model
service forked afterwards (a restarted replica too) takes its tensors from there instead of the
files (epd/model_runtime/shared_weights.py)."""

from epd.model_runtime.shared_weights import preload_from_env

preload_from_env()
