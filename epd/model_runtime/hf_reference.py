"""The unsplit Hugging Face pipeline as its users call it: transformers' whole model, its processor,
and the processor's own inputs for a question about decoded frames. It is the reference the split
adapters must equal (tests/reference.py) and `epd bench serve`'s hf baseline times
(bench/serve_baselines.py): one definition, so that the bench measures the pipeline the tests
compare against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from epd.video.types import DecodedVideo


def question_message(video: DecodedVideo, question: str) -> list[dict]:
    """The processor's chat form of one user message: the media (an image or a video), then the question."""
    kind = "image" if video.is_image else "video"
    return [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": question}]}]


def whole_model(
    model_dir: str | Path, device: str = "cpu", dtype: torch.dtype | None = None
) -> tuple[Any, Any]:
    """(transformers' whole model, its processor), loaded as a Hugging Face user loads them."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    kwargs = {} if dtype is None else {"dtype": dtype}  # None: the checkpoint's own
    model = AutoModelForImageTextToText.from_pretrained(model_dir, **kwargs)
    model = model.to(device).eval()  # type: ignore[arg-type]  # transformers types `to` as taking a model
    return model, AutoProcessor.from_pretrained(model_dir)


def reference_inputs(processor, video: DecodedVideo, messages: list[dict], **template: bool):
    """The processor's own inputs for `messages` (its chat form, parts in order) and the media:
    `apply_chat_template` (`template`: its add_generation_prompt, default true, and
    continue_final_message), then the processor's __call__ with the frames our encoder samples, given
    as each family's adapter tests give them: Qwen2-VL / Qwen2.5-VL with the sampled frames as the
    whole clip, Qwen3-style processors (Qwen3-VL, its MoE, Qwen3.5) and GLM-4.1V's with the source's
    fps and frame indices (for their timestamp text), LLaVA-OneVision and InternVL with the frames as
    they are (their own frame sampling off)."""
    from transformers.video_utils import VideoMetadata

    template = {"add_generation_prompt": True, **template}
    text = processor.apply_chat_template(messages, tokenize=False, **template)
    if video.is_image:
        return processor(text=[text], images=[video.frames[0]], return_tensors="pt")
    kind = type(processor).__name__
    if kind.startswith(("Qwen3", "Glm4v")):
        return source_timed_inputs(processor, video, messages, **template)
    if kind.startswith(("LlavaOnevision", "InternVL")):
        return processor(text=[text], videos=[video.frames], return_tensors="pt",
                         videos_kwargs={"do_sample_frames": False})  # fmt: skip
    t = video.num_frames
    meta = VideoMetadata(total_num_frames=t, fps=video.sampled_fps, frames_indices=list(range(t)))
    return processor(
        text=[text],
        videos=[video.frames],
        return_tensors="pt",
        videos_kwargs={
            "do_sample_frames": False,
            "cap_pixels_per_frame": False,
            "video_metadata": [meta],
        },
    )


def source_timed_inputs(
    processor, video: DecodedVideo, messages: list[dict], metadata=None, **template: bool
):
    """A Qwen3-style (or GLM-4.1V) processor's own __call__ on the same frames, for `messages` (`template`:
    apply_chat_template's options). Video metadata as a user of transformers gives it (unless
    `metadata` is given): the source's fps and the decoded frames' indices in the source."""
    from transformers.video_utils import VideoMetadata

    text = processor.apply_chat_template(
        messages, tokenize=False, **{"add_generation_prompt": True, **template}
    )
    if video.is_image:
        return processor(text=[text], images=[video.frames[0]], return_tensors="pt")
    if metadata is None:
        fps = video.source_fps
        indices = [round(t * fps) for t in video.timestamps_s]
        metadata = VideoMetadata(total_num_frames=max(indices) + 1, fps=fps, frames_indices=indices)
    kwargs: dict[str, Any] = {"do_sample_frames": False, "video_metadata": [metadata]}
    if not type(processor).__name__.startswith("Glm4v"):  # GLM's bounds no frame alone: no such option
        kwargs["cap_pixels_per_frame"] = False
    return processor(text=[text], videos=[video.frames], return_tensors="pt", videos_kwargs=kwargs)
