"""Model inputs of a batch of prepared examples: padded and collated (`collate`), or with the
vision tower run once per distinct media file and its embeddings put in place
(`shared_vision_inputs`); a phase-2 step's examples and media, some clips mirrored left-right
with their answers (`step_inputs`)."""

from __future__ import annotations

import torch

from epd.train.augment import mirror_answer, mirror_pixels, mirror_sequence, mirror_targets
from epd.train.prepare import Example, MediaItem


def collate(batch: list[Example], media: list[MediaItem], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded model inputs; visual inputs concatenated in batch order (the model scatters
    them into the placeholders in that order)."""
    length = max(len(e.input_ids) for e in batch)
    n = len(batch)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    labels = torch.full((n, length), -100, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    positions = torch.zeros((4, n, length), dtype=torch.long)
    video_pix, video_grid, image_pix, image_grid = [], [], [], []
    for row, e in enumerate(batch):
        L = len(e.input_ids)
        input_ids[row, :L] = e.input_ids
        labels[row, :L] = e.labels
        attention[row, :L] = 1
        positions[:, row, :L] = e.position_ids
        positions[:, row, L:] = e.position_ids[:, -1:] + torch.arange(1, length - L + 1)
        m = media[e.media_index]
        if m.modality == "video":
            video_pix.append(m.pixel_values())
            video_grid.append(m.grid_thw)
        else:
            image_pix.append(m.pixel_values())
            image_grid.append(m.grid_thw)
    out = {"input_ids": input_ids, "attention_mask": attention, "position_ids": positions, "labels": labels}
    if video_pix:
        out["pixel_values_videos"] = torch.cat(video_pix)
        out["video_grid_thw"] = torch.tensor(video_grid, dtype=torch.long)
    if image_pix:
        out["pixel_values"] = torch.cat(image_pix)
        out["image_grid_thw"] = torch.tensor(image_grid, dtype=torch.long)
    return out


def shared_vision_inputs(
    model,
    batch: list[Example],
    media: list[MediaItem],
    pad_id: int,
    frozen: list[torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[int]]:
    """Model inputs with the visual embeddings already in place, the vision tower run once per
    distinct media file of the batch (several questions share a clip).

    The same computation as `model(**collate(batch))`, where the model runs the tower once per
    question: the tower sees one file at a time (attention within a temporal patch group), and
    the embeddings go into the placeholder tokens in batch order. Also returns the tower's output
    [sum of merged tokens, hidden] and the media indices it covers, in order. frozen: the tower's
    output per media file, computed once (a frozen tower), used instead of running it."""
    inputs = collate(batch, [MediaItem(m.modality, m.patches[:0], m.grid_thw) for m in media], pad_id)
    for key in ("pixel_values_videos", "pixel_values", "video_grid_thw", "image_grid_thw"):
        inputs.pop(key, None)
    distinct = sorted({e.media_index for e in batch})
    if frozen is not None:
        per_media = {i: frozen[i] for i in distinct}
        visual = torch.cat([frozen[i] for i in distinct])
    else:
        pixels = torch.cat([media[i].pixel_values() for i in distinct])
        grids = torch.tensor([media[i].grid_thw for i in distinct], dtype=torch.long)
        out = model.model.visual(pixels, grid_thw=grids)
        visual = out.pooler_output  # [sum tokens, hidden]
        sizes = [int(t * h * w) // 4 for t, h, w in grids.tolist()]
        per_media = dict(zip(distinct, torch.split(visual, sizes)))
        deepstack = getattr(out, "deepstack_features", None)  # Qwen3-VL only
        if deepstack:
            inputs.update(
                _deepstack_inputs(
                    batch, media, per_media, [dict(zip(distinct, torch.split(d, sizes))) for d in deepstack]
                )
            )
            return inputs, visual, distinct
    input_ids = inputs.pop("input_ids")
    embeds = model.model.get_input_embeddings()(input_ids)  # [B, L, hidden]
    cfg = model.config
    mask = (input_ids == cfg.video_token_id) | (input_ids == cfg.image_token_id)
    fill = torch.cat([per_media[e.media_index] for e in batch])
    inputs["inputs_embeds"] = embeds.masked_scatter(mask[..., None].expand_as(embeds), fill)
    return inputs, visual, distinct


def _deepstack_inputs(
    batch: list[Example],
    media: list[MediaItem],
    per_media: dict[int, torch.Tensor],
    deepstack: list[dict[int, torch.Tensor]],
) -> dict:
    """Qwen3-VL's part of `shared_vision_inputs`: the tower's output and its DeepStack features
    (one per `deepstack_visual_indexes` layer, row for row with the output) given to the model as
    `mm_encoder_outputs`, one entry per question in batch order, per modality, as its own forward
    would have computed them; the model puts them in place (embeddings into the placeholders,
    DeepStack features added after its first language layers)."""
    from types import SimpleNamespace

    out = {}
    for modality in ("video", "image"):
        rows = [e.media_index for e in batch if media[e.media_index].modality == modality]
        if rows:
            out[modality] = SimpleNamespace(
                pooler_output=[per_media[i] for i in rows],
                deepstack_features=[[d[i] for i in rows] for d in deepstack],
            )
    return {"mm_encoder_outputs": out}


def mirror_media(m: MediaItem) -> MediaItem:
    return MediaItem(
        m.modality,
        mirror_pixels(m.patches, m.grid_thw),
        m.grid_thw,
        None if m.aux is None else mirror_targets(m.aux, m.grid_thw),
        m.codec,
    )


def step_inputs(
    idx: list[int],
    flips: list[bool],
    questions_of: dict[int, list[Example]],
    media: list[MediaItem],
    answer_ids: dict[str, torch.Tensor],
) -> tuple[list[Example], list[MediaItem]]:
    """The examples and media of one phase-2 step, renumbered 0..len(idx)-1, the flipped clips
    mirrored with their answers."""
    batch: list[Example] = []
    local: list[MediaItem] = []
    for j, (i, flip) in enumerate(zip(idx, flips)):
        local.append(mirror_media(media[i]) if flip else media[i])
        for e in questions_of[i]:
            if flip:
                ids, positions, labels = mirror_sequence(
                    e.input_ids, e.position_ids, e.labels, e.answer, answer_ids
                )
                batch.append(Example(j, ids, positions, labels, e.question_type, mirror_answer(e.answer)))
            else:
                batch.append(Example(j, e.input_ids, e.position_ids, e.labels, e.question_type, e.answer))
    return batch, local
