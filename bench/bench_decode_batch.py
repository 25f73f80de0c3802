"""Decode step time against the number of requests in the batch, and the KV layout choice.

    PYTHONPATH=. python bench/bench_decode_batch.py                 # batch sizes 1, 4, 16, 32
    PYTHONPATH=. python bench/bench_decode_batch.py --batch 1 16 --steps 32 --threads 2
    PYTHONPATH=. python bench/bench_decode_batch.py --device cuda --batch 1 4 16 32 64

On bench_pruning's ~30M-parameter Qwen2-VL (8 layers, GQA 8/2 heads), with prompt caches of
different lengths (a 8-frame video prompt is ~300 tokens; lengths here spread 240-360), one
process. For each batch size B, the median time of one decode step that advances all B requests:
  * slots:      the decode core's layout (`BatchKv`): one preallocated buffer per layer, each row
                written in place at its own length, attention over a strided view (no copy);
  * gather:     what attention over paged blocks costs without a paged-attention kernel: each
                step concatenates every request's own cache into one padded batch tensor;
  * sequential: no batching (each request's `decode_step` in turn; epd before the decode core).
Printed: ms per step, ms per output token (step / B) and ratios against B = 1 and against
sequential, all measured in the same run.

    PYTHONPATH=. python bench/bench_decode_batch.py --memory --budget-requests 8 --in-flight 32

The KV budget end to end in the decode core (`LocalDecodeStage`, caches taken from an in-process
store): the budget is set to hold `--budget-requests` requests, `--in-flight` are submitted at
once; printed: the process RSS at the budget-sized level (`--budget-requests` in flight) and its
peak with `--in-flight`, the most rows ever in the batch, and whether every request finished.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_pruning import SPEC  # noqa: E402
from epd.model_runtime.adapter import VisualMeta  # noqa: E402
from epd.model_runtime.config import ModelConfig  # noqa: E402
from epd.model_runtime.kv_cache import KvCache  # noqa: E402
from epd.model_runtime.loader import load_adapter  # noqa: E402
from epd.model_runtime.tiny_model import build_checkpoint  # noqa: E402
from epd.stages.messages import question_messages, to_chat_template  # noqa: E402


def prompt_caches(adapter, batch: int) -> list[tuple[KvCache, torch.Tensor, int]]:
    """`batch` real prefills of image prompts of different sizes: (cache, next positions, token)."""
    out = []
    for i in range(batch):
        grid = (1, 28 + 2 * (i % 8), 32)  # 224-352 visual tokens
        n = adapter.num_visual_tokens(grid)
        prompt = adapter.build_prompt(
            to_chat_template(question_messages("what moves?"), "image"), VisualMeta("image", grid, 0.0, n)
        )
        state = adapter.prefill(prompt, torch.randn(n, adapter.hidden_size) * 0.02)
        out.append((state.cache, state.next_position_ids, int(state.last_logits.argmax())))
    return out


def timed_steps(step, steps: int) -> float:
    """Median ms of one `step()`, after one untimed step (on a GPU: kernels compiled and
    allocations made); on a GPU each step is waited for before the clock is read."""
    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)
    step()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def slots(adapter, caches, steps):
    batch = adapter.new_batch_kv()
    columns = max(c.num_cached_tokens for c, _, _ in caches) + steps + 2  # + the untimed step
    for cache, _, _ in caches:
        batch.add(cache, columns)
    positions = torch.stack([p for _, p, _ in caches], dim=1)
    tokens = [t for _, _, t in caches]

    def step():
        nonlocal positions
        adapter.decode_batch(tokens, positions, batch)
        positions = positions + 1

    return timed_steps(step, steps)


def gather(adapter, caches, steps):
    """Per-request caches, concatenated (left-padded) into one batch every step."""
    from transformers import DynamicCache

    own = [adapter.new_decode_cache(c) for c, _, _ in caches]
    positions = torch.stack([p for _, p, _ in caches], dim=1)
    ids = torch.tensor([t for _, _, t in caches], device=adapter.device)[:, None]
    lm = adapter.language_model

    def step():
        nonlocal positions
        lengths = [c.get_seq_length() for c in own]
        n = max(lengths)
        batch = DynamicCache(config=adapter.text_config)
        for i in range(len(own[0].layers)):
            pad = lambda t, k: torch.nn.functional.pad(t, (0, 0, n - k, 0))  # noqa: E731
            keys = torch.cat([pad(c.layers[i].keys, k) for c, k in zip(own, lengths)])
            values = torch.cat([pad(c.layers[i].values, k) for c, k in zip(own, lengths)])
            batch.update(keys, values, i)
        mask = torch.stack([torch.cat([torch.zeros(n - k), torch.ones(k + 1)]) for k in lengths]).long()
        mask = mask.to(adapter.device)
        with torch.inference_mode():
            out = lm(
                inputs_embeds=lm.embed_tokens(ids),
                position_ids=positions[:, :, None].to(adapter.device),
                attention_mask=mask,
                past_key_values=batch,
                use_cache=True,
            )
            adapter.lm_head(out.last_hidden_state[:, -1])
        for c, layer_keys in zip(own, range(len(own))):  # keep each request's cache growing too
            for i, layer in enumerate(c.layers):
                layer.keys = torch.cat(
                    [layer.keys, batch.layers[i].keys[layer_keys : layer_keys + 1, :, -1:]], -2
                )
                layer.values = torch.cat(
                    [layer.values, batch.layers[i].values[layer_keys : layer_keys + 1, :, -1:]], -2
                )
        positions = positions + 1

    return timed_steps(step, steps)


def sequential(adapter, caches, steps):
    own = [adapter.new_decode_cache(c) for c, _, _ in caches]
    positions = [p.clone() for _, p, _ in caches]
    tokens = [t for _, _, t in caches]

    def step():
        for i, cache in enumerate(own):
            adapter.decode_step(tokens[i], positions[i], cache)
            positions[i] = positions[i] + 1

    return timed_steps(step, steps)


def memory(adapter, budget_requests: int, in_flight: int, max_new: int) -> None:
    import asyncio
    import threading

    import psutil

    from epd.decode_svc.config import DecodeConfig
    from epd.decode_svc.engine import DecodeEngine
    from epd.decode_svc.stage import LocalDecodeStage, take_from_store
    from epd.model_runtime.sampling import GenerationConfig
    from epd.prefill_svc.kv_store import KvStore
    from epd.stages.contracts import PrefillHandle
    from epd.stages.model_thread import ModelThread

    caches = prompt_caches(adapter, 8)
    longest = max(c.num_cached_tokens for c, _, _ in caches) + max_new
    budget = budget_requests * longest * adapter.kv_bytes_per_token
    proc = psutil.Process()

    def run(n: int) -> tuple[float, int, int]:
        store = KvStore(1 << 34, 600.0)
        thread = ModelThread()
        stage = LocalDecodeStage(
            DecodeEngine(adapter),
            take_from_store(store),
            thread,
            DecodeConfig(kv_budget_bytes=budget, max_waiting_requests=n),
        )
        handles: list[PrefillHandle[torch.Tensor]] = []
        for i in range(n):
            cache, pos, token = caches[i % len(caches)]
            handles.append(
                PrefillHandle(
                    token,
                    0,
                    cache.num_cached_tokens,
                    [int(x) for x in pos],
                    cache.num_bytes,
                    0.0,
                    kv_handle=store.put(cache),
                )
            )
        peak, rows, stop = [0], [0], threading.Event()

        def sample():
            while not stop.wait(0.005):
                peak[0] = max(peak[0], proc.memory_info().rss)
                rows[0] = max(rows[0], stage.load().num_running)

        async def one(h):
            gen = GenerationConfig(max_new_tokens=max_new, ignore_eos=True)
            return sum([len(s.token_ids) async for s in stage.generate(h, gen, "r")])

        async def all_of():
            return await asyncio.gather(*(one(h) for h in handles))

        sampler = threading.Thread(target=sample)
        sampler.start()
        done = asyncio.run(all_of())
        stop.set()
        sampler.join()
        thread.close()
        return peak[0] / 2**20, rows[0], sum(d == max_new for d in done)

    base_rss = proc.memory_info().rss / 2**20
    level, level_rows, _ = run(budget_requests)
    peak, peak_rows, finished = run(in_flight)
    print(
        f"KV budget {budget / 2**20:.1f} MiB (holds {budget_requests} requests of {longest} tokens); "
        f"process RSS before {base_rss:.0f} MiB"
    )
    print("| in flight | peak RSS MiB | most rows in the batch | finished |")
    print("|---|---|---|---|")
    print(f"| {budget_requests} | {level:.0f} | {level_rows} | all |")
    print(f"| {in_flight} | {peak:.0f} ({peak / level:.2f}x) | {peak_rows} | {finished}/{in_flight} |")


def print_step_table(adapter, caches, batches: list[int], steps: int, where: str) -> None:
    """The step-time table for each batch size in `batches` (caches: `prompt_caches`)."""
    print(
        f"Qwen2-VL ~30M, {where}, {steps} steps per point, prompt caches "
        f"{min(c.num_cached_tokens for c, _, _ in caches)}-{max(c.num_cached_tokens for c, _, _ in caches)} tokens"
    )
    print(
        "| batch | slots ms/step | ms/token | gather ms/step | sequential ms/step | slots vs sequential | "
        "slots ms/token vs B=1 |"
    )
    print("|---|---|---|---|---|---|---|")
    base = None
    for b in batches:
        s = slots(adapter, caches[:b], steps)
        g = gather(adapter, caches[:b], steps)
        q = sequential(adapter, caches[:b], steps)
        base = base or s / b
        print(
            f"| {b} | {s:.2f} | {s / b:.2f} | {g:.2f} | {q:.2f} | {q / s:.2f}x faster | "
            f"{(s / b) / base:.2f}x |",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work-dir", default="/tmp/epd-bench-pruning")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (bench/cuda_check.py runs it on a GPU)")
    p.add_argument("--memory", action="store_true", help="the KV budget run instead of step times")
    p.add_argument("--budget-requests", type=int, default=8)
    p.add_argument("--in-flight", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = Path(args.work_dir) / "model"
    if not (model_dir / "config.json").exists():
        build_checkpoint(model_dir, SPEC)
    adapter = load_adapter(
        ModelConfig(model=str(model_dir), device=args.device, num_threads=args.threads), "decode"
    )
    if args.memory:
        memory(adapter, args.budget_requests, args.in_flight, args.max_new_tokens)
        return
    print_step_table(
        adapter,
        prompt_caches(adapter, max(args.batch)),
        args.batch,
        args.steps,
        f"{args.threads} thread(s)" if args.device == "cpu" else args.device,
    )


if __name__ == "__main__":
    main()
