"""Qwen2-VL and Qwen2.5-VL behind `VLMAdapter`, on transformers' own classes.

Positions are where a split pipeline most easily drifts from `generate()`; we reproduce what
transformers 5.x does for these classes:
  * prefill position ids are [4, 1, L]: row 0 is the plain text position (transformers uses it to
    build the causal mask), rows 1-3 are `get_rope_index`'s M-RoPE rows (temporal, height, width);
  * each decode step continues every row from its own last prompt value + 1 (generate's
    `_update_model_kwargs_for_generation`), not from `rope_deltas`;
  * positions are always passed explicitly, because the model keeps `rope_deltas` on the module
    between calls and would otherwise mix requests.
Qwen2.5-VL also needs `second_per_grid_ts` (seconds per temporal patch group) for its temporal row.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from epd.model_runtime.adapter import PrefillState, Prompt, VisionInputs, VisualMeta, VLMAdapter
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.kv_cache import KvCache
from epd.video.types import DecodedVideo

log = logging.getLogger(__name__)

STAGE_PARTS = {"encoder": {"vision"}, "prefill": {"language"}, "decode": {"language"}}


class Qwen2VLAdapter(VLMAdapter):
    """Loads only the parts a stage needs: "vision" (the vision tower) and/or "language"
    (embeddings, decoder layers, lm_head). From safetensors, a one-part stage reads only its own
    part's tensors (the encoder never the language model's, prefill and decode never the tower's);
    both parts (the embedded mode, training) load transformers' whole model."""

    def __init__(self, path: str, config: ModelConfig, parts: set[str]) -> None:
        from transformers import AutoConfig, AutoProcessor

        self.config = config
        self.parts = frozenset(parts)
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.processor = AutoProcessor.from_pretrained(path)
        self.fingerprint = _fingerprint(path)
        self.tokenizer = self.processor.tokenizer
        self.hf_config = AutoConfig.from_pretrained(path)
        self.family = self.hf_config.model_type  # "qwen2_vl" or "qwen2_5_vl"
        # Qwen2.5-VL's windowed attention reorders patches by window: no subset encoding there.
        self.supports_sparse_vision = self.family == "qwen2_vl"
        self.merge_size = self.hf_config.vision_config.spatial_merge_size
        self.hidden_size = self.hf_config.text_config.hidden_size
        self.visual = None
        self.model = None
        if self.parts >= {"vision", "language"}:
            self.model = _load_full_model(path, self.dtype, self.device)
            self.visual = self.model.model.visual
        elif "vision" in self.parts:
            self.visual = _load_vision_tower(path, self.hf_config, self.dtype).to(self.device)
        elif "language" in self.parts:
            self.model = _load_language_model(path, self.hf_config, self.dtype).to(self.device).eval()
        # no parts: prompts only (build_prompt), no weights
        eos = getattr(self._generation_config(path), "eos_token_id", None)
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else eos)

    # -- encoder -----------------------------------------------------------------------------

    def preprocess(self, video: DecodedVideo) -> VisionInputs:
        if video.is_image:
            out = self.processor.image_processor(images=[video.frames[0]], return_tensors="pt")
            grid = tuple(int(x) for x in out["image_grid_thw"][0])
            return VisionInputs("image", out["pixel_values"], grid, 0.0)  # type: ignore[arg-type]
        vp = self.processor.video_processor
        out = vp(
            videos=[video.frames],
            do_sample_frames=False,
            cap_pixels_per_frame=False,
            return_tensors="pt",
        )
        grid = tuple(int(x) for x in out["video_grid_thw"][0])
        second_per_grid_t = vp.temporal_patch_size / video.sampled_fps
        return VisionInputs("video", out["pixel_values_videos"], grid, second_per_grid_t)  # type: ignore[arg-type]

    @torch.inference_mode()
    def encode(self, inputs: VisionInputs) -> torch.Tensor:
        if self.visual is None:
            raise RuntimeError("this adapter was loaded without the vision tower")
        grid = torch.tensor([inputs.grid_thw], dtype=torch.long, device=self.device)
        pixels = inputs.pixel_values.to(self.device, self.visual.dtype)
        out = self.visual(pixels, grid_thw=grid)
        return out.pooler_output  # [t * h/2 * w/2, hidden]

    def num_visual_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // self.merge_size**2

    # -- prefill -----------------------------------------------------------------------------

    def build_prompt(self, conversation: list[dict[str, Any]], visual: VisualMeta) -> Prompt:
        # The processor's own template renders the parts in order (no separator between text parts,
        # earlier turns as it renders them); we only expand the one placeholder, as its __call__ does.
        text = self.processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        pad = self.processor.video_token if visual.modality == "video" else self.processor.image_token
        if any(token in part.get("text", "") for m in conversation for part in m["content"]
               for token in (self.processor.video_token, self.processor.image_token)):
            raise ValueError("a text part contains the model's visual placeholder token; remove it")
        num_tokens = self.num_visual_tokens(visual.grid_thw)  # every placeholder, before any dropping
        text = text.replace(pad, pad * num_tokens, 1)
        input_ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        pad_id = self.tokenizer.convert_tokens_to_ids(pad)
        visual_mask = input_ids[0] == pad_id
        if int(visual_mask.sum()) != num_tokens:
            raise ValueError(f"the chat template rendered {text.count(pad) - num_tokens + 1} {visual.modality} "
                             "placeholders; send exactly one video or image part")
        return Prompt(input_ids, self._prompt_positions(input_ids, visual), visual_mask)

    def _prompt_positions(self, input_ids: torch.Tensor, visual: VisualMeta) -> torch.Tensor:
        """[4, 1, L]: text row + M-RoPE rows, as generate's _prepare_position_ids_for_generation."""
        mm_type = 2 if visual.modality == "video" else 1
        pad_id = self.hf_config.video_token_id if mm_type == 2 else self.hf_config.image_token_id
        mm_token_type_ids = (input_ids == pad_id).long() * mm_type
        grid = torch.tensor([visual.grid_thw], dtype=torch.long)
        kwargs = {"image_grid_thw": grid} if mm_type == 1 else {"video_grid_thw": grid}
        if self.family == "qwen2_5_vl" and mm_type == 2:
            kwargs["second_per_grid_ts"] = torch.tensor([visual.second_per_grid_t])
        rope_index = _rope_index_fn(self.hf_config)
        mrope, _ = rope_index(self.hf_config, input_ids, mm_token_type_ids=mm_token_type_ids, **kwargs)
        text_row = torch.arange(input_ids.shape[1], dtype=torch.long)[None, None]
        return torch.cat([text_row, mrope], dim=0)

    @property
    def language_model(self):
        """transformers' text model (embed_tokens, layers, rotary_emb, norm)."""
        return self._language_model()

    @property
    def lm_head(self):
        if self.model is None:
            raise RuntimeError("this adapter was loaded without the language model")
        return self.model.lm_head

    @property
    def text_config(self):
        return self.hf_config.text_config

    @torch.inference_mode()
    def encode_sparse(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int],
                      position_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """The tower on kept patches only: position_ids [P', 2] (row, col), cu_seqlens per group."""
        if self.visual is None or not self.supports_sparse_vision:
            raise RuntimeError("sparse vision encoding needs Qwen2-VL's vision tower")
        grid = torch.tensor([grid_thw], dtype=torch.long, device=self.device)
        out = self.visual(pixel_values.to(self.device, self.visual.dtype), grid_thw=grid,
                          position_ids=position_ids.to(self.device), cu_seqlens=cu_seqlens.to(self.device))
        return out.pooler_output

    @torch.inference_mode()
    def prefill(self, prompt: Prompt, visual_embeds: torch.Tensor) -> PrefillState:
        from transformers import DynamicCache

        lm = self._language_model()
        input_ids = prompt.input_ids.to(self.device)
        embeds = lm.embed_tokens(input_ids)  # [1, L, hidden]
        mask = prompt.visual_mask.to(self.device)[None, :, None].expand_as(embeds)
        embeds = embeds.masked_scatter(mask, visual_embeds.to(self.device, embeds.dtype))
        cache = DynamicCache(config=self.hf_config.text_config)
        length = prompt.num_tokens
        out = lm(
            inputs_embeds=embeds,
            position_ids=prompt.position_ids.to(self.device),
            attention_mask=torch.ones(1, length, dtype=torch.long, device=self.device),
            past_key_values=cache,
            use_cache=True,
        )
        logits = self.lm_head(out.last_hidden_state[:, -1:])  # [1, 1, vocab]
        return PrefillState(
            cache=KvCache.from_dynamic(cache),
            last_logits=logits[0, -1],
            next_position_ids=prompt.position_ids[:, 0, -1] + 1,
            num_prompt_tokens=length,
        )

    # -- decode ------------------------------------------------------------------------------

    def new_decode_cache(self, cache: KvCache):
        # The cache may arrive narrower than the model (PruningConfig.kv_dtype); compute in the model's.
        dtype = self._language_model().embed_tokens.weight.dtype
        kv = KvCache([k.to(self.device, dtype) for k in cache.keys], [v.to(self.device, dtype) for v in cache.values])
        return kv.to_dynamic(self.hf_config.text_config)

    @torch.inference_mode()
    def decode_step(self, token_id: int, position_ids: torch.Tensor, cache) -> torch.Tensor:
        lm = self._language_model()
        ids = torch.tensor([[token_id]], dtype=torch.long, device=self.device)
        past = cache.get_seq_length()
        out = lm(
            inputs_embeds=lm.embed_tokens(ids),
            position_ids=position_ids.view(4, 1, 1).to(self.device),
            attention_mask=torch.ones(1, past + 1, dtype=torch.long, device=self.device),
            past_key_values=cache,
            use_cache=True,
        )
        return self.lm_head(out.last_hidden_state[:, -1:])[0, -1]

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # -- helpers -----------------------------------------------------------------------------

    def _language_model(self):
        if self.model is None:
            raise RuntimeError("this adapter was loaded without the language model")
        return self.model.model.language_model

    @staticmethod
    def _generation_config(path: str):
        from transformers import GenerationConfig

        try:
            return GenerationConfig.from_pretrained(path)
        except OSError:
            return None


