"""Generate the tiny default model (or, given sizes, a larger one): a random-init Llama and a
real byte-level BPE tokenizer."""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from dataclasses import dataclass
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
# Weights and activations. vLLM's CPU backend computes bfloat16 natively only with AVX-512's
# bf16 instructions; on AVX2 float32 is several times faster.
DTYPE = "bfloat16"
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
SEED = 1234

# A minimal ChatML-like chat template (the model's own, as vLLM renders chat): each message is
# <s>role\ncontent</s>\n, and the generation prompt opens the assistant's message, which ends
# when the model emits </s> (its end-of-sequence token). Tools render as Hermes' templates
# render them (vLLM's `hermes` tool-call parser reads the calls back): a system message listing
# them in <tools>, each call of an assistant message in <tool_call> tags, each tool result in
# <tool_response> tags. Without tools a conversation renders as it did before they existed.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ bos_token + 'system\\nYou may call one or more functions. The functions: <tools>' }}"
    "{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
    "{{ '</tools> For each call, return a JSON object with the function name and arguments "
    "within <tool_call></tool_call> tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}'
    "\\n</tool_call>' + eos_token + '\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ bos_token + 'assistant\\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>\\n{\"name\": ' + call['function']['name'] | tojson"
    " + ', \"arguments\": ' + call['function']['arguments'] | tojson + '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ eos_token + '\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ bos_token + 'tool\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>'"
    " + eos_token + '\\n' }}"
    "{% else %}"
    "{{ bos_token + message['role'] + '\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token + 'assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    """The model's sizes; the defaults make the tiny model."""

    hidden_size: int = HIDDEN_SIZE
    heads: int = NUM_HEADS
    layers: int = NUM_LAYERS
    intermediate_size: int = INTERMEDIATE_SIZE
    max_positions: int = MAX_POSITIONS
    dtype: str = DTYPE

    def marker(self) -> dict[str, int | str]:
        """What the marker file records: the tiny model's three keys (unchanged), and the
        other sizes only when they differ from the tiny model's."""
        written: dict[str, int | str] = {
            "vocab_size": VOCAB_SIZE,
            "hidden_size": self.hidden_size,
            "layers": self.layers,
        }
        for name, value in vars(self).items():
            if name not in written and value != getattr(Shape, name):
                written[name] = value
        return written

    def kv_bytes_per_token(self) -> int:
        """The KV cache one token takes: a key and a value for every head of every layer (as
        many KV heads as heads: no grouped-query attention), in the model's dtype."""
        return 2 * self.layers * self.hidden_size * DTYPE_BYTES[self.dtype]

    def kv_tokens_per_gib(self) -> int:
        """Tokens one GiB of KV cache holds (the CPU backend's cache comes in whole GiB)."""
        return 2**30 // self.kv_bytes_per_token()


def corpus() -> list[str]:
    """Return the training text, one module source per item."""
    import importlib

    return [inspect.getsource(importlib.import_module(name)) for name in CORPUS_MODULES]


def build_tokenizer(out_dir: Path, shape: Shape) -> None:
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
        model_max_length=shape.max_positions,
        chat_template=CHAT_TEMPLATE,
    )
    # The template goes into tokenizer_config.json (chat_template), not chat_template.jinja.
    fast.save_pretrained(out_dir, save_jinja_files=False)


def build_model(out_dir: Path, shape: Shape, seed: int = SEED) -> None:
    """Save a randomly initialised Llama whose vocabulary matches the tokenizer (its weights
    drawn from `seed`: another seed, another model of the same shape)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(out_dir)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        max_position_embeddings=shape.max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype=shape.dtype,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, shape.dtype))
    model.save_pretrained(out_dir, safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir", type=Path, help="where to write the model (HF format)")
    parser.add_argument("--force", action="store_true", help="rebuild even if it exists")
    parser.add_argument("--hidden-size", type=int, default=HIDDEN_SIZE)
    parser.add_argument("--heads", type=int, default=NUM_HEADS, help="attention heads")
    parser.add_argument("--layers", type=int, default=NUM_LAYERS)
    parser.add_argument("--intermediate-size", type=int, default=INTERMEDIATE_SIZE)
    parser.add_argument("--max-positions", type=int, default=MAX_POSITIONS)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=DTYPE)
    parser.add_argument(
        "--seed", type=int, default=SEED, help="another seed: another model of the same shape"
    )
    args = parser.parse_args(argv)
    shape = Shape(
        args.hidden_size,
        args.heads,
        args.layers,
        args.intermediate_size,
        args.max_positions,
        args.dtype,
    )
    # vLLM's CPU attention wants head_dim >= 64.
    if shape.hidden_size % shape.heads or shape.hidden_size // shape.heads < 64:
        parser.error("hidden size must split into heads of at least 64")
    marker = args.out_dir / "tokenmesh-tiny.json"
    recorded = shape.marker() | ({"seed": args.seed} if args.seed != SEED else {})
    text = json.dumps(recorded, indent=2)
    # A model of other sizes at the same place is rebuilt.
    if marker.exists() and marker.read_text() == text and not args.force:
        print(f"model already at {args.out_dir}")
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(args.out_dir, shape)
    build_model(args.out_dir, shape, args.seed)
    marker.write_text(text)
    print(
        f"model written to {args.out_dir}: KV cache {shape.kv_bytes_per_token():,} bytes a "
        f"token, {shape.kv_tokens_per_gib():,} tokens a GiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
