"""Generate a deterministic, scaled-down Kimi-K2.5-W4A8-shaped checkpoint (stdlib only)."""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import random
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ID = "Eco-Tech/Kimi-K2.5-W4A8"
WEIGHTS_PREFIX = "quant_model_weights"
INDEX_NAME = f"{WEIGHTS_PREFIX}.safetensors.index.json"
DESCRIPTION_NAME = "quant_model_description.json"

# Real Kimi K2.5 text model numbers (Part A1); shapes are scaled by a/64 where 64 gives the real model.
NUM_LAYERS = 61
FIRST_DENSE = 1
REAL_EXPERTS = 384
NUM_HEADS = 64
VISION_BLOCKS = 27
_MAX_SCALE = 64
_MIN_EXPERTS_BEFORE_SHRINK = 16
_MIN_VOCAB = 64

_DTYPE_SIZE = {"I8": 1, "BF16": 2, "F32": 4, "I32": 4, "I64": 8}
_CHUNK = 1 << 20
_HEADER_ALIGN = 8  # safetensors pads the JSON header with spaces to 8-byte alignment


@dataclass(frozen=True)
class Tensor:
    """One tensor of the generated checkpoint: name, safetensors dtype, shape and description tag."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    quant: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPE_SIZE[self.dtype]


@dataclass(frozen=True)
class Plan:
    """Scaled model dimensions chosen so that the weights add up to about the requested size."""

    scale: int
    experts: int
    vocab: int
    tensors: tuple[Tensor, ...]

    @property
    def hidden(self) -> int:
        return 112 * self.scale


def parse_size(text: str) -> int:
    """Parse '512MiB', '1.5GB', '4096', '25MB/s' or '200Mbit/s' into bytes (per second)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?)(B|b|bit|bps|)\s*(/s|ps)?\s*", text)
    if not m:
        raise ValueError(f"cannot parse size {text!r}")
    number, prefix, binary, unit, _ = m.groups()
    base = 1024 if binary else 1000
    factor = base ** ("kmgt".index(prefix.lower()) + 1) if prefix else 1
    value = float(number) * factor
    if unit in ("b", "bit", "bps"):
        value /= 8
    return int(value)


def _attention(prefix: str, a: int, hidden: int) -> list[Tensor]:
    q_lora, kv_lora, nope, rope, v = 24 * a, 8 * a, 2 * a, a, 2 * a
    out: list[Tensor] = []
    w8a8 = {
        "q_a_proj": (q_lora, hidden),
        "q_b_proj": (NUM_HEADS * (nope + rope), q_lora),
        "kv_a_proj_with_mqa": (kv_lora + rope, hidden),
        "o_proj": (hidden, NUM_HEADS * v),
    }
    for proj, (rows, cols) in w8a8.items():
        name = f"{prefix}.self_attn.{proj}"
        out += [
            Tensor(f"{name}.weight", "I8", (rows, cols), "W8A8"),
            Tensor(f"{name}.quant_bias", "I32", (rows,), "W8A8"),
            Tensor(f"{name}.deq_scale", "F32", (rows,), "W8A8"),
            Tensor(f"{name}.input_scale", "F32", (1,), "W8A8"),
            Tensor(f"{name}.input_offset", "F32", (1,), "W8A8"),
        ]
    # The msModelSlim recipe keeps kv_b_proj out of W8A8 (Part A4).
    out.append(Tensor(f"{prefix}.self_attn.kv_b_proj.weight", "BF16", (NUM_HEADS * (nope + v), kv_lora), "FLOAT"))
    out.append(Tensor(f"{prefix}.self_attn.q_a_layernorm.weight", "BF16", (q_lora,), "FLOAT"))
    out.append(Tensor(f"{prefix}.self_attn.kv_a_layernorm.weight", "BF16", (kv_lora,), "FLOAT"))
    return out


def _w8a8_dynamic_mlp(prefix: str, inter: int, hidden: int) -> list[Tensor]:
    out: list[Tensor] = []
    for proj, (rows, cols) in {
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }.items():
        name = f"{prefix}.{proj}"
        out += [
            Tensor(f"{name}.weight", "I8", (rows, cols), "W8A8_DYNAMIC"),
            Tensor(f"{name}.weight_scale", "F32", (rows, 1), "W8A8_DYNAMIC"),
            Tensor(f"{name}.weight_offset", "F32", (rows, 1), "W8A8_DYNAMIC"),
        ]
    return out


