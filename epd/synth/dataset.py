"""Build the synthetic video-QA dataset: media files plus one JSONL manifest.

    python -m epd.synth.dataset --out data/synth --num-train 4000 --num-validation 200 --num-test 500

writes
    data/synth/manifest.jsonl            one line per question (see epd.synth.manifest)
    data/synth/dataset_info.json         settings, answer vocabulary, counts per split and type
    data/synth/<split>/videos/<seed>.mp4 H.264 clips
    data/synth/<split>/images/<seed>.png still images

The i-th clip of a split is a fixed seed (epd.synth.splits), so a bigger build contains a smaller one
and no two splits share a seed. `--audit` re-reads every written file and checks each answer
against the decoded pixels (epd.synth.oracle); it exits non-zero on any disagreement.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from epd.synth.manifest import MANIFEST_NAME, ManifestRecord, read_manifest, write_manifest
from epd.synth.questions import ANSWER_VOCAB, QA, make_questions, tokenizer_words
from epd.synth.render import EncodeConfig, encode_mp4, encode_png, render_frame, render_frames
from epd.synth.scene import SceneConfig, generate_image_scene, generate_scene
from epd.synth.splits import SPLITS, seed_for

GENERATOR_VERSION = 1  # bump when a seed's pixels or questions change


@dataclass(frozen=True)
class DatasetConfig:
    """What to build."""

    num_videos: dict[str, int] = field(
        default_factory=lambda: {"train": 2000, "validation": 100, "test": 300}
    )
    """Clips per split."""
    image_ratio: float = 0.1
    """Still images per clip, per split (0.1: one image for every ten clips)."""
    scene: SceneConfig = SceneConfig()
    """Frame size, length, fps, object counts and sizes."""
    encode: EncodeConfig = EncodeConfig()
    """Keyframe interval and quality of the MP4s."""
    num_workers: int = 1
    """Processes rendering in parallel; the output is the same for any number."""

    def num_images(self, split: str) -> int:
        return int(round(self.num_videos.get(split, 0) * self.image_ratio))

    def validate(self) -> None:
        unknown = set(self.num_videos) - set(SPLITS)
        if unknown:
            raise ValueError(f"unknown split(s) {sorted(unknown)}; use {', '.join(SPLITS)}")
        if any(n < 0 for n in self.num_videos.values()) or self.image_ratio < 0:
            raise ValueError("clip counts and image_ratio must be >= 0")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        self.scene.validate()
        self.encode.validate()


@dataclass(frozen=True)
class _Job:
    split: str
    media_type: str
    seed: int


def media_relpath(split: str, media_type: str, seed: int) -> str:
    ext = "mp4" if media_type == "video" else "png"
    return f"{split}/{media_type}s/{seed}.{ext}"


def make_media(
    seed: int, media_type: str, scene_config: SceneConfig, encode_config: EncodeConfig
) -> tuple[bytes, list[QA]]:
    """(file bytes, questions) of one seed: the whole generator in one call."""
    if media_type == "video":
        scene = generate_scene(seed, scene_config)
        data = encode_mp4(render_frames(scene), scene_config.fps, encode_config)
    else:
        scene = generate_image_scene(seed, scene_config)
        data = encode_png(render_frame(scene, 0))
    return data, make_questions(scene)


_Args = tuple[_Job, str, SceneConfig, EncodeConfig]


def _build_one(args: _Args) -> list[ManifestRecord]:
    job, out_dir, scene_config, encode_config = args
    data, questions = make_media(job.seed, job.media_type, scene_config, encode_config)
    rel = media_relpath(job.split, job.media_type, job.seed)
    path = Path(out_dir) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return [
        ManifestRecord(
            id=f"{job.split}-{job.media_type}-{job.seed}-{qa.question_type}",
            split=job.split,
            media=rel,
            media_type=job.media_type,
            question=qa.question,
            answer=qa.answer,
            question_type=qa.question_type,
            seed=job.seed,
        )
        for qa in questions
    ]


def _jobs(config: DatasetConfig) -> list[_Job]:
    jobs = []
    for split in SPLITS:
        jobs += [
            _Job(split, "video", seed_for(split, "video", i)) for i in range(config.num_videos.get(split, 0))
        ]
        jobs += [_Job(split, "image", seed_for(split, "image", i)) for i in range(config.num_images(split))]
    return jobs


def build_dataset(
    out_dir: str | Path, config: DatasetConfig = DatasetConfig(), progress: bool = True
) -> dict:
    """Write media, manifest and info under `out_dir`; returns the info written."""
    from tqdm import tqdm

    config.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jobs = _jobs(config)
    args = [(job, str(out), config.scene, config.encode) for job in jobs]
    bar = tqdm(total=len(jobs), desc="rendering", unit="file", disable=not progress)
    records: list[ManifestRecord] = []
    for recs in _map(_build_one, args, config.num_workers):
        records += recs
        bar.update(1)
    bar.close()
    write_manifest(out / MANIFEST_NAME, records)
    info = {
        "generator_version": GENERATOR_VERSION,
        "scene": asdict(config.scene),
        "encode": asdict(config.encode),
        "num_videos": {s: config.num_videos.get(s, 0) for s in SPLITS},
        "num_images": {s: config.num_images(s) for s in SPLITS},
        "num_questions": {s: dict(Counter(r.question_type for r in records if r.split == s)) for s in SPLITS},
        "answer_vocab": list(ANSWER_VOCAB),
        "tokenizer_words": tokenizer_words(),
    }
    (out / "dataset_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def _map(
    fn: Callable[[_Args], list[ManifestRecord]], args: list[_Args], num_workers: int
) -> Iterator[list[ManifestRecord]]:
    """`map` in submission order; in a process pool when num_workers > 1."""
    if num_workers == 1:
        yield from map(fn, args)
        return
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(num_workers) as pool:
        yield from pool.imap(fn, args, chunksize=8)


def audit_dataset(out_dir: str | Path, progress: bool = True) -> dict[str, Counter]:
    """Answer every manifest question from the decoded file; {"checked"|"wrong": Counter by type}."""
    from tqdm import tqdm

    from epd.synth.measure import decode_media, track_objects
    from epd.synth.oracle import answer_from_tracks

    out = Path(out_dir)
    by_media: dict[str, list[ManifestRecord]] = {}
    for r in read_manifest(out):
        by_media.setdefault(r.media, []).append(r)
    checked: Counter = Counter()
    wrong: Counter = Counter()
    for media, recs in tqdm(by_media.items(), desc="auditing", unit="file", disable=not progress):
        frames = decode_media(out / media)
        tracks = track_objects(frames)
        for r in recs:
            checked[r.question_type] += 1
            if answer_from_tracks(tracks, len(frames), r.question_type, r.question) != r.answer:
                wrong[r.question_type] += 1
                print(f"mismatch: {r.id}: {r.question!r} labelled {r.answer!r}", file=sys.stderr)
    return {"checked": checked, "wrong": wrong}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d, s, e = DatasetConfig(), SceneConfig(), EncodeConfig()
    p = argparse.ArgumentParser(prog="python -m epd.synth.dataset", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory to write (created)")
    p.add_argument("--num-train", type=int, default=d.num_videos["train"], help="train clips")
    p.add_argument("--num-validation", type=int, default=d.num_videos["validation"], help="validation clips")
    p.add_argument("--num-test", type=int, default=d.num_videos["test"], help="test clips")
    p.add_argument("--image-ratio", type=float, default=d.image_ratio, help="still images per clip")
    p.add_argument("--width", type=int, default=s.width_px, help="frame width (even)")
    p.add_argument("--height", type=int, default=s.height_px, help="frame height (even)")
    p.add_argument("--fps", type=int, default=s.fps, help="frames per second")
    p.add_argument("--duration-s", type=float, default=s.duration_s, help="clip length in seconds")
    p.add_argument("--max-objects", type=int, default=s.max_objects, help="most objects in a clip (<= 5)")
    p.add_argument("--keyframe-interval", type=int, default=e.keyframe_interval, help="frames per GOP")
    p.add_argument("--qp", type=int, default=e.qp, help="x264 constant quantiser (lower = better)")
    p.add_argument("--workers", type=int, default=1, help="rendering processes")
    p.add_argument("--audit", action="store_true", help="check every answer against decoded pixels")
    p.add_argument("--audit-only", action="store_true", help="audit an existing --out, build nothing")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not a.audit_only:
        config = DatasetConfig(
            num_videos={"train": a.num_train, "validation": a.num_validation, "test": a.num_test},
            image_ratio=a.image_ratio,
            scene=SceneConfig(
                width_px=a.width,
                height_px=a.height,
                fps=a.fps,
                duration_s=a.duration_s,
                max_objects=a.max_objects,
            ),
            encode=EncodeConfig(keyframe_interval=a.keyframe_interval, qp=a.qp),
            num_workers=a.workers,
        )
        try:
            info = build_dataset(a.out, config)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        total = sum(sum(v.values()) for v in info["num_questions"].values())
        print(f"wrote {total} questions to {Path(a.out) / MANIFEST_NAME}")
    if a.audit or a.audit_only:
        result = audit_dataset(a.out)
        num_wrong = sum(result["wrong"].values())
        for qtype, n in sorted(result["checked"].items()):
            print(f"{qtype:>10}: {n - result['wrong'][qtype]}/{n} match the pixels")
        if num_wrong:
            print(f"error: {num_wrong} answers disagree with the decoded media", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
