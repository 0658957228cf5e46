"""Build a tiny LoRA adapter for the tiny model (tests/vllm/tiny_model.py): what `peft` saves,
`adapter_config.json` and `adapter_model.safetensors` with peft's tensor names
(`base_model.model.<module path>.lora_A.weight` of shape (rank, in), `lora_B.weight` of shape
(out, rank)), which is the format vLLM reads (vllm/lora/lora_model.py, peft_helper.py).

peft is not installed anywhere here, and the safetensors format is small (an 8-byte header
length, a JSON header naming each tensor's dtype, shape and byte range, then the bytes), so it
is written with the standard library alone: the same file builds adapters for the simulated
replica in Tollgate's venv and for real vLLM in the engine's. Run as a script:
`python tests/vllm/tiny_adapter.py OUT_DIR [--rank R] [--seed S]`.
"""

from __future__ import annotations

import json
import random
import struct
import sys
from array import array
from pathlib import Path

# The tiny model's shape (tests/vllm/tiny_model.py): hidden 128, 4 query heads and 2 KV heads
# of 32, two layers.
HIDDEN = 128
Q_OUT = 4 * 32
KV_OUT = 2 * 32
LAYERS = 2
TARGETS = {"q_proj": Q_OUT, "v_proj": KV_OUT}
# lora_B is zero in a freshly initialised peft adapter (it changes nothing); a trained one is
# not. Large enough values that greedy decoding with the adapter differs from the base model's,
# which is how a test tells that the adapter was applied.
SCALE = 0.5


def tensors(rank: int, seed: int) -> dict[str, tuple[tuple[int, int], list[float]]]:
    rng = random.Random(seed)
    out: dict[str, tuple[tuple[int, int], list[float]]] = {}
    for layer in range(LAYERS):
        for module, out_features in TARGETS.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = [rng.gauss(0.0, SCALE) for _ in range(rank * HIDDEN)]
            b = [rng.gauss(0.0, SCALE) for _ in range(out_features * rank)]
            out[f"{prefix}.lora_A.weight"] = ((rank, HIDDEN), a)
            out[f"{prefix}.lora_B.weight"] = ((out_features, rank), b)
    return out


def write_safetensors(path: Path, named: dict[str, tuple[tuple[int, int], list[float]]]) -> None:
    """float32 tensors in the safetensors layout (little-endian, offsets from the data start)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs = []
    offset = 0
    for name, (shape, values) in named.items():
        data = array("f", values)
        if sys.byteorder != "little":
            data.byteswap()
        raw = data.tobytes()
        span = [offset, offset + len(raw)]
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": span}
        blobs.append(raw)
        offset += len(raw)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


def build(out: Path, rank: int = 4, seed: int = 7, base: str = "tiny-llama-2026-05") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_safetensors(out / "adapter_model.safetensors", tensors(rank, seed))
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args:
        sys.exit("usage: python tests/vllm/tiny_adapter.py OUT_DIR [--rank R] [--seed S]")
    opts = dict(zip(args[1::2], args[2::2], strict=False))
    build(Path(args[0]), int(opts.get("--rank", 4)), int(opts.get("--seed", 7)))
