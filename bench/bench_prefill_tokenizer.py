"""What prefill's /tokenize tokenizer costs with a Qwen2-sized vocabulary: memory and start-up of a
prefill process, and /tokenize's latency beside the model thread's tokenisation.

    PYTHONPATH=. .venv/bin/python bench/bench_prefill_tokenizer.py --runs 3 --baseline-rev REV
    PYTHONPATH=. .venv/bin/python bench/bench_prefill_tokenizer.py --skip-process --num-calls 400

No checkpoint can be downloaded here, so the model is a tiny Qwen2-VL (`epd.model_runtime.tiny_model`,
its embedding 151,936 rows as Qwen2-VL's) whose tokenizer is a stand-in of Qwen2's size: a
byte-level BPE of 151,643 tokens (the 256 byte symbols and 151,387 merges, Qwen2's counts), Qwen2's
normalizer, pre-tokenizer and decoder, and Qwen2-VL's 22 special tokens from id 151,643. Its merges
are generated (the default prompt's words first, then random pairs of up to 10 symbols; a mean
token of 8.3 symbols), so its ids mean nothing, but the structures a process holds for it
(vocabulary, reverse vocabulary, merge table, added tokens) have Qwen2's numbers of entries.

1. process (skipped with --skip-process): a real prefill process (`epd serve prefill`) on that model,
   at this tree and at --baseline-rev (`git archive REV`, e.g. the commit before a change), the runs
   alternating: seconds from launch to SERVING (gRPC health), then its PSS, RSS and USS
   (/proc/PID/smaps_rollup) idle after start-up, and again after --num-tokenize-rpcs
   PrefillService.Tokenize calls one after another: a busy spell, after which the process hands
   its allocator's free memory back (`epd.transport.idle_memory`; start-up alone does not).
2. threads: in this process, one tokenizer (the adapter's) used the ways prefill can use it: a
   "model thread" tokenises prompts of --prompt-chars characters as `render` does
   (`build_prompt` of a text-only conversation) in a loop, while --num-calls /tokenize calls of a
   short prompt (`tokenize`) run one after another on a second thread. Designs:
     alone   /tokenize with nothing else running (the baseline);
     shared  both threads call the one tokenizer at once (this tree: nothing in prefill changes the
             tokenizer's truncation or padding, so no call waits for or disturbs another);
     lock    the one tokenizer under a lock both threads take (a /tokenize waits for the model
             thread's tokenisation in progress);
     copy    the /tokenize thread with a deep copy of the tokenizer and processor (what prefill kept
             before: 2x the tokenizer's memory).
   Printed: /tokenize p50/p99 ms and its p50 ratio to alone's, and the model thread's median
   tokenisation ms per prompt (what a prefill step waits for) beside its time with no /tokenize;
   first, the copy design's deep copy: its seconds and RSS, right after and after `malloc_trim`
   (loaded on one thread, copied on another, as a prefill process did).
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import ctypes.util
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import run_bench, start_server, takes_ports_file  # noqa: E402
from epd.transport.ports_file import free_port  # noqa: E402

QWEN2_NUM_MERGES = 151_387  # Qwen2's tokenizer.json: 256 byte symbols + 151,387 merges = 151,643 tokens
QWEN2_VL_VOCAB = 151_936  # Qwen2-VL's config.json vocab_size (embedding rows)
QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_VL_SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]  # fmt: skip
SHORT_PROMPT = (
    "You are looking at a short video of coloured shapes moving on a plain background. "
    "Describe which shapes appear, in which order, where each one moves and what happens at the end."
)
MiB = 1 << 20
IDLE_WAIT_S = 3.0
"""Before reading a process's memory: it hands free memory back at its first idle 0.5 s tick
(`epd.transport.idle_memory`), and the numbers settle."""


def qwen2_sized_tokenizer(seed: int = 0):
    """A `tokenizers.Tokenizer` with Qwen2's components and sizes (see the module docstring)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[str, str]] = []

    def merge(a: str, b: str) -> None:
        if a + b not in vocab:
            vocab[a + b] = len(tokens)
            tokens.append(a + b)
            merges.append((a, b))

    for word in SHORT_PROMPT.lower().replace(".", "").replace(",", "").split():
        for piece in (word, "Ġ" + word):  # "Ġ": byte-level's space
            for end in range(2, len(piece) + 1):
                merge(piece[: end - 1], piece[end - 1])
    rng = random.Random(seed)
    while len(merges) < QWEN2_NUM_MERGES:
        a, b = tokens[rng.randrange(min(len(tokens), 30_000))], tokens[rng.randrange(min(len(tokens), 2_000))]
        if len(a) + len(b) <= 10:
            merge(a, b)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN2_VL_SPECIAL])
    return tok