def _expert(prefix: str, moe_inter: int, hidden: int) -> list[Tensor]:
    # vllm-ascend's W4A8 layout: int8 holding two int4 along the output dim, fp32 per-channel scales.
    shapes = {
        "gate_proj": ((moe_inter // 2, hidden), (moe_inter, 1), (moe_inter, 1)),
        "up_proj": ((moe_inter // 2, hidden), (moe_inter, 1), (moe_inter, 1)),
        "down_proj": ((hidden // 2, moe_inter), (hidden, 1), (hidden, 16)),
    }
    out: list[Tensor] = []
    for proj, (w, scale, bias) in shapes.items():
        name = f"{prefix}.{proj}"
        out += [
            Tensor(f"{name}.weight", "I8", w, "W4A8_DYNAMIC"),
            Tensor(f"{name}.weight_scale", "F32", scale, "W4A8_DYNAMIC"),
            Tensor(f"{name}.weight_offset", "F32", scale, "W4A8_DYNAMIC"),
            Tensor(f"{name}.scale_bias", "F32", bias, "W4A8_DYNAMIC"),
        ]
    return out


def _tensors(a: int, experts: int, vocab: int) -> list[Tensor]:
    hidden, moe_inter, dense_inter = 112 * a, 32 * a, 288 * a
    out: list[Tensor] = []
    for i in range(NUM_LAYERS):
        p = f"language_model.model.layers.{i}"
        out.append(Tensor(f"{p}.input_layernorm.weight", "BF16", (hidden,), "FLOAT"))
        out += _attention(p, a, hidden)
        out.append(Tensor(f"{p}.post_attention_layernorm.weight", "BF16", (hidden,), "FLOAT"))
        if i < FIRST_DENSE:
            out += _w8a8_dynamic_mlp(f"{p}.mlp", dense_inter, hidden)
            continue
        out.append(Tensor(f"{p}.mlp.gate.weight", "BF16", (experts, hidden), "FLOAT"))
        out.append(Tensor(f"{p}.mlp.gate.e_score_correction_bias", "F32", (experts,), "FLOAT"))
        out += _w8a8_dynamic_mlp(f"{p}.mlp.shared_experts", moe_inter, hidden)
        for e in range(experts):
            out += _expert(f"{p}.mlp.experts.{e}", moe_inter, hidden)
    # Real K2.5 puts lm_head/embeddings/norm, then the projector, then the vision tower in the last shards.
    out.append(Tensor("language_model.lm_head.weight", "BF16", (vocab, hidden), "FLOAT"))
    out.append(Tensor("language_model.model.embed_tokens.weight", "BF16", (vocab, hidden), "FLOAT"))
    out.append(Tensor("language_model.model.norm.weight", "BF16", (hidden,), "FLOAT"))
    vh, vi = 18 * a, max(1, round(4304 * a / 64))
    out += [
        Tensor("mm_projector.pre_norm.weight", "BF16", (vh,), "FLOAT"),
        Tensor("mm_projector.proj.0.weight", "BF16", (4 * vh, 4 * vh), "FLOAT"),
        Tensor("mm_projector.proj.2.weight", "BF16", (hidden, 4 * vh), "FLOAT"),
        Tensor("vision_tower.patch_embed.proj.weight", "BF16", (vh, 3, 14, 14), "FLOAT"),
        Tensor("vision_tower.patch_embed.pos_emb.weight", "BF16", (64, 64, vh), "FLOAT"),
    ]
    for b in range(VISION_BLOCKS):
        p = f"vision_tower.encoder.blocks.{b}"
        out += [
            Tensor(f"{p}.wqkv.weight", "BF16", (3 * vh, vh), "FLOAT"),
            Tensor(f"{p}.wo.weight", "BF16", (vh, vh), "FLOAT"),
            Tensor(f"{p}.mlp.fc0.weight", "BF16", (vi, vh), "FLOAT"),
            Tensor(f"{p}.mlp.fc1.weight", "BF16", (vh, vi), "FLOAT"),
            Tensor(f"{p}.norm0.weight", "BF16", (vh,), "FLOAT"),
            Tensor(f"{p}.norm1.weight", "BF16", (vh,), "FLOAT"),
        ]
    return out


def _total(tensors: list[Tensor]) -> int:
    return sum(t.nbytes for t in tensors)


@functools.lru_cache(maxsize=256)
def _cost(a: int) -> tuple[int, int]:
    """(bytes without routed experts, bytes per routed expert across all MoE layers) at scale a."""
    fixed = _total(_tensors(a, 0, _MIN_VOCAB))
    return fixed, _total(_tensors(a, 1, _MIN_VOCAB)) - fixed


def _experts_at(a: int, weight_bytes: int) -> int:
    fixed, one = _cost(a)
    return min(REAL_EXPERTS, (weight_bytes - fixed) // one) if weight_bytes > fixed else 0


def plan_checkpoint(weight_bytes: int) -> Plan:
    """Pick scale a (hidden = 112·a), routed experts per layer and vocab so tensor bytes ≈ weight_bytes."""
    min_vocab = _MIN_VOCAB
    # Largest a that still leaves >= 16 experts per layer (or all 384): many small expert tensors give
    # fine-grained, balanced shards. experts_at() falls as a grows, so bisect.
    lo, hi = 1, _MAX_SCALE
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _experts_at(mid, weight_bytes) >= _MIN_EXPERTS_BEFORE_SHRINK:
            lo = mid
        else:
            hi = mid - 1
    a = lo
    experts = _experts_at(a, weight_bytes)
    if experts < 1:
        need = sum(_cost(1))
        raise ValueError(f"total size too small for a 61-layer checkpoint: need at least ~{need} bytes")
    base = _tensors(a, experts, min_vocab)
    # lm_head and embed_tokens ([vocab, hidden] bf16 each) absorb the remainder.
    vocab = min_vocab + max(0, weight_bytes - _total(base)) // (2 * 2 * 112 * a)
    return Plan(scale=a, experts=experts, vocab=vocab, tensors=tuple(_tensors(a, experts, vocab)))


def _split(sizes: list[int], num_shards: int) -> list[tuple[int, int]]:
    """Split tensors, in order, into num_shards contiguous non-empty runs of about equal bytes."""
    if len(sizes) < num_shards:
        raise ValueError(f"{len(sizes)} tensors cannot fill {num_shards} shards")
    runs: list[tuple[int, int]] = []
    i, remaining = 0, sum(sizes)
    for k in range(num_shards):
        left = num_shards - k
        if left == 1:
            runs.append((i, len(sizes)))
            break
        target = remaining / left
        start, acc = i, 0
        while i < len(sizes) - (left - 1):
            if i > start and acc + sizes[i] / 2 > target:
                break
            acc += sizes[i]
            i += 1
        runs.append((start, i))
        remaining -= acc
    return runs


def shard_name(index: int, total: int) -> str:
    """msModelSlim ascendv1 shard file name (5-digit padding on both numbers)."""
    return f"{WEIGHTS_PREFIX}-{index:05d}-of-{total:05d}.safetensors"


def _header(tensors: list[Tensor]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _HEADER_ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def _seed_for(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def _write_random(fh, h, nbytes: int, seed: int) -> None:
    # One random 1 MiB block per shard, emitted at a random rotation per chunk: no two chunks alike,
    # and ~10x faster than randbytes for every byte (a 1 GiB checkpoint is disk-bound, not CPU-bound).
    rng = random.Random(seed)
    block = rng.randbytes(_CHUNK)
    while nbytes > 0:
        k = rng.randrange(_CHUNK)
        chunk = block[k:] + block[:k]
        if nbytes < _CHUNK:
            chunk = chunk[:nbytes]
        fh.write(chunk)
        h.update(chunk)
        nbytes -= len(chunk)


def _write_file(path: Path, data: bytes) -> dict:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {"path": "", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _json(obj: object) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


def config_json() -> dict:
    """Kimi K2.5 config.json, real (unscaled) numbers, quantization_config removed as msModelSlim does."""
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "bos_token_id": 163584,
        "eos_token_id": 163585,
        "pad_token_id": 163839,
        "ignore_index": -100,
        "media_placeholder_token_id": 163605,
        "model_type": "kimi_k25",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "text_config": {
            "architectures": ["DeepseekV3ForCausalLM"],
            "auto_map": {
                "AutoConfig": "configuration_deepseek.DeepseekV3Config",
                "AutoModel": "modeling_deepseek.DeepseekV3Model",
                "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
            },
            "model_type": "kimi_k2",
            "aux_loss_alpha": 0.001,
            "bos_token_id": 163584,
            "eos_token_id": 163585,
            "ep_size": 1,
            "first_k_dense_replace": FIRST_DENSE,
            "hidden_act": "silu",
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "kv_lora_rank": 512,
            "max_position_embeddings": 262144,
            "moe_intermediate_size": 2048,
            "moe_layer_freq": 1,
            "n_group": 1,
            "n_routed_experts": REAL_EXPERTS,
            "n_shared_experts": 1,
            "norm_topk_prob": True,
            "num_attention_heads": NUM_HEADS,
            "num_experts_per_tok": 8,
            "num_hidden_layers": NUM_LAYERS,
            "num_key_value_heads": NUM_HEADS,
            "num_nextn_predict_layers": 0,
            "q_lora_rank": 1536,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "factor": 64.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096,
                "type": "yarn",
            },
            "rope_theta": 50000.0,
            "routed_scaling_factor": 2.827,
            "scoring_func": "sigmoid",
            "seq_aux": True,
            "tie_word_embeddings": False,
            "topk_group": 1,
            "topk_method": "noaux_tc",
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "v_head_dim": 128,
            "vocab_size": 163840,
        },
        "vision_config": {
            "patch_size": 14,
            "init_pos_emb_height": 64,
            "init_pos_emb_width": 64,
            "init_pos_emb_time": 4,
            "pos_emb_type": "divided_fixed",
            "vt_hidden_size": 1152,
            "vt_intermediate_size": 4304,
            "vt_num_attention_heads": 16,
            "vt_num_hidden_layers": VISION_BLOCKS,
            "merge_kernel_size": [2, 2],
            "merge_type": "sd2_tpool",
            "video_attn_type": "spatial_temporal",
            "mm_projector_type": "patchmerger",
            "mm_hidden_size": 1152,
            "projector_hidden_act": "gelu",
            "projector_ln_eps": 1e-05,
            "text_hidden_size": 7168,
        },
    }


_CHAT_TEMPLATE = """\
{%- for message in messages -%}
<|im_{{ message['role'] }}|>{{ message['role'] }}<|im_middle|>{{ message['content'] }}<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}
"""

_DEPLOY_DOC = """\
# Deploy guidance (generated test checkpoint)

This repository is generated by kimictl's checkpoint generator. Its weights are pseudo-random bytes
laid out like the msModelSlim W4A8 export of Kimi K2.5; they cannot produce meaningful text.
"""


def _small_files(plan: Plan) -> dict[str, bytes]:
    description: dict[str, object] = {
        "model_quant_type": "W8A8",
        "version": "1.0.0",
        "group_size": 0,
        "metadata": {},
        "optional": {},
    }
    for t in plan.tensors:
        description[t.name] = t.quant
    return {
        "config.json": _json(config_json()),
        "generation_config.json": _json(
            {
                "bos_token_id": 163584,
                "eos_token_id": 163585,
                "max_length": 262144,
                "temperature": 1.0,
                "top_p": 0.95,
            }
        ),
        "tokenizer_config.json": _json(
            {
                "tokenizer_class": "TikTokenTokenizer",
                "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
                "bos_token": "[BOS]",
                "eos_token": "[EOS]",
                "pad_token": "[PAD]",
                "model_max_length": 262144,
                "chat_template": "chat_template.jinja",
            }
        ),
        "chat_template.jinja": _CHAT_TEMPLATE.encode(),
        "docs/deploy_guidance.md": _DEPLOY_DOC.encode(),
        DESCRIPTION_NAME: _json(description),
    }


def generate_checkpoint(
    dest: Path | str, *, total_bytes: int, num_shards: int, seed: int = 0, layout: str = "w4a8"
) -> list[dict]:
    """Write the checkpoint into dest and return its manifest ([{path, size, sha256}] sorted by path).

    Same arguments give byte-identical files. Shapes are the real model's scaled down; the weight map,
    description tags and shard naming follow the msModelSlim ascendv1 export of Eco-Tech/Kimi-K2.5-W4A8.
    """
    if layout != "w4a8":
        raise ValueError(f"unknown layout {layout!r}; only 'w4a8' is supported")
    if num_shards < 1:
        raise ValueError("num_shards must be >= 1")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    # First pass with a rough budget to learn the metadata overhead, then re-plan with the exact overhead.
    plan = plan_checkpoint(max(1, total_bytes - total_bytes // 100))
    for _ in range(6):
        runs = _split([t.nbytes for t in plan.tensors], num_shards)
        overhead = sum(len(v) for v in _small_files(plan).values())
        overhead += sum(len(_header(list(plan.tensors[s:e]))) for s, e in runs)
        overhead += len(_index(plan, runs, num_shards))
        new = plan_checkpoint(max(1, total_bytes - overhead))
        if new == plan:
            break
        plan = new
    runs = _split([t.nbytes for t in plan.tensors], num_shards)

    # Shards from an earlier run with another shard count would poison the served repo.
    keep = {shard_name(k, num_shards) for k in range(1, num_shards + 1)}
    for old in dest.glob(f"{WEIGHTS_PREFIX}-*-of-*.safetensors"):
        if old.name not in keep:
            old.unlink()
    manifest: dict[str, dict] = {}
    for rel, data in _small_files(plan).items():
        manifest[rel] = _write_file(dest / rel, data)
    manifest[INDEX_NAME] = _write_file(dest / INDEX_NAME, _index(plan, runs, num_shards))
    for k, (s, e) in enumerate(runs, start=1):
        name = shard_name(k, num_shards)
        tensors = list(plan.tensors[s:e])
        h = hashlib.sha256()
        header = _header(tensors)
        with open(dest / name, "wb") as fh:
            fh.write(header)
            h.update(header)
            _write_random(fh, h, sum(t.nbytes for t in tensors), _seed_for(seed, name))
        manifest[name] = {"path": "", "size": (dest / name).stat().st_size, "sha256": h.hexdigest()}
    for rel, entry in manifest.items():
        entry["path"] = rel
    return [manifest[k] for k in sorted(manifest)]


def _index(plan: Plan, runs: list[tuple[int, int]], num_shards: int) -> bytes:
    weight_map = {}
    for k, (s, e) in enumerate(runs, start=1):
        for t in plan.tensors[s:e]:
            weight_map[t.name] = shard_name(k, num_shards)
    total = sum(t.nbytes for t in plan.tensors)
    return _json({"metadata": {"total_size": total}, "weight_map": weight_map})


def checkpoint_manifest(root: Path | str) -> list[dict]:
    """Manifest of every regular file under root (hidden paths skipped): [{path, size, sha256}] by path."""
    root = Path(root)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for fn in filenames:
            if fn.startswith("."):
                continue
            p = Path(dirpath) / fn
            h = hashlib.sha256()
            with open(p, "rb") as fh:
                while chunk := fh.read(4 * _CHUNK):
                    h.update(chunk)
            out.append({"path": p.relative_to(root).as_posix(), "size": p.stat().st_size, "sha256": h.hexdigest()})
    return sorted(out, key=lambda e: e["path"])


def read_safetensors_header(path: Path | str) -> dict:
    """Parse a safetensors file's JSON header (tensor name -> {dtype, shape, data_offsets})."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kimictl.sandbox.checkpoint", description=__doc__)
    ap.add_argument("dest", type=Path)
    ap.add_argument("--size", default="512MiB", help="approximate total size, e.g. 512MiB, 1GiB (default 512MiB)")
    ap.add_argument("--shards", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--manifest", type=Path, help="also write the manifest JSON here")
    args = ap.parse_args(argv)
    manifest = generate_checkpoint(args.dest, total_bytes=parse_size(args.size), num_shards=args.shards, seed=args.seed)
    if args.manifest:
        args.manifest.write_text(json.dumps(manifest, indent=2) + "\n")
    total = sum(e["size"] for e in manifest)
    print(f"{args.dest}: {len(manifest)} files, {total} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
