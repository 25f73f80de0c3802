"""The prefix cache's key (`PrefixCache`, whose keys are opaque): what makes two prompts with the
same token ids have different KV."""

from __future__ import annotations

import hashlib

import torch

from epd.stages.contracts import EncodedMedia
from epd.token_pruning import PruningConfig


def prefix_cache_key(
    fingerprint: str,
    media: EncodedMedia | None,
    pruning: PruningConfig,
    cache_salt: str = "",
    raw: bool = False,
) -> tuple:
    """What makes two prompts with the same token ids have different KV: the model, the media
    as encoded (hash, grid, frames sampled, encoder pruning, and a digest of the embeddings
    themselves, so that different encodes never match) and how the cache is kept (kv_dtype);
    and whose it is (`cache_salt`, the tenant: the same video's embeddings are equal for
    every tenant, so without it one tenant's follow-up would reuse another's KV). A text-only
    conversation's key names no media, so it never matches a media request's (whose token
    ids differ anyway: the placeholders), and its follow-ups find it as a video's do. A raw
    prompt's (`raw`) names neither: a raw prompt continues only raw prompts that begin alike,
    never a chat prompt whose rendered text it happens to spell."""
    if raw:
        return (fingerprint, "raw prompt", pruning.kv_dtype, cache_salt)
    if media is None:
        return (fingerprint, "text only", pruning.kv_dtype, cache_salt)
    digest = hashlib.sha256()
    for tensor in (media.embeds, *media.deepstack):  # ~5 ms per 7 MB
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    meta = media.meta
    return (
        fingerprint,
        media.sha256,
        meta.modality,
        tuple(meta.grid_thw),
        meta.second_per_grid_t,
        tuple(meta.group_timestamps_s),
        meta.num_visual_tokens,
        tuple(media.frame_timestamps_s),
        None if media.token_index is None else tuple(media.token_index.tolist()),
        tuple((s.stage, s.num_visual_tokens_in, s.num_visual_tokens_out) for s in media.pruning.stages),
        pruning.kv_dtype,
        digest.hexdigest(),
        cache_salt,
    )
