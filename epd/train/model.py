"""The model a training run builds (`model_spec`: a TinyVLMSpec of the run's family and sizes),
the serving adapter that prepares its inputs (`serving_adapter`), and how it is saved."""

from __future__ import annotations

from pathlib import Path

from epd.train.config import TrainConfig

TRAINABLE_FAMILIES = ("qwen2_vl", "qwen3_vl")


def deepstack_layers(config: TrainConfig) -> tuple[int, ...]:
    """Qwen3-VL: the tower layers whose features DeepStack adds to the first language layers: the
    layers just before the last, one per language layer (at most 3, as the hub's models)."""
    n = min(config.size.num_hidden_layers, 3, config.size.vision_depth - 1)
    return tuple(range(config.size.vision_depth - 1 - n, config.size.vision_depth - 1))


def model_spec(config: TrainConfig):
    from epd.model_runtime.tiny_model import TinyVLMSpec
    from epd.synth.questions import tokenizer_words

    if config.family not in TRAINABLE_FAMILIES:
        raise ValueError(f"the trainer builds {' or '.join(TRAINABLE_FAMILIES)}, not {config.family!r}")
    s = config.size
    extra = {"deepstack_visual_indexes": deepstack_layers(config)} if config.family == "qwen3_vl" else {}
    return TinyVLMSpec(
        family=config.family,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        vision_depth=s.vision_depth,
        vision_embed_dim=s.vision_embed_dim,
        vision_num_heads=s.vision_num_heads,
        seed=config.seed,
        init=s.init,
        weight_std=s.weight_std,
        extra_words=tuple(tokenizer_words()),
        **extra,
    )


def serving_adapter(model_dir: Path):
    """The serving adapter of the checkpoint's family (vision part only): it prepares every input."""
    from epd.model_runtime.config import ModelConfig
    from epd.model_runtime.loader import check_model_dir

    adapter_cls: type
    if check_model_dir(str(model_dir)) == "qwen3_vl":
        from epd.model_runtime.qwen3_vl import Qwen3VLAdapter as adapter_cls
    else:
        from epd.model_runtime.qwen2_vl import Qwen2VLAdapter as adapter_cls
    return adapter_cls(str(model_dir), ModelConfig(), {"vision"})


def save_model(model, processor, out_dir: Path) -> None:
    tok = processor.tokenizer
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
