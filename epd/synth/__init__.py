"""Synthetic video-QA data: seeded clips of coloured shapes, questions, answers, splits.

- `scene`: the seeded description of a clip (objects, paths, timings, end event).
- `render`: frames drawn from a scene; H.264 MP4 and PNG encoding.
- `questions`: questions and one-word answers a scene supports; the answer vocabulary.
- `splits`: disjoint seed ranges for train / validation / test.
- `manifest`: the JSONL record format, reading, writing and validation.
- `dataset`: `python -m epd.synth.dataset`, the builder and the pixel audit.
- `measure`, `oracle`: objects read back from decoded pixels, and answers from them.
- `sample`: `python -m epd.synth.sample`, the bundled samples/sample.mp4.
"""
