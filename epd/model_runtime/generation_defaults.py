"""The model creator's sampling defaults, as vLLM's `--generation-config` and
`--override-generation-config` take them (`ModelConfig.get_diff_sampling_param`): the sampling
fields of the model's `generation_config.json` (or another folder's), with the override merged
over them, become the defaults of the fields a request leaves unset. The model's own file is read
where the model is, by prefill (`model_defaults`, reported in `ModelInfo`: the gateway alone holds
no model folder); another folder's and the override by the front door at start-up
(`generation_defaults`), which resolves every door's requests (`GenerationDefaults.resolve`, through
`Pipeline.request_defaults`). No torch, no transformers (the gateway loads neither): plain JSON."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from epd.model_runtime.sampling import GenerationConfig

log = logging.getLogger(__name__)

SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
"""vLLM's `available_params`: the keys of a generation config that become request defaults
(transformers' `max_new_tokens` is the OpenAI API's `max_tokens`); every other key (eos ids,
do_sample, ...) is not a sampling default."""

ModelDefaults = tuple[tuple[str, Any], ...]
"""A model's sampling defaults as prefill reports them (`ModelInfo.generation_defaults`): (key,
value) pairs of `SAMPLING_KEYS`, in that order."""

_INTEGER_KEYS = ("top_k", "max_new_tokens")
_INT32_MAX = 2**31 - 1

GENERATION_CONFIG_HELP = (
    "vLLM's: where the defaults of a request's unset sampling fields (repetition_penalty, temperature, "
    "top_k, top_p, min_p; max_tokens from max_new_tokens) come from. auto (default): the model's "
    "generation_config.json, as the model's creator recommends; vllm: none (greedy, max_tokens 32); "
    "DIR: that folder's generation_config.json"
)
OVERRIDE_GENERATION_CONFIG_HELP = (
    "vLLM's: a JSON object of those fields merged over --generation-config's, such as "
    '\'{"temperature": 0.5, "max_new_tokens": 128}\' (with --generation-config vllm: the only defaults)'
)


@dataclass(frozen=True)
class GenerationDefaults:
    """The front door's --generation-config and --override-generation-config: where the defaults
    of a request's unset sampling fields come from (`resolve`)."""

    source: str = "vllm"
    """The flag as given: "auto" (the model's, as prefill reports them), "vllm" (none) or a folder.
    "vllm" here (the server's own, for a front door built without the flags); the flag's default is auto."""
    given: Mapping[str, Any] = field(default_factory=dict)
    """What the flags give themselves, checked at start-up: the folder's file's fields (DIR) with
    the override's over them; under auto the override alone, which goes over the model's."""

    @property
    def from_model(self) -> bool:
        """The model's own defaults are taken: they come from prefill (`ModelInfo.generation_defaults`)."""
        return self.source == "auto"

    def resolve(self, model: ModelDefaults | None) -> GenerationConfig:
        """The server's defaults with the sampling ones taken: under auto `model`'s (the model's
        generation_config.json fields; None: not known, none) with `given` over them."""
        values = dict(model or ()) if self.from_model else {}
        return with_sampling_defaults(GenerationConfig(), {**values, **self.given})


def generation_defaults(source: str, override_json: str = "") -> GenerationDefaults:
    """The flags as the front door takes them (vLLM's `get_diff_sampling_param`): `source` "auto"
    leaves the model's to prefill (`model_defaults`), "vllm" reads nothing, anything else is a
    folder whose generation_config.json is read now; the override's fields replace the file's.
    ValueError naming the flag and what to change."""
    override = _parse_override(override_json)
    if source in ("auto", "vllm"):
        config: dict[str, Any] = {}
    else:
        path = Path(source) / "generation_config.json"
        if not path.is_file():
            raise ValueError(
                f"--generation-config {source}: no generation_config.json in that folder; pass a folder "
                "that holds one, auto (the model's) or vllm (no model defaults)"
            )
        config = _read(path, f"--generation-config {source}")
    config.update(override)
    given = _sampling_fields(config)
    for key, value in given.items():
        where = "--override-generation-config" if key in override else f"--generation-config {source}"
        _check_value(key, value, where)
    return GenerationDefaults(source, given)


def model_defaults(model: str) -> ModelDefaults | None:
    """vLLM's --generation-config auto where the model is (prefill, for `ModelInfo`): the sampling
    fields of `model`'s generation_config.json (its folder, or the hub cache), in `SAMPLING_KEYS`'
    order; () when it has none. A file that cannot be used is logged and None (not known): the
    front door then takes none and says so, and `--generation-config vllm` still serves."""
    path = model_file(model)
    if path is None:
        return ()
    try:
        defaults = _sampling_fields(_read(path, f"the model's {path}"))
        for key, value in defaults.items():
            _check_value(key, value, f"the model's {path}")
    except ValueError as exc:
        log.error("%s; its sampling defaults are not reported (fix the file)", exc)
        return None
    return tuple(defaults.items())