def _fingerprint(path: str) -> str:
    """Identity of a checkpoint for cache keys: its configs' contents and its weight files'
    names, sizes and modification times (a re-saved or re-trained model gets a new one)."""
    import hashlib

    root = Path(path)
    h = hashlib.sha256(str(root.resolve() if root.exists() else path).encode())
    if root.is_dir():
        for f in sorted(root.iterdir()):
            if f.suffix == ".json":
                h.update(f.name.encode() + f.read_bytes())
            elif f.suffix == ".safetensors":
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _rope_index_fn(hf_config):
    """The family's unbound `get_rope_index`; it reads only `self.config`, so we call it on a
    tiny stand-in instead of needing the whole model (the encoder-free stages still have it)."""
    if hf_config.model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel as cls
    else:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel as cls

    class _Holder:
        def __init__(self, config):
            self.config = config

        get_vision_position_ids = cls.get_vision_position_ids

    def call(config, input_ids, **kwargs):
        return cls.get_rope_index(_Holder(config), input_ids, **kwargs)

    return call


def _load_full_model(path: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()  # type: ignore[arg-type]


def _safetensors_files(path: str) -> tuple[Path, list[str]]:
    """The checkpoint's directory and its safetensors files ([] when it has none)."""
    root = Path(path) if Path(path).is_dir() else Path(_snapshot_dir(path))
    index = root / "model.safetensors.index.json"
    if index.exists():
        return root, sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return root, ["model.safetensors"] if (root / "model.safetensors").exists() else []


def _read_part(root: Path, files: list[str], rename) -> dict[str, torch.Tensor]:
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


def _vision_key(key: str) -> str | None:
    """Hub format ("visual.*") or transformers 5's ("model.visual.*") -> the tower's own names."""
    for prefix in ("model.visual.", "visual."):
        if key.startswith(prefix):
            return key[len(prefix) :]
    return None


def _language_key(key: str) -> str | None:
    """Hub format ("model.layers.*", "lm_head.*") or transformers 5's ("model.language_model.*")
    -> "model.language_model.*" / "lm_head.*" (`_LanguageOnly`'s names); the tower's -> None (never read)."""
    if key.startswith("lm_head."):
        return key
    if key.startswith(("visual.", "model.visual.")):
        return None
    for prefix in ("model.language_model.", "model."):
        if key.startswith(prefix):
            return "model.language_model." + key[len(prefix) :]
    return None


def _load_vision_tower(path: str, hf_config, dtype: torch.dtype):
    """Build the vision tower alone and load only its weights from the checkpoint's safetensors.

    Checkpoints name the tower's weights "visual.*" (hub format) or "model.visual.*" (format
    written by transformers 5); both are accepted. Falls back to loading the full model when the
    checkpoint is not in safetensors.
    """
    from transformers.initialization import no_init_weights

    root, files = _safetensors_files(path)
    if not files:
        log.info("no safetensors in %s; loading the full model for its vision tower", root)
        return _load_full_model(str(root), dtype, torch.device("cpu")).model.visual
    tower_cls = _vision_tower_class(hf_config)
    with no_init_weights():  # every weight is loaded below; random init would only cost time
        tower = tower_cls._from_config(hf_config.vision_config, dtype=dtype)
    state = _read_part(root, files, _vision_key)
    missing, unexpected = tower.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match the vision tower: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    return tower.to(dtype).eval()


class _LanguageOnly(torch.nn.Module):
    """The language half of the model at the whole model's attribute paths (`model.language_model`,
    `lm_head`; no `model.visual`), so prefill and decode run the same modules either way."""

    def __init__(self, language_model: torch.nn.Module, lm_head: torch.nn.Module) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.language_model = language_model
        self.lm_head = lm_head


def _load_language_model(path: str, hf_config, dtype: torch.dtype):
    """Build the text model and lm_head alone and load only their weights (prefill and decode):
    the tower's tensors are never read. Without safetensors: the full model, tower dropped."""
    from transformers.initialization import no_init_weights

    root, files = _safetensors_files(path)
    if not files:
        log.info("no safetensors in %s; loading the full model for its language model", root)
        model = _load_full_model(str(root), dtype, torch.device("cpu"))
        model.model.visual = None  # frees the tower; this stage never runs it
        return model
    text_config = hf_config.text_config
    with no_init_weights():  # every weight is loaded below; random init would only cost time
        text_cls = _text_model_class(hf_config)
        lm = text_cls._from_config(text_config, dtype=dtype)  # as the whole model builds it
        head = torch.nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False, dtype=dtype)
    model = _LanguageOnly(lm, head)
    state = _read_part(root, files, _language_key)
    tied = getattr(hf_config, "tie_word_embeddings", False) or getattr(text_config, "tie_word_embeddings", False)
    if "lm_head.weight" not in state and tied:
        head.weight = lm.embed_tokens.weight
        state["lm_head.weight"] = state["model.language_model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match the language model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    return model


def _text_model_class(hf_config):
    if hf_config.model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel as text
    else:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLTextModel as text
    return text


def _vision_tower_class(hf_config):
    if hf_config.model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as tower,
        )
    else:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel as tower,
        )
    return tower


def _snapshot_dir(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja"])
