"""Loading helpers shared by the transformers-backed families (`qwen2_vl`, `qwen3_vl`, `qwen3_5`,
`llava_onevision`): checkpoint identity, generation config, and the one-part stage loaders that
read only their own part's tensors from a checkpoint's safetensors."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


def fingerprint(path: str) -> str:
    """Identity of a checkpoint for cache keys: its configs' contents and its weight files'
    names, sizes and modification times (a re-saved or re-trained model gets a new one). A hub
    id is read where transformers downloaded it (its snapshot directory, named by the commit):
    the id alone stayed the same when the hub's model changed."""
    import hashlib

    root = Path(path)
    if not root.exists() and (snapshot := _hub_snapshot(path)) is not None:
        root = snapshot
    h = hashlib.sha256(str(root.resolve() if root.exists() else path).encode())
    if root.is_dir():
        for f in sorted(root.iterdir()):
            if f.suffix == ".json":
                h.update(f.name.encode() + f.read_bytes())
            elif f.suffix == ".safetensors":
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _hub_snapshot(repo_id: str) -> Path | None:
    """The local snapshot directory of a hub model transformers has downloaded, or None."""
    try:
        from huggingface_hub import try_to_load_from_cache

        config = try_to_load_from_cache(repo_id, "config.json")
    except Exception as exc:  # not a valid repo id, no cache: the id is all there is
        log.debug("no local snapshot of %s: %s", repo_id, exc)
        return None
    return Path(config).parent if isinstance(config, str) else None


def generation_config(path: str):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return None


def end_of_sequence(path: str, tokenizer) -> tuple[int | None, frozenset[int]]:
    """(the tokenizer's end-of-sequence id, every id that ends an answer), as vLLM's: the first is
    its request's `eos_token_id`, which its `check_stop` tests before the stop tokens (an answer
    it ends has `stop_reason` None); the checkpoint's generation config's other `eos_token_id`s
    (GLM-4.1V's `<|user|>` and `<|observation|>`, Qwen2.5-VL's `<|endoftext|>`) vLLM adds to the
    request's `stop_token_ids` (`SamplingParams.update_from_generation_config`), so an answer one
    ends has its id for `stop_reason`, and ignore_eos lets them through as it does the first."""
    primary = tokenizer.eos_token_id
    eos = getattr(generation_config(path), "eos_token_id", None)
    others = () if eos is None else [eos] if isinstance(eos, int) else eos
    return primary, frozenset([*others, *([] if primary is None else [primary])])