def build_checkpoint(out: Path) -> Path:
    """The tiny Qwen2-VL with the Qwen2-sized tokenizer, saved as a checkpoint."""
    from transformers import PreTrainedTokenizerFast, Qwen2VLProcessor

    from epd.model_runtime.tiny_model import CHAT_TEMPLATE, TinyVLMSpec, build_model, build_processor

    spec = TinyVLMSpec(vocab_size=QWEN2_VL_VOCAB)
    tiny = build_processor(TinyVLMSpec())  # its image and video processors
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=qwen2_sized_tokenizer(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    processor = Qwen2VLProcessor(
        image_processor=tiny.image_processor,
        tokenizer=tokenizer,
        video_processor=tiny.video_processor,
        chat_template=CHAT_TEMPLATE,
    )
    model = build_model(spec, tokenizer)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


# -- 1. a prefill process ------------------------------------------------------------------------


def checkout(rev: str) -> Path:
    """`git archive REV` unpacked in a temporary directory (read-only use of the repository)."""
    root = Path(tempfile.mkdtemp(prefix="epd-tokenizer-"))
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root


def memory_bytes(pid: int | str) -> dict[str, int]:
    """PSS (issue #13's measure: shared pages split between the processes that map them, so it
    moves with what else runs), RSS, and USS (the process's private pages: what it alone holds)."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0]) * 1024
    return {
        "pss": fields["Pss"],
        "rss": fields["Rss"],
        "uss": fields["Private_Clean"] + fields["Private_Dirty"],
    }


def tokenize_rpcs(address: str, num_calls: int) -> None:
    import grpc

    from epd.v1 import prefill_pb2, prefill_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = prefill_pb2_grpc.PrefillServiceStub(channel)
        for i in range(num_calls):
            result = stub.Tokenize(prefill_pb2.TokenizeRequest(request_id=f"b{i}", prompt=SHORT_PROMPT))
            if not result.token_ids:
                raise SystemExit("bench_prefill_tokenizer: a Tokenize call gave no ids")


def prefill_once(root: Path, model: Path, num_rpcs: int, timeout_s: float) -> dict[str, float]:
    """Launch -> SERVING seconds, then PSS/RSS idle and after `num_rpcs` Tokenize calls."""
    from epd.bench.bench_faults import is_serving  # bench/ sits below the CLI: not epd.cli.health

    # The port it binds itself, from its --ports-file; one picked here for a revision from before it.
    ports_file = Path(tempfile.mkdtemp(prefix="epd-tokenizer-ports-")) / "ports.json"
    port = 0 if takes_ports_file(root, "prefill") else free_port()
    ports = ["--port", str(port), *(["--ports-file", str(ports_file)] if port == 0 else [])]
    cmd = [sys.executable, "-m", "epd.cli.main", "serve", "prefill", *ports, "--model", str(model),
           "--num-threads", "1", "--insecure-no-internal-auth"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = start_server(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        address = f"127.0.0.1:{port}" if port else ""
        while True:
            if not address and ports_file.exists():  # it has bound (a stage does before it loads)
                address = f"127.0.0.1:{json.loads(ports_file.read_text())['grpc']}"
            if address and is_serving(address, timeout_s=1.0):
                break
            if proc.poll() is not None or time.perf_counter() - t0 > timeout_s:
                proc.kill()  # reading stderr of one still running would wait for it to exit
                _, stderr = proc.communicate()
                raise SystemExit(f"prefill at {root} did not start: {stderr[-2000:]!r}")
            time.sleep(0.05)
        out = {"startup_s": time.perf_counter() - t0}
        time.sleep(IDLE_WAIT_S)
        out.update({f"{k}_idle": v for k, v in memory_bytes(proc.pid).items()})
        tokenize_rpcs(address, num_rpcs)
        time.sleep(IDLE_WAIT_S)
        out.update({f"{k}_tokenized": v for k, v in memory_bytes(proc.pid).items()})
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(ports_file.parent, ignore_errors=True)


def process_part(model: Path, args) -> None:
    trees = {"now": REPO}
    if args.baseline_rev:
        trees[args.baseline_rev] = checkout(args.baseline_rev)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for i in range(args.runs):
        for name, root in trees.items():
            r = prefill_once(root, model, args.num_tokenize_rpcs, args.timeout_s)
            runs[name].append(r)
            print(f"  run {i + 1} {name:>10}: start-up {r['startup_s']:.2f} s; idle PSS / RSS / USS "
                  f"{r['pss_idle'] / MiB:.1f} / {r['rss_idle'] / MiB:.1f} / {r['uss_idle'] / MiB:.1f} MiB; after "
                  f"{args.num_tokenize_rpcs} Tokenize {r['pss_tokenized'] / MiB:.1f} / {r['rss_tokenized'] / MiB:.1f} / "
                  f"{r['uss_tokenized'] / MiB:.1f} MiB", flush=True)  # fmt: skip
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    keys = [f"{k}_{when}" for when in ("idle", "tokenized") for k in ("pss", "rss", "uss")]
    print("| medians | start-up s | " + " | ".join(f"{k} MiB" for k in keys) + " |")
    print("|---" * (len(keys) + 2) + "|")
    for name, m in med.items():
        print(f"| {name} | {m['startup_s']:.2f} | " + " | ".join(f"{m[k] / MiB:.1f}" for k in keys) + " |")
    if args.baseline_rev:
        now, base = med["now"], med[args.baseline_rev]
        diffs = " | ".join(f"{(now[k] - base[k]) / MiB:+.1f}" for k in keys)
        ratios = " | ".join(f"{now[k] / base[k]:.3f}x" for k in keys)
        print(f"| now - {args.baseline_rev} | {now['startup_s'] - base['startup_s']:+.2f} | {diffs} |")
        print(f"| now / {args.baseline_rev} | {now['startup_s'] / base['startup_s']:.2f}x | {ratios} |")
        shutil.rmtree(trees[args.baseline_rev], ignore_errors=True)


# -- 2. two threads on one tokenizer -------------------------------------------------------------


def conversation(text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}]}]


def threads_part(model: Path, args) -> None:
    from epd.model_runtime.config import ModelConfig
    from epd.model_runtime.loader import load_adapter

    # Loaded on another thread and copied on this one, as a prefill process loads on its model
    # thread and built the copy on its event loop's: where the allocator keeps what it frees matters.
    loaded: list = []
    loader = threading.Thread(
        target=lambda: loaded.append(load_adapter(ModelConfig(model=str(model)), "prefill"))
    )
    loader.start()
    loader.join()
    adapter = loaded[0]
    gc.collect()
    malloc_trim = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    malloc_trim(0)
    before = memory_bytes("self")
    t0 = time.perf_counter()
    twin = copy.copy(adapter)
    twin.tokenizer, twin.processor = copy.deepcopy((adapter.tokenizer, adapter.processor))
    seconds = time.perf_counter() - t0
    gc.collect()
    after = memory_bytes("self")
    malloc_trim(0)  # what a serving process does at its first idle tick after a busy one
    trimmed = memory_bytes("self")
    print(f"  the copy design's deep copy of the tokenizer and processor: {seconds:.2f} s, RSS "
          f"{(after['rss'] - before['rss']) / MiB:+.1f} MiB, after malloc_trim "
          f"{(trimmed['rss'] - before['rss']) / MiB:+.1f} MiB")  # fmt: skip
    words = (SHORT_PROMPT + " ").split()
    long_text = " ".join(words[i % len(words)] + str(i % 97) for i in range(args.prompt_chars // 6))
    long_conv = conversation(long_text[: args.prompt_chars])
    expected_long = adapter.build_prompt(long_conv, None).input_ids[0].tolist()
    expected_short = adapter.tokenize(SHORT_PROMPT, True)
    lock = threading.Lock()

    def model_loop(stop: threading.Event, locked: bool, out: list[float]) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            with lock if locked else _nothing():
                ids = adapter.build_prompt(long_conv, None).input_ids[0].tolist()
            out.append((time.perf_counter() - t) * 1e3)
            if ids != expected_long:
                raise SystemExit("bench_prefill_tokenizer: the model thread's ids changed")

    model_alone: list[float] = []
    stop = threading.Event()
    worker = threading.Thread(target=model_loop, args=(stop, False, model_alone))
    worker.start()
    time.sleep(args.model_alone_s)
    stop.set()
    worker.join()
    print(f"  the model thread alone: {statistics.median(model_alone):.2f} ms per {len(long_text[: args.prompt_chars])}"
          f"-character prompt ({len(expected_long)} tokens, {len(model_alone)} prompts)")  # fmt: skip
    designs = ("alone", "shared", "lock", "copy")
    # /tokenize ms, model thread ms per prompt
    rows: dict[str, tuple[list[float], list[float]]] = {design: ([], []) for design in designs}
    for round_calls in [args.num_calls // args.rounds] * args.rounds:  # designs alternate: load drifts alike
        for design in designs:
            latencies, model_ms = rows[design]
            stop = threading.Event()
            worker = threading.Thread(target=model_loop, args=(stop, design == "lock", model_ms))
            if design != "alone":
                worker.start()
            tokenizer_side = twin if design == "copy" else adapter
            try:
                for _ in range(round_calls):
                    t = time.perf_counter()
                    with lock if design == "lock" else _nothing():
                        ids = tokenizer_side.tokenize(SHORT_PROMPT, True)
                    latencies.append((time.perf_counter() - t) * 1e3)
                    if ids != expected_short:
                        raise SystemExit(f"bench_prefill_tokenizer: {design}: /tokenize's ids changed")
                    time.sleep(0.001)  # calls arrive apart, as over HTTP
            finally:
                stop.set()
                if design != "alone":
                    worker.join()
    base = statistics.median(rows["alone"][0])
    print(
        "| design | /tokenize p50 ms | p99 ms | p50 / alone | model thread ms per prompt (alone: "
        f"{statistics.median(model_alone):.2f}) |"
    )
    print("|---|---|---|---|---|")
    for design, (latencies, model_ms) in rows.items():
        p50, p99 = statistics.median(latencies), sorted(latencies)[int(0.99 * (len(latencies) - 1))]
        model_cell = f"{statistics.median(model_ms):.2f}" if model_ms else "-"
        print(f"| {design} | {p50:.3f} | {p99:.3f} | {p50 / base:.2f}x | {model_cell} |")


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="prefill processes started per tree")
    ap.add_argument("--baseline-rev", default="", help="also run prefill from `git archive REV`")
    ap.add_argument(
        "--num-tokenize-rpcs", type=int, default=1000, help="a busy spell: the process trims after it"
    )
    ap.add_argument("--timeout-s", type=float, default=300.0, help="a prefill process's start-up deadline")
    ap.add_argument("--skip-process", action="store_true", help="only the in-process thread part")
    ap.add_argument("--skip-threads", action="store_true", help="only the process part")
    ap.add_argument("--num-calls", type=int, default=400, help="/tokenize calls per design")
    ap.add_argument("--rounds", type=int, default=4, help="the designs alternate in this many rounds")
    ap.add_argument("--prompt-chars", type=int, default=20_000, help="the model thread's prompt length")
    ap.add_argument("--model-alone-s", type=float, default=3.0)
    ap.add_argument("--model-dir", default="", help="reuse (or create) the checkpoint here")
    args = ap.parse_args()
    model = Path(args.model_dir or tempfile.mkdtemp(prefix="epd-qwen2-tokenizer-"))
    if not (model / "config.json").exists():
        t0 = time.perf_counter()
        build_checkpoint(model)
        print(f"# checkpoint with the Qwen2-sized tokenizer at {model} ({time.perf_counter() - t0:.1f} s)")
    if not args.skip_process:
        print("# 1. a prefill process: start-up, PSS and RSS")
        process_part(model, args)
    if not args.skip_threads:
        print("# 2. /tokenize beside the model thread's tokenisation, one tokenizer")
        threads_part(model, args)
    return 0


if __name__ == "__main__":
    run_bench(main)
