"""Generate the tiny default model: a random-init Llama and a real byte-level BPE tokenizer."""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

# The tokenizer learns its merges from the source text of a few standard-library modules: text
# that is on every machine, so the model is the same everywhere without a download.
CORPUS_MODULES = ("argparse", "asyncio.base_events", "json.decoder", "logging", "textwrap")
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
# CPU attention in vLLM needs head_dim >= 64: hidden 128 over 2 heads gives 64.
HIDDEN_SIZE = 128
NUM_HEADS = 2
NUM_LAYERS = 2
INTERMEDIATE_SIZE = 256
MAX_POSITIONS = 2048
SEED = 1234
# A minimal ChatML-like chat template (the model's own, as vLLM renders chat): each message is
# <s>role\ncontent</s>\n, and the generation prompt opens the assistant's message, which ends
# when the model emits </s> (its end-of-sequence token).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ bos_token + message['role'] + '\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token + 'assistant\\n' }}{% endif %}"
)


def corpus() -> list[str]:
    """Return the training text, one module source per item."""
    import importlib

    return [inspect.getsource(importlib.import_module(name)) for name in CORPUS_MODULES]


def build_tokenizer(out_dir: Path) -> None:
    """Train a byte-level BPE tokenizer and save it in Hugging Face format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=MAX_POSITIONS,
        chat_template=CHAT_TEMPLATE,
    )
    # The template goes into tokenizer_config.json (chat_template), not chat_template.jinja.
    fast.save_pretrained(out_dir, save_jinja_files=False)


def build_model(out_dir: Path) -> None:
    """Save a randomly initialised Llama whose vocabulary matches the tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(out_dir)
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir", type=Path, help="where to write the model (HF format)")
    parser.add_argument("--force", action="store_true", help="rebuild even if it exists")
    args = parser.parse_args(argv)
    marker = args.out_dir / "tokenmesh-tiny.json"
    if marker.exists() and not args.force:
        print(f"tiny model already at {args.out_dir}")
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(args.out_dir)
    build_model(args.out_dir)
    marker.write_text(
        json.dumps(
            {"vocab_size": VOCAB_SIZE, "hidden_size": HIDDEN_SIZE, "layers": NUM_LAYERS},
            indent=2,
        )
    )
    print(f"tiny model written to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