def load_full_model(path: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()  # type: ignore[arg-type]


def safetensors_files(path: str) -> tuple[Path, list[str]]:
    """The checkpoint's directory and its safetensors files ([] when it has none)."""
    root = Path(path) if Path(path).is_dir() else Path(snapshot_dir(path))
    index = root / "model.safetensors.index.json"
    if index.exists():
        return root, sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return root, ["model.safetensors"] if (root / "model.safetensors").exists() else []


def read_part(root: Path, files: list[str], rename) -> dict[str, torch.Tensor]:
    """The checkpoint tensors that `rename(key)` maps to a name (None skips the key). Only those
    are read: safetensors maps the file and a tensor's bytes are touched only by get_tensor."""
    from safetensors import safe_open

    state = {}
    for name in files:
        with safe_open(str(root / name), framework="pt") as f:
            for key in f.keys():
                if (new := rename(key)) is not None:
                    state[new] = f.get_tensor(key)
    return state


def load_part(
    module: torch.nn.Module,
    root: Path,
    files: list[str],
    rename,
    dtype: torch.dtype,
    arrange: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda state: state,
) -> tuple[list[str], list[str]]:
    """Load the checkpoint tensors `rename` picks into `module`, `arrange`d first (ties, layouts);
    (missing, unexpected) as `load_state_dict` reports them. Where the zygote this process was
    forked from holds the checkpoint in `dtype` (epd/model_runtime/shared_weights.py), its tensors
    become the parameters (assigned: the pages stay shared with every service); else they are read
    from the files and copied into the module's own parameters, in their dtypes (as from_pretrained
    casts a checkpoint tensor to its parameter's dtype)."""
    from epd.model_runtime import shared_weights

    shared = shared_weights.shared_part(root, files, dtype, rename)
    state = None if shared is None else shared_weights.assignable(module, arrange(shared))
    if state is not None:
        result = module.load_state_dict(state, strict=False, assign=True)
        log.info(
            "weights: %.1f MiB of %s shared with the zygote's copy",
            shared_weights.shared_bytes(state) / 2**20,
            type(module).__name__,
        )
    else:
        result = module.load_state_dict(arrange(read_part(root, files, rename)), strict=False)
    return result.missing_keys, result.unexpected_keys


def vision_key(key: str) -> str | None:
    """Hub format ("visual.*") or transformers 5's ("model.visual.*") -> the tower's own names."""
    for prefix in ("model.visual.", "visual."):
        if key.startswith(prefix):
            return key[len(prefix) :]
    return None


def language_key(key: str) -> str | None:
    """Hub format ("model.layers.*", "lm_head.*") or transformers 5's ("model.language_model.*")
    -> "model.language_model.*" / "lm_head.*" (`LanguageOnly`'s names); the tower's -> None (never read)."""
    if key.startswith("lm_head."):
        return key
    if key.startswith(("visual.", "model.visual.")):
        return None
    for prefix in ("model.language_model.", "model."):
        if key.startswith(prefix):
            return "model.language_model." + key[len(prefix) :]
    return None


def nested_language_key(key: str) -> str | None:
    """A language model nested in a LLaVA-style checkpoint (LLaVA-OneVision, InternVL): the saved
    layout ("language_model.model.*", "language_model.lm_head.*"; older ones "language_model.*")
    or a whole model's module names ("model.language_model.*", "lm_head.*") -> `LanguageOnly`'s
    names; any other key (the tower's, the projector's) -> None (never read)."""
    for prefix in ("lm_head.", "language_model.lm_head."):
        if key.startswith(prefix):
            return "lm_head." + key[len(prefix) :]
    for prefix in ("model.language_model.", "language_model.model.", "language_model."):
        if key.startswith(prefix):
            return "model.language_model." + key[len(prefix) :]
    return None


class LanguageOnly(torch.nn.Module):
    """The language half of the model at the whole model's attribute paths (`model.language_model`,
    `lm_head`; no `model.visual`), so prefill and decode run the same modules either way."""

    def __init__(self, language_model: torch.nn.Module, lm_head: torch.nn.Module) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.language_model = language_model
        self.lm_head = lm_head


def load_vision_part(
    path: str,
    hf_config,
    dtype: torch.dtype,
    build: Callable[[], torch.nn.Module],
    rename=vision_key,
    full_part=lambda model: model.model.visual,
    what: str = "vision tower",
):
    """Build the encoder's part alone (`build()`, weights uninitialised) and load only its tensors
    (`rename` picks and renames them). Without safetensors: `full_part` of the full model.

    Dtypes as `from_pretrained(dtype=...)` gives the whole model (what generate() and the embedded
    mode run): the part is built with `dtype` as torch's default dtype, so parameters and buffers
    made in that default take `dtype` while buffers a module computes in float32 on purpose (the
    rotary `inv_freq`, [head_dim / 4] in Qwen's towers) stay float32; the model's own
    `_keep_in_fp32_modules(_strict)` parameters are float32. A `.to(dtype)` of the whole part would
    round `inv_freq` to bfloat16 and move every visual token's embedding away from generate()'s."""
    from transformers.initialization import no_init_weights
    from transformers.modeling_utils import local_torch_dtype

    root, files = safetensors_files(path)
    if not files:
        log.info("no safetensors in %s; loading the full model for its %s", root, what)
        return full_part(load_full_model(str(root), dtype, torch.device("cpu")))
    # every weight is loaded below (random init would only cost time); `dtype` as the default dtype
    with no_init_weights(), local_torch_dtype(dtype):
        part = build()
    apply_keep_in_fp32_plan(part, dtype)
    missing, unexpected = load_part(part, root, files, rename, dtype)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match the {what}: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    return part.eval()


def apply_keep_in_fp32_plan(part: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """Give the checkpoint tensors that `from_pretrained(dtype=dtype)` loads in float32 their
    float32 (before they are loaded): those under a module named in a transformers model's
    `_keep_in_fp32_modules` (float16) or `_keep_in_fp32_modules_strict` (float16 and bfloat16),
    matched as transformers matches them (its `_get_dtype_plan` globs searched in the tensor's
    name). None of the supported towers names any today; a family that does keeps them. Returns
    the names changed."""
    from transformers import PreTrainedModel
    from transformers.core_model_loading import build_glob_alternation

    plan: dict[str, torch.dtype] = {}
    for module in part.modules():  # the part itself, or the transformers models inside it
        if isinstance(module, PreTrainedModel):
            plan.update(module._get_dtype_plan(dtype))
    if not plan:
        return []
    pattern, glob_of_group, _ = build_glob_alternation(list(plan))
    changed = []
    for name, tensor in part.state_dict(keep_vars=True).items():  # parameters and persistent buffers
        if tensor.is_floating_point() and (match := pattern.search(name)) is not None:
            # every branch of the alternation is a named group, so lastgroup names the glob matched
            tensor.data = tensor.data.to(plan[glob_of_group[str(match.lastgroup)]])
            changed.append(name)
    return changed


def build_language_only(
    text_config, dtype: torch.dtype, build_lm: Callable[[], torch.nn.Module]
) -> LanguageOnly:
    """`LanguageOnly` of `build_lm()` and an lm_head, weights uninitialised (all are loaded after)."""
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every weight is loaded below; random init would only cost time
        lm = build_lm()
        head = torch.nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False, dtype=dtype)
    return LanguageOnly(lm, head)


def load_language_state(
    model: LanguageOnly,
    root: Path,
    files: list[str],
    rename,
    hf_config,
    path: str,
    dtype: torch.dtype,
    arrange: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda state: state,
) -> None:
    """Load the tensors `rename` picks (`arrange`d, `load_part`) into `model`, tying the head to the
    embeddings where the checkpoint does (the small checkpoints store no lm_head)."""
    text_config = hf_config.text_config
    tied = getattr(hf_config, "tie_word_embeddings", False) or getattr(
        text_config, "tie_word_embeddings", False
    )
    lm: Any = model.model.language_model
    head_tied = False

    def tie(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        nonlocal head_tied
        state = arrange(state)
        if "lm_head.weight" not in state and tied:
            head_tied = True
            model.lm_head.weight = lm.embed_tokens.weight
            state["lm_head.weight"] = state["model.language_model.embed_tokens.weight"]
        return state

    missing, unexpected = load_part(model, root, files, rename, dtype, tie)
    if head_tied:  # assigned, each became a parameter of its own over the one tensor: one again
        model.lm_head.weight = lm.embed_tokens.weight
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match the language model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )


def load_nested_language_model(
    root: Path, files: list[str], path: str, hf_config, dtype: torch.dtype, rename
) -> tuple[LanguageOnly, dict[str, torch.Tensor]]:
    """`LanguageOnly` of whatever text model the config names (`AutoModel`, as LLaVA-style models
    build it) and an lm_head, loaded from the tensors of the checkpoint's safetensors `files`
    that `rename` maps to its names; (the model, the other tensors `rename` picked, by name: a
    family's own language-side extras, LLaVA-OneVision's image_newline)."""
    from transformers import AutoModel

    text_config = hf_config.text_config
    model = build_language_only(text_config, dtype, lambda: AutoModel.from_config(text_config, dtype=dtype))
    extras: dict[str, torch.Tensor] = {}

    def without_extras(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        extras.clear()
        extras.update(
            {k: state.pop(k) for k in list(state) if not k.startswith(("model.language_model.", "lm_head."))}
        )
        return state

    # the small checkpoints tie the head
    load_language_state(model, root, files, rename, hf_config, path, dtype, without_extras)
    return model, extras


def load_language_model(path: str, hf_config, dtype: torch.dtype, text_cls):
    """Build the text model (`text_cls`, as the whole model builds it) and lm_head alone and load
    only their weights (prefill and decode): the tower's tensors are never read. Without
    safetensors: the full model, tower dropped."""
    root, files = safetensors_files(path)
    if not files:
        log.info("no safetensors in %s; loading the full model for its language model", root)
        model = load_full_model(str(root), dtype, torch.device("cpu"))
        model.model.visual = None  # frees the tower; this stage never runs it
        return model
    text_config = hf_config.text_config
    model = build_language_only(text_config, dtype, lambda: text_cls._from_config(text_config, dtype=dtype))
    load_language_state(model, root, files, language_key, hf_config, path, dtype)
    return model


def hide_transformers_bars() -> None:
    """Draw none of transformers' own progress bars in this process from now on: the whole model's
    "Loading weights" bar (`epd serve --colocate` and embedded `epd ask` load through
    `from_pretrained`) in a server's stderr, which is its log, or beside `epd ask`'s own progress.
    The stack's stages read their one part themselves and never drew it. The hub's download bars
    are not transformers' and stay: a download is the long part."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_tqdm_hook(lambda bar, args, kwargs: bar(*args, **{**kwargs, "disable": True}))


def snapshot_dir(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja"])
