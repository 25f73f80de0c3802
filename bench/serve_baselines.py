"""`epd bench serve`'s baselines, on the stack's inputs and model, one request at a time:
`run_hf_baseline` (the monolithic Hugging Face pipeline: sequential frame decoding, the processor
and `generate()` on the unsplit model) and `run_embedded_baseline` (epd's in-process pipeline, no
gRPC). Each returns the per-request results and the run's duration, as the stack's runs do."""

from __future__ import annotations

import asyncio
import time

from epd.bench.serve_requests import RequestResult


def run_hf_baseline(args, inputs, progress) -> tuple[list[RequestResult], float]:
    """processor + generate() on the unsplit model, sequential decoding, one at a time: the
    model and inputs the exactness tests compare against (`epd.model_runtime.hf_reference`)."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    from epd.model_runtime.hf_reference import question_message, reference_inputs, whole_model
    from epd.model_runtime.loader import resolve_model_path
    from epd.video import simple_decoder
    from epd.video.types import SamplingOptions

    torch.set_num_threads(args.threads)
    model, processor = whole_model(resolve_model_path(args.model))

    class Clock(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []
            self.first = True

        def put(self, value):
            if self.first:  # generate() puts the prompt first
                self.first = False
                return
            self.times.append(time.perf_counter())

        def end(self):
            pass

    results = []
    start = time.perf_counter()
    for data, question in inputs:
        t0 = time.perf_counter()
        video = simple_decoder.decode(data, SamplingOptions(num_frames=args.num_frames))
        inputs_ = reference_inputs(processor, video, question_message(video, question))
        clock = Clock()
        kwargs = {"min_new_tokens": args.max_new_tokens} if args.ignore_eos else {}
        with torch.inference_mode():
            model.generate(
                **inputs_, do_sample=False, max_new_tokens=args.max_new_tokens, streamer=clock, **kwargs
            )
        times = clock.times
        r = RequestResult(ok=True, e2e_ms=(time.perf_counter() - t0) * 1e3, num_output_tokens=len(times))
        if times:
            r.ttft_ms = (times[0] - t0) * 1e3
            r.itl_ms = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
        results.append(r)
        progress.update(1)
    return results, time.perf_counter() - start


def run_embedded_baseline(args, inputs, progress) -> tuple[list[RequestResult], float]:
    from epd.gateway.ask_types import AskRequest
    from epd.gateway.embedded import build_embedded_pipeline
    from epd.model_runtime.config import ModelConfig
    from epd.model_runtime.sampling import GenerationConfig
    from epd.stages.contracts import MediaInput, TokenStep
    from epd.stages.messages import question_messages
    from epd.video.types import SamplingOptions

    pipeline = build_embedded_pipeline(ModelConfig(model=args.model, num_threads=args.threads))

    async def run():
        results = []
        start = time.perf_counter()
        for data, question in inputs:
            req = AskRequest(
                question_messages(question),
                MediaInput(data),
                SamplingOptions(num_frames=args.num_frames),
                GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos),
            )
            t0 = last = time.perf_counter()
            r = RequestResult(ok=True)
            async for item in pipeline.ask(req):
                if isinstance(item, TokenStep):
                    now = time.perf_counter()
                    if r.num_output_tokens == 0:
                        r.ttft_ms = (now - t0) * 1e3
                    else:
                        r.itl_ms.append((now - last) * 1e3)
                    last = now
                    r.num_output_tokens += len(item.token_ids)
            r.e2e_ms = (time.perf_counter() - t0) * 1e3
            results.append(r)
            progress.update(1)
        return results, time.perf_counter() - start

    return asyncio.run(run())
