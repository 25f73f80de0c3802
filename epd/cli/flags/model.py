"""The model's flags: which checkpoint, on which device and dtype, with which kernels and threads
(`ModelConfig`), and the allocator of the processes that load it."""

from __future__ import annotations

import argparse

from epd.cli.flags.arg_types import env, num_threads, seconds

COMPILING_ROLES = ("prefill", "decode")
"""The stage roles that compile a request's structured output (JSON schema, regex, grammar)
against the vocabulary: prefill for the first token, decode for the rest. The encoder never does,
so it has no --structured-compile-timeout-s (nor does the stack pass it one)."""


def add_model_flags(p: argparse.ArgumentParser, compiles: bool = True) -> list[argparse.Action]:
    """The model's flags (returned); `compiles`: the process compiles structured outputs
    (`COMPILING_ROLES`, the stack, the colocated stages, `epd ask`'s embedded ones), and so takes
    their deadline."""
    g = p.add_argument_group("model")
    flags = []
    flags.append(
        g.add_argument(
            "--model",
            default=env("EPD_MODEL", "default"),
            help="local directory or hub id of a checkpoint of a supported family (Qwen2-VL, Qwen2.5-VL, "
            "Qwen3-VL, Qwen3.5, LLaVA-OneVision, GLM-4.1V, InternVL3/3.5 -hf; default: the embedded model)",
        )
    )
    flags.append(g.add_argument("--device", default=env("EPD_DEVICE", "cpu"), help="cpu or cuda[:N]"))
    flags.append(
        g.add_argument(
            "--dtype", default=env("EPD_DTYPE", "float32"), choices=["float32", "float16", "bfloat16"]
        )
    )
    from epd.model_runtime.config import LINEAR_KERNELS, ModelConfig

    flags.append(
        g.add_argument(
            "--linear-kernel",
            default="torch",
            choices=LINEAR_KERNELS,
            help="linear layers: torch's own (MKL on x86; the default, bit-identical to generate()), "
            "or onednn for calls of 16 rows or more (prefill, vision tower, wide decode steps): "
            "2.1x faster products on the AMD bench CPU (not on Intel), results within float32 rounding "
            "(docs/benchmarks.md, 'oneDNN linear layers')",
        )
    )
    if compiles:
        flags.append(
            g.add_argument(
                "--structured-compile-timeout-s",
                type=seconds,
                default=ModelConfig.structured_compile_timeout_s,
                metavar="S",
                help="how long a request's structured output (JSON schema, regex, grammar) may take to "
                "compile against the model's vocabulary (default 30; 0: no bound); longer is refused "
                "with 400 / INVALID_ARGUMENT asking for a simpler one",
            )
        )
    env_threads = env("EPD_NUM_THREADS", "")
    flags.append(
        g.add_argument(
            "--num-threads",
            type=num_threads,
            default=num_threads(env_threads) if env_threads else None,
            help="torch threads per model call: N, or auto (the cores the other stages' calls leave "
            "idle at that moment). Default: 1 per service of a stack (the fastest under load, "
            "docs/benchmarks.md), auto in --colocate",
        )
    )
    return flags


def add_preload_flags(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """The libraries the model processes preload (`epd.cli.preload`): `epd serve`'s, and `epd ask`'s
    own process in embedded mode. Returns the flags."""
    from epd.cli.allocator import ALLOCATORS
    from epd.cli.mkl_dispatch import MKL_DISPATCHES

    allocator = p.add_argument(
        "--allocator",
        default="auto",
        choices=ALLOCATORS,
        help="memory allocator of the model processes: auto (tcmalloc when installed, else glibc's "
        "malloc), tcmalloc (or exit 2), system (as started). tcmalloc lowered the peak memory "
        "under load by 5-17%% at the same or a higher speed (docs/benchmarks.md, 'Memory allocator')",
    )
    mkl_dispatch = p.add_argument(
        "--mkl-dispatch",
        default="vendor",
        choices=MKL_DISPATCHES,
        help="MKL's kernels for the model's matrix products: vendor (MKL's own choice: its generic "
        "kernels on a CPU that is not Intel's), features (by the CPU's instruction set, as on an Intel "
        "CPU: a one-function library preloaded, built once with the machine's C compiler). On an AMD "
        "EPYC with AVX-512 features served 1.3-1.6x the requests/s; off by default, as its float32 sums "
        "round differently from generate()'s in a process without it (docs/benchmarks.md, "
        '"MKL\'s kernels on AMD CPUs")',
    )
    return [allocator, mkl_dispatch]
