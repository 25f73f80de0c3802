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
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from epd.model_runtime.adapter import (
    CapturedQueries,
    ChunkResult,
    LayerwisePass,
    PrefillChunk,
    PrefillState,
    Prompt,
    TextDims,
    VisionInputs,
    VisualMeta,
    VLMAdapter,
)
from epd.model_runtime.batch_kv import BatchKv
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.kv_cache import KvCache
from epd.model_runtime.qwen_text_layers import (
    QueryCapture,
    QwenLayerwisePass,
    count_parameters,
    dims_of,
    dynamic_cache_kv,
    set_dynamic_cache_kv,
)
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

    @torch.inference_mode()
    def encode_batch(self, inputs: list[VisionInputs]) -> list[torch.Tensor]:
        """One tower call: patches concatenated [sum patches, patch_dim], one grid row each
        ([N, 3]); the tower builds per-image (per temporal group) attention boundaries from the
        rows, so nothing attends across inputs. Images and videos mix (an image is one temporal
        patch). Output [sum tokens, hidden] split back in input order."""
        if len(inputs) == 1:
            return [self.encode(inputs[0])]
        if self.visual is None:
            raise RuntimeError("this adapter was loaded without the vision tower")
        grid = torch.tensor([i.grid_thw for i in inputs], dtype=torch.long, device=self.device)
        pixels = torch.cat([i.pixel_values for i in inputs]).to(self.device, self.visual.dtype)
        out = self.visual(pixels, grid_thw=grid).pooler_output
        return list(out.split([self.num_visual_tokens(i.grid_thw) for i in inputs]))

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

    supports_chunked_prefill = True

    @torch.inference_mode()
    def prefill_chunks(self, rows: list[PrefillChunk]) -> list[ChunkResult]:
        """Rows without a cache (whole prompts, first chunks) share one right-padded forward; a row
        that continues its cache runs alone over its chunk (caches of different lengths would
        need padding inside the cache). Every row keeps its own M-RoPE positions."""
        results: list[ChunkResult | None] = [None] * len(rows)
        fresh = [i for i, row in enumerate(rows) if row.cache is None]
        if fresh:
            for i, result in zip(fresh, self._prefill_padded([rows[i] for i in fresh]), strict=True):
                results[i] = result
        for i, row in enumerate(rows):
            if row.cache is not None:
                results[i] = self._prefill_continue(row)
        return [r for r in results if r is not None]

    def chunk_cache_to_kv(self, cache) -> KvCache:
        return KvCache.from_dynamic(cache)

    def _chunk_embeds(self, row: PrefillChunk) -> torch.Tensor:
        """[1, end - start, hidden]: token embeddings of the chunk, its visual placeholders filled."""
        lm = self._language_model()
        embeds = lm.embed_tokens(row.prompt.input_ids[:, row.start : row.end].to(self.device))
        visual = row.prompt.visual_mask[row.start : row.end]  # [n] bool
        first = int(row.prompt.visual_mask[: row.start].sum())  # visual tokens in earlier chunks
        if num := int(visual.sum()):
            chunk_visual = row.visual_embeds[first : first + num]  # [num, hidden]
            embeds[0, visual.to(self.device)] = chunk_visual.to(self.device, embeds.dtype)
        return embeds

    def _prefill_padded(self, rows: list[PrefillChunk]) -> list[ChunkResult]:
        """Rows starting at token 0, right-padded to the longest: [B, L]. No padding mask is needed:
        attention is causal and the padding comes after every valid token of its row, so no valid
        token sees it (what a valid row computes is what it computes alone, up to rounding; the
        padded positions just continue the row's own, and their outputs are cut off)."""
        from transformers import DynamicCache

        lm = self._language_model()
        lengths = [row.end for row in rows]
        batch, longest = len(rows), max(lengths)
        dtype = lm.embed_tokens.weight.dtype
        embeds = torch.zeros(batch, longest, self.hidden_size, dtype=dtype, device=self.device)  # [B, L, H]
        positions = torch.zeros(4, batch, longest, dtype=torch.long)  # [4, B, L]
        for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
            embeds[i, :n] = self._chunk_embeds(row)[0]
            positions[:, i, :n] = row.prompt.position_ids[:, 0, :n]
            positions[:, i, n:] = positions[:, i, n - 1 : n] + torch.arange(1, longest - n + 1)
        cache = DynamicCache(config=self.hf_config.text_config)
        out = lm(
            inputs_embeds=embeds,
            position_ids=positions.to(self.device),
            past_key_values=cache,
            use_cache=True,
        )
        last = out.last_hidden_state[torch.arange(batch), torch.tensor(lengths) - 1]  # [B, hidden]
        logits = self.lm_head(last[:, None])[:, 0]  # [B, vocab]
        if batch == 1 and lengths[0] == longest:
            return [ChunkResult(cache, logits[0])]
        kv = KvCache.from_dynamic(cache)  # [B, kv_heads, L, head_dim] per layer
        results = []
        for i, n in enumerate(lengths):  # each row's own cache, padding cut off (to_dynamic copies)
            row_kv = KvCache([k[i : i + 1, :, :n] for k in kv.keys], [v[i : i + 1, :, :n] for v in kv.values])
            results.append(ChunkResult(row_kv.to_dynamic(self.hf_config.text_config), logits[i]))
        return results

    def _prefill_continue(self, row: PrefillChunk) -> ChunkResult:
        """Tokens [start, end) after the row's cache of [0, start), which grows in place."""
        past = row.cache.get_seq_length()
        if past != row.start:
            raise ValueError(f"the chunk starts at token {row.start} but its cache holds {past}")
        lm = self._language_model()
        out = lm(
            inputs_embeds=self._chunk_embeds(row),
            position_ids=row.prompt.position_ids[:, :, row.start : row.end].to(self.device),
            attention_mask=torch.ones(1, row.end, dtype=torch.long, device=self.device),
            past_key_values=row.cache,
            use_cache=True,
        )
        return ChunkResult(row.cache, self.lm_head(out.last_hidden_state[:, -1:])[0, -1])

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

    supports_batched_decode = True

    @property
    def kv_bytes_per_token(self) -> int:
        c = self.hf_config.text_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        dtype = self._language_model().embed_tokens.weight.dtype
        return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * dtype.itemsize

    def new_batch_kv(self) -> BatchKv:
        c = self.hf_config.text_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        dtype = self._language_model().embed_tokens.weight.dtype
        return BatchKv(c.num_hidden_layers, c.num_key_value_heads, head_dim, dtype, self.device)

    @torch.inference_mode()
    def decode_batch(self, token_ids: list[int], position_ids: torch.Tensor, batch: BatchKv) -> torch.Tensor:
        lm = self._language_model()
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)[:, None]  # [B, 1]
        out = lm(
            inputs_embeds=lm.embed_tokens(ids),
            position_ids=position_ids[:, :, None].to(self.device),  # [4, B, 1]
            attention_mask=batch.attention_mask(),  # [B, max + 1]: each row's own columns
            past_key_values=batch.cache,
            use_cache=True,
        )
        batch.advance()
        return self.lm_head(out.last_hidden_state[:, -1])  # [B, vocab]

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # -- pruning interface -------------------------------------------------------------------

    @property
    def text_dims(self) -> TextDims:
        return dims_of(self.hf_config.text_config)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._language_model().embed_tokens(input_ids.to(self.device))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def layerwise_prefill(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> LayerwisePass:
        return QwenLayerwisePass(self._language_model(), inputs_embeds, position_ids)

    @contextmanager
    def capture_queries(self, layers: Iterable[int], query_index: torch.Tensor) -> Iterator[CapturedQueries]:
        with QueryCapture(self._language_model().layers, layers, query_index, with_keys=False) as cap:
            yield CapturedQueries(cap.queries, cap.keys)

    def decode_cache_kv(self, cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return dynamic_cache_kv(cache)

    def set_decode_cache_kv(self, cache, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        set_dynamic_cache_kv(cache, layer, keys, values)

    @property
    def num_parameters(self) -> int:
        return count_parameters(self.model, self.visual)

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