def _sampling_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    return {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}


def with_sampling_defaults(configured: GenerationConfig, defaults: Mapping[str, Any]) -> GenerationConfig:
    """`configured` with `defaults` (`SAMPLING_KEYS` fields: the model's, a folder's, the
    override's; `GenerationDefaults.resolve`) in place of its sampling fields:
    the defaults of every field a request leaves unset (vLLM's `default_sampling_params`; a field
    the request sets wins, max_tokens too, as vLLM's `get_max_tokens`). top_k -1 (vLLM's off) is 0,
    as on every door."""
    values = dict(defaults)
    if "top_k" in values:
        values["top_k"] = max(0, values["top_k"])
    return replace(configured, **values)


def announce(generation: GenerationConfig, source: str) -> None:
    """Logs the defaults `generation` took from `source`, once (at start-up; under auto when
    prefill's model info first gives them, `Pipeline.request_defaults`): its sampling fields
    that differ from the server's own. A warning when there are some, as vLLM's: answers change."""
    own = GenerationConfig()
    taken = {
        key: getattr(generation, key)
        for key in SAMPLING_KEYS
        if getattr(generation, key) != getattr(own, key)
    }
    if not taken:
        log.info(
            "sampling defaults: the server's (greedy, max_tokens %d); none from --generation-config %s",
            own.max_new_tokens,
            source,
        )
        return
    shown = ", ".join(f"{'max_tokens' if k == 'max_new_tokens' else k}={v}" for k, v in taken.items())
    log.warning(
        "sampling defaults of the fields a request leaves unset, from --generation-config %s: %s (the "
        "model creator's recommendation; --generation-config vllm ignores them)",
        source,
        shown,
    )


def announce_at_start(defaults: GenerationDefaults) -> None:
    """The front door's start: the defaults its flags give (`announce`); under auto they are the
    model's, logged once prefill has reported them (`Pipeline.request_defaults`)."""
    if defaults.from_model:
        log.info(
            "sampling defaults: the model's generation_config.json (--generation-config auto), as prefill "
            "reports them; logged at the first request that takes them"
        )
        return
    announce(defaults.resolve(None), defaults.source)


def model_file(model: str) -> Path | None:
    """The model's generation_config.json: in its folder, or where transformers downloaded a hub
    id; None when it has none. "default" (`--model`'s default) is $EPD_DEFAULT_MODEL when set, else
    the embedded demo model, whose generation_config.json has no sampling fields (and which is not
    built here: that imports torch)."""
    if model == "default":
        model = os.environ.get("EPD_DEFAULT_MODEL", "")
        if not model:
            return None
    path = Path(model) / "generation_config.json"
    if path.is_file():
        return path
    if Path(model).exists():
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "generation_config.json")
    except Exception:  # not a repo id, no cache: no file to read
        return None
    return Path(cached) if isinstance(cached, str) else None


def _read(path: Path, where: str) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{where}: cannot read it as JSON ({exc}); fix the file or pass --generation-config vllm"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: must hold a JSON object, got {type(config).__name__}")
    return config


def _parse_override(text: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        override = json.loads(text)
    except ValueError as exc:
        raise ValueError(
            f"--override-generation-config is not JSON ({exc}): pass an object such as "
            "'{\"temperature\": 0.5}'"
        ) from None
    if not isinstance(override, dict):
        raise ValueError(
            f"--override-generation-config must be a JSON object such as '{{\"temperature\": 0.5}}', "
            f"got {text}"
        )
    # vLLM drops other keys silently; a misspelt one would be a default never taken.
    if unknown := sorted(set(override) - set(SAMPLING_KEYS)):
        raise ValueError(
            f"--override-generation-config: {', '.join(unknown)} is not a sampling default; the keys "
            f"taken are {', '.join(SAMPLING_KEYS)}"
        )
    return override


def _check_value(key: str, value: Any, where: str) -> None:
    """ValueError for a value no request could send in that field (the HTTP API's ranges)."""
    integer = key in _INTEGER_KEYS
    number = isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)
    kind = "an integer" if integer else "a number"
    if not number or not math.isfinite(value):
        raise ValueError(f"{where}: {key} must be {kind}, got {json.dumps(value)}")
    problem = {
        "temperature": value < 0 and ">= 0 (0: greedy)",
        "top_p": not 0 < value <= 1 and "in (0, 1]",
        "top_k": value < -1 and ">= 1, or 0 or -1 for off",
        "min_p": not 0 <= value <= 1 and "in [0, 1] (0: off)",
        "repetition_penalty": value <= 0 and "> 0 (1: off)",
        "max_new_tokens": not 1 <= value <= _INT32_MAX and "between 1 and 2147483647",
    }[key]
    if problem:
        raise ValueError(f"{where}: {key} must be {problem}, got {value}")
