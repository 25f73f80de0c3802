"""The dataset build: disjoint splits, a well-formed manifest, reproducible output, the CLI."""

import json

import pytest

from epd.synth.dataset import DatasetConfig, audit_dataset, build_dataset, main
from epd.synth.manifest import ManifestRecord, read_manifest, write_manifest
from epd.synth.splits import SPLITS, seed_for, split_of

SMALL = DatasetConfig(num_videos={"train": 4, "validation": 2, "test": 2}, image_ratio=0.5)


def test_split_seed_ranges_never_overlap():
    ranges = {s: {seed_for(s, m, i) for m in ("video", "image") for i in (0, 1, 4_999_999)} for s in SPLITS}
    for s, seeds in ranges.items():
        assert {split_of(x) for x in seeds} == {s}
    assert not ranges["train"] & ranges["validation"] and not ranges["train"] & ranges["test"]
    with pytest.raises(ValueError, match="outside 0..4999999"):
        seed_for("train", "video", 5_000_000)
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        seed_for("dev", "video", 0)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds")
    info = build_dataset(out, SMALL, progress=False)
    return out, info


def test_manifest_is_well_formed(built):
    out, info = built
    lines = (out / "manifest.jsonl").read_text().splitlines()
    records = read_manifest(out)
    assert len(records) == len(lines) > 0
    assert len({r.id for r in records}) == len(records)
    for line in lines:
        assert sorted(json.loads(line)) == sorted(
            ["id", "split", "media", "media_type", "question", "answer", "question_type", "seed"]
        )
    for r in records:
        path = r.media_path(out)
        assert path.is_file() and path.stat().st_size > 0
        assert path.suffix == (".mp4" if r.media_type == "video" else ".png")
        assert (
            path.read_bytes()[4:8] == b"ftyp"
            if r.media_type == "video"
            else path.read_bytes()[:4] == b"\x89PNG"
        )
    media = {(r.split, r.media_type, r.media) for r in records}
    for split in SPLITS:
        assert sum(1 for s, m, _ in media if s == split and m == "video") == SMALL.num_videos[split]
        assert sum(1 for s, m, _ in media if s == split and m == "image") == SMALL.num_images(split)
    counted = sum(sum(v.values()) for v in info["num_questions"].values())
    assert counted == len(records)


def test_splits_share_no_seed_or_file(built):
    out, _ = built
    records = read_manifest(out)
    seeds = {s: {r.seed for r in records if r.split == s} for s in SPLITS}
    files = {s: {r.media for r in records if r.split == s} for s in SPLITS}
    for a in SPLITS:
        for b in SPLITS:
            if a < b:
                assert not seeds[a] & seeds[b] and not files[a] & files[b]
    assert [r.split for r in read_manifest(out, split="test")] == ["test"] * sum(
        r.split == "test" for r in records
    )


def test_build_is_reproducible(built, tmp_path):
    out, _ = built
    build_dataset(tmp_path, SMALL, progress=False)
    assert (tmp_path / "manifest.jsonl").read_bytes() == (out / "manifest.jsonl").read_bytes()
    for r in read_manifest(out):
        assert r.media_path(tmp_path).read_bytes() == r.media_path(out).read_bytes()


def test_audit_passes_and_catches_a_wrong_label(built, tmp_path):
    out, _ = built
    result = audit_dataset(out, progress=False)
    assert sum(result["checked"].values()) == len(read_manifest(out)) and not result["wrong"]
    # Relabel one answer: the audit must notice.
    records = read_manifest(out)
    bad = records[0]
    other = "blue" if bad.answer != "blue" else "red"
    if bad.question_type not in ("colour", "first", "last"):
        other = {"yes": "no", "no": "yes"}.get(bad.answer, "one" if bad.answer != "one" else "two")
    records[0] = ManifestRecord(**{**bad.__dict__, "answer": other})
    write_manifest(out / "manifest.jsonl", records)
    try:
        assert sum(audit_dataset(out, progress=False)["wrong"].values()) == 1
    finally:
        records[0] = bad
        write_manifest(out / "manifest.jsonl", records)


def test_manifest_rejects_malformed_records(tmp_path):
    good = dict(
        id="train-video-0-count",
        split="train",
        media="train/videos/0.mp4",
        media_type="video",
        question="how many objects appear in the video?",
        answer="two",
        question_type="count",
        seed=0,
    )
    ManifestRecord.from_dict(good).validate()
    with pytest.raises(ValueError, match="not a word of ANSWER_VOCAB"):
        ManifestRecord.from_dict({**good, "answer": "Two"})
    with pytest.raises(ValueError, match="belongs to split 'test'"):
        ManifestRecord.from_dict({**good, "seed": seed_for("test", "video", 0)})
    with pytest.raises(ValueError, match="expected exactly"):
        ManifestRecord.from_dict({k: v for k, v in good.items() if k != "seed"})
    with pytest.raises(ValueError, match="relative path"):
        ManifestRecord.from_dict({**good, "media": "../x.mp4"})
    path = tmp_path / "manifest.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "split": "dev"}) + "\n")
    with pytest.raises(ValueError, match=r"manifest.jsonl:2: .*split 'dev'"):
        read_manifest(path)
    with pytest.raises(ValueError, match="duplicate manifest id"):
        write_manifest(path, [ManifestRecord(**good)] * 2)


def test_messages_put_the_media_before_the_question():
    r = ManifestRecord(
        "i", "train", "train/videos/0.mp4", "video", "what colour is the circle?", "red", "colour", 0
    )
    assert r.messages() == [
        {
            "role": "user",
            "content": [{"type": "video"}, {"type": "text", "text": "what colour is the circle?"}],
        }
    ]
    assert r.messages(with_answer=True)[1] == {
        "role": "assistant",
        "content": [{"type": "text", "text": "red"}],
    }


def test_cli_builds_and_audits(tmp_path, capsys):
    rc = main(
        [
            "--out",
            str(tmp_path),
            "--num-train",
            "2",
            "--num-validation",
            "1",
            "--num-test",
            "1",
            "--image-ratio",
            "0",
            "--width",
            "128",
            "--height",
            "96",
            "--keyframe-interval",
            "4",
            "--audit",
        ]
    )
    assert rc == 0
    assert "match the pixels" in capsys.readouterr().out
    info = json.loads((tmp_path / "dataset_info.json").read_text())
    assert info["scene"]["width_px"] == 128 and info["encode"]["keyframe_interval"] == 4
    assert main(["--out", str(tmp_path / "x"), "--width", "111"]) == 2
    assert "must be even" in capsys.readouterr().err
