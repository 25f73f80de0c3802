"""Accuracy of a model on prepared examples, per question type.

It is greedy exact match computed in one teacher-forced forward pass: greedy decoding produces
exactly "answer<|im_end|>" if and only if every one of those tokens is the argmax given the ones
before it. `epd bench quality` measures the same thing through the serving pipeline."""

from __future__ import annotations

from collections import Counter

import torch

from epd.train.batches import collate
from epd.train.prepare import Example, MediaItem


@torch.no_grad()
def evaluate(
    model, examples: list[Example], media: list[MediaItem], pad_id: int, batch_size: int = 32
) -> dict[str, tuple[int, int]]:
    """{question_type: (correct, total)}: greedy exact match, teacher-forced (module docstring)."""
    model.eval()
    correct: Counter = Counter()
    total: Counter = Counter()
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        inputs = collate(batch, media, pad_id)
        labels = inputs.pop("labels")
        logits = model(**inputs).logits  # [B, L, vocab]
        predicted = logits[:, :-1].argmax(-1)
        target = labels[:, 1:]
        supervised = target != -100
        ok = ((predicted == target) | ~supervised).all(dim=1)
        for e, good in zip(batch, ok.tolist()):
            total[e.question_type] += 1
            correct[e.question_type] += int(good)
    model.train()
    return {t: (correct[t], total[t]) for t in sorted(total)}


def overall(by_type: dict[str, tuple[int, int]]) -> float:
    c = sum(v[0] for v in by_type.values())
    n = sum(v[1] for v in by_type.values())
    return c / max(n, 1)


def format_accuracy(by_type: dict[str, tuple[int, int]]) -> str:
    parts = [f"{t} {c / n:.0%}" for t, (c, n) in by_type.items()]
    return f"overall {overall(by_type):.1%} | " + ", ".join(parts)
