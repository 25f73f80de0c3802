"""`transformers serve` with the one patch epd's side-by-side benchmark needs; run with the venv's python:

    python bench/transformers_serve_launcher.py serve MODEL_DIR --host 127.0.0.1 --port 8001 --device cpu

Same arguments as the `transformers` command (this calls its typer app, without the CLI's update
check, which would go to the network). The patch, for stock transformers 5.23:

`ModelManager.get_model_modality` checks the "multimodal LM" mapping (text + image + video +
*audio*) before the image-text-to-text one, and Qwen2-VL / Qwen2.5-VL are in both, so they come out
MULTIMODAL; `chat_completion` then calls `apply_chat_template(..., load_audio_from_video=True)` for
every video request, which fails on a clip without an audio track. Here a model found MULTIMODAL
that is also an image-text-to-text model and has no audio config (Qwen2-VL, Qwen2.5-VL; not
Qwen2.5-Omni) is treated as a VLM: image/video + text, no audio read from videos.

The server's other quirks are handled by the client (bench/bench_vs_transformers_serve.py): video
as a file path (it rejects `data:` video URLs), frames in `chat_template_kwargs` ({"num_frames": N};
its default is 32), no `ignore_eos` field (it answers 422; the length is forced with
`min_new_tokens` in the served directory's generation_config.json), and torchcodec to read mp4.
"""

from __future__ import annotations

import sys


def patch_modality() -> None:
    from transformers.cli.serving import model_manager
    from transformers.cli.serving.utils import Modality
    from transformers.models.auto import modeling_auto

    original = model_manager.ModelManager.get_model_modality
    image_text = set(modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.values())

    def get_model_modality(model, processor=None) -> Modality:
        modality = original(model, processor=processor)
        if (
            modality is Modality.MULTIMODAL
            and type(model).__name__ in image_text
            and getattr(model.config, "audio_config", None) is None
        ):
            return Modality.VLM
        return modality

    model_manager.ModelManager.get_model_modality = staticmethod(get_model_modality)  # type: ignore[method-assign]


def main() -> int:
    patch_modality()
    from transformers.cli.transformers import app

    sys.argv = ["transformers", *sys.argv[1:]]
    app()
    return 0


if __name__ == "__main__":
    sys.exit(main())
