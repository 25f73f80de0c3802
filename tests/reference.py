"""The unsplit Hugging Face reference: processor + `model.generate(do_sample=False)` (its model and
inputs from `epd.model_runtime.hf_reference`, which bench/serve_baselines.py's hf baseline uses too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from epd.model_runtime.hf_reference import question_message, reference_inputs, whole_model
from epd.video import simple_decoder
from epd.video.types import DecodedVideo, SamplingOptions


def decode_for_test(path: Path, num_frames: int) -> DecodedVideo:
    """The frames our encoder samples for `num_frames` (the same reference decoder)."""
    return simple_decoder.decode(path.read_bytes(), SamplingOptions(num_frames=num_frames))


def reference_tokens(
    model_dir: Path,
    video: DecodedVideo,
    question: str,
    max_new_tokens: int,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    **generate_kwargs: Any,
) -> list[int]:
    """The reference for one question: the user message [media, question]. `generate_kwargs` go to
    `generate` (e.g. repetition_penalty, min_new_tokens, logits_processor)."""
    return reference_tokens_for_messages(
        model_dir, video, question_message(video, question), max_new_tokens, device, dtype, **generate_kwargs
    )


def reference_tokens_for_messages(
    model_dir: Path,
    video: DecodedVideo,
    messages: list[dict],
    max_new_tokens: int,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    **generate_kwargs: Any,
) -> list[int]:
    """`model.generate(do_sample=False)` on the unsplit model, prompted by the processor's own chat
    template for `messages`."""
    model, processor = whole_model(model_dir, device, dtype)
    inputs = reference_inputs(processor, video, messages).to(device)
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, **generate_kwargs)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def text_only_reference(model_dir, messages: list[dict], max_new_tokens: int) -> list[int]:
    """`generate(do_sample=False)` on the unsplit model, prompted by the processor itself with the
    text alone (no images, no videos: as a Hugging Face user calls it)."""
    return template_reference(model_dir, messages, max_new_tokens)[1]


def template_reference(
    model_dir, messages: list[dict], max_new_tokens: int, video: DecodedVideo | None = None, **template: bool
) -> tuple[list[int], list[int]]:
    """(prompt ids, `generate(do_sample=False)`'s new tokens) on the unsplit model, prompted by
    the processor's own `apply_chat_template(messages, **template)`: add_generation_prompt
    (default true) and continue_final_message (with add_generation_prompt=False, the last message
    left open: "assistant prefill"); with `video`'s frames (`reference_inputs`), or the text alone."""
    model, processor = whole_model(model_dir)
    if video is not None:
        inputs = reference_inputs(processor, video, messages, **template)
    else:
        text = processor.apply_chat_template(
            messages, tokenize=False, **{"add_generation_prompt": True, **template}
        )
        inputs = processor(text=[text], return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    num_prompt_tokens = inputs["input_ids"].shape[1]
    return out[0, :num_prompt_tokens].tolist(), out[0, num_prompt_tokens:].tolist()


def raw_reference(model_dir, prompt: str, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(tokenizer(prompt).input_ids, generate(those ids, do_sample=False)'s new tokens) on the
    unsplit model: how a Hugging Face user continues a raw prompt (no chat template)."""
    model, processor = whole_model(model_dir)
    ids = processor.tokenizer(prompt).input_ids
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
        )
    return ids, out[0, len(ids) :].tolist()


def divergence_margin(
    model_dir: Path,
    video: DecodedVideo,
    question: str,
    want: list[int],
    got: list[int],
    device: str = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[int, float] | None:
    """Where `got` first leaves `want` (generate()'s tokens) and by how much the reference model
    preferred its own token there: (index, logit[want] - logit[got]); None when they are equal.

    A batched forward may round differently from a single one (other matrix shapes, other
    summation order), so a token may flip where the model's top two were within rounding of each
    other: a small margin is such a near-tie; a large one is a real error."""
    if got == want:
        return None
    i = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    if i >= min(len(want), len(got)):
        return i, float("inf")  # one stopped early: not a rounding difference
    model, processor = whole_model(model_dir, device, dtype)
    inputs = reference_inputs(processor, video, question_message(video, question)).to(device)
    with torch.inference_mode():
        out = model.generate(
            **inputs, do_sample=False, max_new_tokens=i + 1, output_logits=True, return_dict_in_generate=True
        )
    logits = out.logits[i][0]
    return i, float(logits[want[i]] - logits[got[i]])


def prompt_inputs(
    processor,
    messages: list[dict] | None = None,
    video: DecodedVideo | None = None,
    prompt: str | None = None,
) -> dict:
    """The unsplit model's inputs for a chat conversation (`messages`, with `video`'s frames or
    text alone, the processor's own template) or a raw `prompt` (`tokenizer(prompt)`, no template)."""
    if prompt is not None:
        ids = processor.tokenizer(prompt).input_ids
        return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    if video is not None:
        return reference_inputs(processor, video, messages or [])
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return processor(text=[text], return_tensors="pt")


def logprobs_reference(
    model_dir,
    max_new_tokens: int,
    messages: list[dict] | None = None,
    video: DecodedVideo | None = None,
    prompt: str | None = None,
) -> tuple[list[int], torch.Tensor]:
    """(`generate(do_sample=False)`'s new tokens, the log-probabilities of its raw logits
    [max_new_tokens, vocab] float32: `torch.log_softmax(output_logits)`) on the unsplit model, for
    a chat conversation (`messages`, with `video`'s frames or text alone, the processor's own
    template) or a raw `prompt` (`tokenizer(prompt)`, no template)."""
    model, processor = whole_model(model_dir)
    inputs = prompt_inputs(processor, messages, video, prompt)
    with torch.inference_mode():
        out = model.generate(
            **inputs, do_sample=False, max_new_tokens=max_new_tokens, output_logits=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    num_prompt_tokens = inputs["input_ids"].shape[1]
    logits = torch.stack(out.logits)[:, 0]  # [new tokens, vocab]: one per step, before any processor
    return out.sequences[0, num_prompt_tokens:].tolist(), torch.log_softmax(logits.float(), dim=-1)
