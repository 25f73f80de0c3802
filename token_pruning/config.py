"""One typed settings object for every pruning stage, plus named presets.

`PruningConfig()` is all off: with it every stage is the identity and the tokens equal the
unpruned pipeline's. A request picks a preset by name and may override single knobs:

    cfg = PruningConfig.from_preset("balanced", kv_keep_ratio=0.3)
    data = cfg.to_dict()            # plain JSON-able dict for logs and cache keys
    same = PruningConfig.from_dict(data)
    knobs = cfg.to_knobs()          # {name: text} of the knobs off their defaults: the wire form
    same = PruningConfig.from_knobs(knobs)   # each text parsed by its field's declared type

Ratios are fractions of the visual tokens that *enter* a stage (1.0 keeps all). Where a stage
offers both a ratio and an absolute count/bytes budget, the absolute one wins when set.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Union, get_args, get_origin, get_type_hints

KEY_TOKEN_SCORES = ("distinct", "norm")
KV_MERGE_MODES = ("none", "averaged", "pivotal", "weighted")
KV_DTYPES: tuple[str, ...] = ("auto", "bfloat16", "float16")
KEEP_BASES: tuple[str, ...] = ("entering", "video")


@dataclass(frozen=True)
class PruningConfig:
    """Knobs of every pruning stage. Defaults: everything off."""

    # --- Encode stage -------------------------------------------------------------------------
    temporal_drop: bool = False
    """Drop merged tokens whose pixels barely changed since the last kept token at that place."""
    temporal_threshold: float = 0.05
    """Mean absolute difference (in the processor's normalised pixel units, roughly [-2, 2]) below
    which a token counts as unchanged. Compression noise on a static clip is ~0.01-0.03."""
    temporal_before_tower: bool = True
    """True: the dropped patches never enter the vision tower (saves encode time; kept tokens see
    only kept neighbours in the tower's attention). False: the tower runs on full grids and the
    tokens are dropped from its output (exact kept embeddings, no encode saving)."""
    spatial_merge: bool = False
    """Merge adjacent visual tokens of one frame group whose cosine similarity is high."""
    spatial_merge_threshold: float = 0.9
    """Cosine similarity above which two adjacent tokens are merged."""
    spatial_merge_window: int = 2
    """Side of the square windows (in merged tokens) that bound a merged group."""
    key_token_ratio: float = 0.0
    """Fraction of visual tokens flagged as key tokens, which no later stage drops (0 = none)."""
    key_token_score: str = "distinct"
    """Saliency score for key tokens: "distinct" (unlike its grid neighbours) or "norm"."""

    # --- Prefill stage ------------------------------------------------------------------------
    prefill_drop: bool = False
    """Drop visual tokens at `prefill_drop_layer` by the attention the question pays them."""
    prefill_drop_layer: int = 2
    """Decoder layer whose input is scored; layers >= this one run on the survivors only."""
    prefill_drop_layers: tuple[int, ...] = ()
    """Drop at each of these decoder layers (strictly ascending) instead of only at
    `prefill_drop_layer`. Each stage is scored afresh by the question at its own layer, and the
    survivors shrink by the same factor per stage down to the final budget at the last one: layers
    (1, 3) with ratio 0.25 keep 50% after layer 1 and 25% after layer 3. Later layers see sharper
    text-to-visual attention, so a gradual schedule drops less of what matters (PyramidDrop)."""
    prefill_keep_ratio: float = 1.0
    """Fraction of the visual tokens entering prefill that survive the (last) drop."""
    prefill_keep_count: int | None = None
    """Exact number of surviving visual tokens; overrides `prefill_keep_ratio`."""
    prefill_keep_basis: str = "entering"
    """What `prefill_keep_ratio` is a fraction of. "entering": the visual tokens that reach
    prefill. "video": the video's visual tokens before any encode stage, so the ratio is the whole
    pipeline's budget and the prefill drop removes only what the (cheap, content-aware) encode
    stages left above it, and nothing when they already went below it."""
    prefill_query_window: int = 0
    """The last this-many tokens of the text after the video score the visual tokens; 0 = all
    that text. A longer window is clamped to it (`text_guided.text_query_positions`)."""

    # --- KV compression after prefill (LOOK-M) ------------------------------------------------
    kv_compress: bool = False
    """Evict visual KV entries (per layer, per KV head) before the cache goes to Decode."""
    kv_keep_ratio: float = 1.0
    """Fraction of the visual KV entries kept in every layer and KV head."""
    kv_budget_bytes: int | None = None
    """Total KV cache size (all layers, keys + values, text included) not to exceed, in the bytes
    sent to Decode (counted in `kv_dtype` when it is set); overrides `kv_keep_ratio`."""
    kv_merge: str = "averaged"
    """How an evicted entry is folded into its most similar kept entry: "none", "averaged",
    "pivotal" or "weighted" (see kv_compress.py)."""
    kv_query_window: int = 0
    """The last this-many tokens of the text after the video score the KV entries; 0 = all that
    text. A longer window is clamped to it (`text_guided.text_query_positions`: the scores are
    text-prior, and a visual token may be gone from the layers after a prefill drop)."""
    kv_dtype: str = "auto"
    """Dtype the KV cache is kept in and sent to Decode: "auto" (the model's), "bfloat16" or
    "float16". Narrower than the model's halves the bytes (and rounds every entry: lossy, measured
    by `epd bench quality`); Decode computes in the model's dtype either way. Like vLLM's
    `kv_cache_dtype`, applied to every entry, text included."""

    # --- Decode stage -------------------------------------------------------------------------
    decode_evict: bool = False
    """Evict visual KV entries that persistently receive little attention while generating."""
    decode_keep_ratio: float = 1.0
    """Visual KV entries kept, as a fraction of those present when decoding starts."""
    decode_ema_decay: float = 0.9
    """Decay of the running (exponential) mean of attention received per generated token."""
    decode_min_steps: int = 4
    """Generated tokens observed before the first eviction: one token's attention is noise."""
    decode_evict_interval: int = 4
    """Evict at most once every this many generated tokens (gathers are not free)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the knob to change."""
        for name in ("prefill_keep_ratio", "kv_keep_ratio", "decode_keep_ratio"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if not 0.0 <= self.key_token_ratio <= 1.0:
            raise ValueError(f"key_token_ratio must be in [0, 1], got {self.key_token_ratio}")
        if self.temporal_threshold < 0:
            raise ValueError(f"temporal_threshold must be >= 0, got {self.temporal_threshold}")
        if not -1.0 <= self.spatial_merge_threshold <= 1.0:
            raise ValueError(
                f"spatial_merge_threshold is a cosine similarity in [-1, 1], "
                f"got {self.spatial_merge_threshold}"
            )
        if self.spatial_merge_window < 1:
            raise ValueError(f"spatial_merge_window must be >= 1, got {self.spatial_merge_window}")
        if self.key_token_score not in KEY_TOKEN_SCORES:
            raise ValueError(
                f"key_token_score must be one of {KEY_TOKEN_SCORES}, got {self.key_token_score!r}"
            )
        if self.prefill_keep_basis not in KEEP_BASES:
            raise ValueError(
                f"prefill_keep_basis must be one of {KEEP_BASES}, got {self.prefill_keep_basis!r}"
            )
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.kv_merge not in KV_MERGE_MODES:
            raise ValueError(f"kv_merge must be one of {KV_MERGE_MODES}, got {self.kv_merge!r}")
        if self.prefill_drop_layer < 0:
            raise ValueError(f"prefill_drop_layer must be >= 0, got {self.prefill_drop_layer}")
        layers = tuple(self.prefill_drop_layers)
        if any(x < 0 for x in layers) or any(b <= a for a, b in zip(layers, layers[1:])):
            raise ValueError(
                f"prefill_drop_layers must be strictly ascending layer numbers >= 0, got {layers}"
            )
        if self.prefill_keep_count is not None and self.prefill_keep_count < 0:
            raise ValueError(f"prefill_keep_count must be >= 0, got {self.prefill_keep_count}")
        if self.kv_budget_bytes is not None and self.kv_budget_bytes <= 0:
            raise ValueError(f"kv_budget_bytes must be > 0, got {self.kv_budget_bytes}")
        for name in ("prefill_query_window", "kv_query_window"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = all text after the video)")
        if not 0.0 <= self.decode_ema_decay < 1.0:
            raise ValueError(f"decode_ema_decay must be in [0, 1), got {self.decode_ema_decay}")
        if self.decode_min_steps < 1 or self.decode_evict_interval < 1:
            raise ValueError("decode_min_steps and decode_evict_interval must be >= 1")

    def drop_layers(self, num_layers: int) -> tuple[int, ...]:
        """The decoder layers that drop, clamped to the model's depth (duplicates removed);
        () when the prefill stage is off."""
        if not self.prefill_drop:
            return ()
        wanted = self.prefill_drop_layers or (self.prefill_drop_layer,)
        return tuple(sorted({min(x, num_layers - 1) for x in wanted}))

    @property
    def any_enabled(self) -> bool:
        return (
            self.temporal_drop
            or self.spatial_merge
            or self.key_token_ratio > 0
            or self.prefill_drop
            or self.kv_compress
            or self.kv_dtype != "auto"
            or self.decode_evict
        )

    def to_dict(self) -> dict[str, Any]:
        """Every knob by name, JSON-able (for protos, logs and cache keys)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PruningConfig:
        """Inverse of `to_dict`; missing keys take defaults, unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown pruning option(s) {unknown}; known options: {sorted(known)}")
        if "prefill_drop_layers" in data:  # JSON gives a list
            data = {**data, "prefill_drop_layers": tuple(int(x) for x in data["prefill_drop_layers"])}
        return cls(**data)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> PruningConfig:
        """A named preset with some knobs overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown pruning preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls.from_dict({**PRESETS[name].to_dict(), **overrides})

    def to_knobs(self) -> dict[str, str]:
        """The knobs that differ from the defaults, as text: `from_knobs(cfg.to_knobs()) == cfg`."""
        default = PruningConfig()
        return {
            f.name: str(getattr(self, f.name))
            for f in fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        }

    @classmethod
    def from_knobs(cls, knobs: Mapping[str, str], preset: str = "off") -> PruningConfig:
        """Preset `preset` with knobs given as text (a client's request, a command line), each
        parsed by its field's declared type. ValueError naming the knob and the type expected."""
        hints = _knob_types()
        parsed: dict[str, Any] = {}
        for name, text in knobs.items():
            if name not in hints:
                raise ValueError(f"unknown pruning option {name[:64]!r}; known options: {sorted(hints)}")
            parsed[name] = _parse_knob(name, text, hints[name])
        return cls.from_preset(preset, **parsed)

    def encode_cache_key(self) -> dict[str, Any]:
        """The knobs that change the encoder's output tokens: part of an encoder-cache key.

        Prefill, KV and decode knobs act later, so a cached encoding is shared across them.
        """
        keys = ["temporal_drop", "spatial_merge", "key_token_ratio"]
        if self.temporal_drop:
            keys += ["temporal_threshold", "temporal_before_tower"]
        if self.spatial_merge:
            keys += ["spatial_merge_threshold", "spatial_merge_window"]
        if self.key_token_ratio > 0:
            keys += ["key_token_score"]
        return {k: getattr(self, k) for k in keys}


MAX_KNOB_INT = 2**62
"""Integer knobs (layers, counts, byte budgets) beyond this are refused: no real value is near
it, and torch index arithmetic overflows int64 past it."""


@functools.cache
def _knob_types() -> dict[str, Any]:
    """Each knob's declared type, resolved from its annotation (`int | None`, `tuple[int, ...]`)."""
    hints = get_type_hints(PruningConfig)
    return {f.name: hints[f.name] for f in fields(PruningConfig)}


def _type_name(hint: Any) -> str:
    """How an error message names a knob's type: "bool", "int | None", "tuple[int, ...]"."""
    return hint.__name__ if isinstance(hint, type) and get_origin(hint) is None else str(hint)


def _parse_knob(name: str, text: str, hint: Any) -> Any:
    try:
        return _parse_as(text, hint)
    except ValueError:
        raise ValueError(
            f"pruning option {name}={text[:64]!r} is not a valid {_type_name(hint)}"
            + (f" (integers within +-{MAX_KNOB_INT}, finite numbers)" if hint is not bool else "")
        ) from None


def _parse_as(text: str, hint: Any) -> Any:
    """`text` as a value of type `hint`; ValueError when it is not one."""
    if get_origin(hint) in (Union, types.UnionType):
        args = get_args(hint)
        if type(None) in args and text.lower() in ("", "none"):
            return None
        (hint,) = [a for a in args if a is not type(None)]  # only `T | None` knobs exist
    if hint is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError
        return text.lower() in ("true", "1")
    if hint is int:
        return _knob_int(text)
    if hint is float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError
        return value
    if hint is str:
        return text
    if get_origin(hint) is tuple and get_args(hint) == (int, ...):
        # "1,3", "(1, 3)" or "[1, 3]"; "" or "()" is the empty tuple
        parts = text.strip().strip("()[]").replace(" ", "")
        return tuple(_knob_int(x) for x in parts.split(",") if x)
    raise TypeError(f"a pruning knob of type {hint} has no text form")  # a new knob type: add it here


def _knob_int(text: str) -> int:
    value = int(text)
    if abs(value) > MAX_KNOB_INT:
        raise ValueError
    return value


# The encoder stages that cost almost no accuracy: unchanged pixels, near-duplicate neighbours.
_LIGHT_ENCODE: dict[str, Any] = dict(
    temporal_drop=True,
    temporal_threshold=0.03,
    spatial_merge=True,
    spatial_merge_threshold=0.95,
    key_token_ratio=0.05,
)

PRESETS: dict[str, PruningConfig] = {
    "off": PruningConfig(),
    # Only near-lossless steps: the light encoder stages, a mild prefill drop and KV trim.
    "light": PruningConfig(
        **_LIGHT_ENCODE,
        prefill_drop=True,
        prefill_keep_ratio=0.75,
        kv_compress=True,
        kv_keep_ratio=0.75,
    ),
    # A quarter of the video's tokens: the light encoder stages (cheap, content-aware) first, then
    # the question-guided drop removes only what they left above 25%; KV kept and sent in bf16.
    "budget25": PruningConfig(
        **_LIGHT_ENCODE,
        prefill_drop=True,
        prefill_keep_ratio=0.25,
        prefill_keep_basis="video",
        kv_dtype="bfloat16",
    ),
    "balanced": PruningConfig(
        temporal_drop=True,
        temporal_threshold=0.05,
        spatial_merge=True,
        spatial_merge_threshold=0.9,
        key_token_ratio=0.05,
        prefill_drop=True,
        prefill_keep_ratio=0.5,
        kv_compress=True,
        kv_keep_ratio=0.5,
        decode_evict=True,
        decode_keep_ratio=0.75,
    ),
    "aggressive": PruningConfig(
        temporal_drop=True,
        temporal_threshold=0.08,
        spatial_merge=True,
        spatial_merge_threshold=0.8,
        key_token_ratio=0.03,
        prefill_drop=True,
        prefill_keep_ratio=0.25,
        kv_compress=True,
        kv_keep_ratio=0.4,
        kv_merge="weighted",
        decode_evict=True,
        decode_keep_ratio=0.5,
    ),
}
