"""Generate the ``tiny-demo`` model shipped in ``workers/engine/tiny_demo/``.

A Llama-architecture model with a byte-level vocabulary: ids 0-255 are the byte values,
256 ``<bos>``, 257 ``<eos>``, 258 ``<pad>``, 259 ``<unk>``. Two layers, hidden size 64,
4 query heads over 2 key/value heads (GQA), tied embeddings, fp32 safetensors (~0.45 MB).

The weights are random but reproducible on any machine: uniform values drawn from a
SHA-256 counter stream with exact float64 arithmetic (no library RNG, no transcendental
functions), rounded once to fp32. Running the script again rewrites identical bytes, so
the published artifact hash stays valid. Usage::

    python scripts/make_tiny_demo.py [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

SEED = b"inference-ledger tiny-demo v1"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "workers" / "engine" / "tiny_demo"

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 260, 64, 176, 2, 4, 2, 16

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "pad_token_id": 258,
    "torch_dtype": "float32",
    "tiny_demo_vocabulary": "ids 0-255: byte values; 256 <bos>, 257 <eos>, 258 <pad>, 259 <unk>",
}
GENERATION_CONFIG = {"bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}


def uniform(name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> np.ndarray:
    """fp32 values, uniform with the given mean and std, from SHA-256(SEED, name, counter)."""
    count = math.prod(shape)
    stream = bytearray()
    counter = 0
    while len(stream) < 4 * count:
        stream += hashlib.sha256(SEED + name.encode() + counter.to_bytes(8, "little")).digest()
        counter += 1
    ints = np.frombuffer(bytes(stream[: 4 * count]), dtype="<u4").astype(np.float64)
    unit = ints / 2.0**31 - 1.0                        # exact: uniform in [-1, 1)
    half_width = std * math.sqrt(3.0)
    return (mean + unit * half_width).astype(np.float32).reshape(shape)


def weights() -> dict[str, np.ndarray]:
    hidden, inter, layers, d = HIDDEN, INTERMEDIATE, LAYERS, HEAD_DIM
    hq, hkv = HEADS, KV_HEADS
    residual = (2 * layers) ** -0.5
    out = {
        "model.embed_tokens.weight": uniform("embed", (VOCAB, hidden), 2.0 * hidden ** -0.5),
        "model.norm.weight": uniform("norm", (hidden,), 0.1, 1.0),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": ((hq * d, hidden), hidden ** -0.5),
            "self_attn.k_proj.weight": ((hkv * d, hidden), hidden ** -0.5),
            "self_attn.v_proj.weight": ((hkv * d, hidden), hidden ** -0.5),
            "self_attn.o_proj.weight": ((hidden, hq * d), residual * (hq * d) ** -0.5),
            "mlp.gate_proj.weight": ((inter, hidden), hidden ** -0.5),
            "mlp.up_proj.weight": ((inter, hidden), hidden ** -0.5),
            "mlp.down_proj.weight": ((hidden, inter), residual * inter ** -0.5),
        }
        for name, (shape, std) in shapes.items():
            out[p + name] = uniform(p + name, shape, std)
        out[p + "input_layernorm.weight"] = uniform(p + "input_layernorm", (hidden,), 0.1, 1.0)
        out[p + "post_attention_layernorm.weight"] = uniform(
            p + "post_attention_layernorm", (hidden,), 0.1, 1.0
        )
    return out


def write(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n", "utf-8")
    (out_dir / "generation_config.json").write_text(
        json.dumps(GENERATION_CONFIG, indent=2) + "\n", "utf-8"
    )
    save_file(weights(), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)
    # Keep git from rewriting line endings (the artifact hash covers every byte).
    (out_dir / ".gitattributes").write_text("* -text\n", "utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    write(args.out)
    from ledger.artifacts import artifact_hashes

    print(json.dumps(artifact_hashes(args.out, model_name="tiny-demo"), indent=2))


if __name__ == "__main__":
    main()
