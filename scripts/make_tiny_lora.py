"""Generate a LoRA adapter for a model that scripts/make_tiny_model.py made: random low-rank
weights on every attention and MLP projection, in PEFT's format (adapter_config.json and
adapter_model.safetensors), as vLLM loads adapters (`vllm serve --lora-modules`). Its greedy
output differs from the base model's, so a caller can tell which one answered.

    python scripts/make_tiny_lora.py models/tiny-llama models/tiny-llama-lora [--seed N]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RANK = 8
ALPHA = 16
SEED = 4321
# Llama's projections, by the name PEFT and vLLM give them.
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# How far the adapter moves each projection's output: the base's weights are initialised with
# std 0.02; lora_B * lora_A * (alpha / rank) of this std changes the greedy choices.
WEIGHT_STD = 0.1
MARKER = "tokenmesh-lora.json"


def shapes(config: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Each projection's (in_features, out_features)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head
    q = config["num_attention_heads"] * head
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def build(base: Path, out_dir: Path, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "float32")
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (inputs, outputs) in shapes(config).items():
            block = "self_attn" if name in ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
            a = torch.randn(RANK, inputs, generator=generator) * WEIGHT_STD
            b = torch.randn(outputs, RANK, generator=generator) * WEIGHT_STD
            tensors[f"{prefix}.lora_A.weight"] = a.to(dtype).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.to(dtype).contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": [*ATTENTION, *MLP],
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, help="the base model's directory (HF format)")
    parser.add_argument("out_dir", type=Path, help="where to write the adapter")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--force", action="store_true", help="rebuild even if it exists")
    args = parser.parse_args(argv)
    # The adapter is rebuilt when its base model or seed changed.
    base_marker = args.base / "tokenmesh-tiny.json"
    stamp = {
        "base": base_marker.read_text() if base_marker.exists() else str(args.base),
        "seed": args.seed,
        "rank": RANK,
    }
    marker = args.out_dir / MARKER
    text = json.dumps(stamp, indent=2)
    if marker.exists() and marker.read_text() == text and not args.force:
        print(f"adapter already at {args.out_dir}")
        return 0
    build(args.base, args.out_dir, args.seed)
    marker.write_text(text)
    print(
        f"adapter written to {args.out_dir}: rank {RANK} on {len(ATTENTION) + len(MLP)} projections"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
