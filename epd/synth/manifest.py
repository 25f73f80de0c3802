"""The dataset's manifest: one JSON object a line, one line per (media file, question).

Fields (all required, no others):
- id: unique, "<split>-<media_type>-<seed>-<question_type>"
- split: "train" | "validation" | "test"
- media: path of the MP4 or PNG, relative to the manifest's directory, with "/" separators
- media_type: "video" | "image"
- question, answer: lowercase text; the answer is one word of `epd.synth.questions.ANSWER_VOCAB`
- question_type: one of `epd.synth.questions.VIDEO_QUESTION_TYPES`
- seed: the generator seed of the media (`epd.synth.scene.generate_scene(seed)` remakes it)

`ManifestRecord.messages()` gives the chat a trainer or evaluator feeds a Qwen2-VL processor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from epd.synth.questions import ANSWER_VOCAB, VIDEO_QUESTION_TYPES
from epd.synth.splits import MEDIA_TYPES, SPLITS, media_type_of, split_of

MANIFEST_NAME = "manifest.jsonl"
_ANSWER_RE = re.compile(r"^[a-z]+$")


@dataclass(frozen=True)
class ManifestRecord:
    """One question about one media file (see the module docstring for each field)."""

    id: str
    split: str
    media: str
    media_type: str
    question: str
    answer: str
    question_type: str
    seed: int

    def validate(self) -> None:
        problems = []
        if self.split not in SPLITS:
            problems.append(f"split {self.split!r} is not one of {SPLITS}")
        if self.media_type not in MEDIA_TYPES:
            problems.append(f"media_type {self.media_type!r} is not one of {MEDIA_TYPES}")
        if not _ANSWER_RE.match(self.answer) or self.answer not in ANSWER_VOCAB:
            problems.append(f"answer {self.answer!r} is not a word of ANSWER_VOCAB")
        if self.question_type not in VIDEO_QUESTION_TYPES:
            problems.append(f"question_type {self.question_type!r} is unknown")
        if not self.question.endswith("?") or self.question != self.question.lower():
            problems.append(f"question {self.question!r} must be lowercase and end with '?'")
        if self.media.startswith("/") or ".." in self.media.split("/"):
            problems.append(f"media {self.media!r} must be a relative path inside the dataset")
        if self.split in SPLITS and split_of(self.seed) != self.split:
            problems.append(f"seed {self.seed} belongs to split {split_of(self.seed)!r}")
        if self.media_type in MEDIA_TYPES and media_type_of(self.seed) != self.media_type:
            problems.append(f"seed {self.seed} is an {media_type_of(self.seed)} seed")
        if problems:
            raise ValueError(f"manifest record {self.id!r}: " + "; ".join(problems))

    def media_path(self, root: str | Path) -> Path:
        """Absolute path of the media, given the manifest's directory."""
        return Path(root) / self.media

    def messages(self, with_answer: bool = False) -> list[dict]:
        """Qwen2-VL chat messages: the media then the question; the answer as the assistant turn."""
        user = {
            "role": "user",
            "content": [{"type": self.media_type}, {"type": "text", "text": self.question}],
        }
        if not with_answer:
            return [user]
        return [user, {"role": "assistant", "content": [{"type": "text", "text": self.answer}]}]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict) -> ManifestRecord:
        names = [f.name for f in fields(cls)]
        if sorted(data) != sorted(names):
            raise ValueError(f"manifest line has fields {sorted(data)}; expected exactly {sorted(names)}")
        record = cls(**data)
        record.validate()
        return record


def write_manifest(path: str | Path, records: Iterable[ManifestRecord]) -> int:
    """Write `records` as JSONL (validated, ids unique); returns how many were written."""
    seen: set[str] = set()
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            r.validate()
            if r.id in seen:
                raise ValueError(f"duplicate manifest id {r.id!r}")
            seen.add(r.id)
            f.write(r.to_json() + "\n")
    return len(seen)


def read_manifest(path: str | Path, split: str | None = None) -> list[ManifestRecord]:
    """Records of a manifest file (or a dataset directory), optionally of one split only."""
    p = Path(path)
    if p.is_dir():
        p = p / MANIFEST_NAME
    records = []
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = ManifestRecord.from_dict(json.loads(line))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{p}:{n}: {exc}") from None
            if split is None or record.split == split:
                records.append(record)
    return records
