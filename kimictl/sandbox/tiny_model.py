"""A tiny random checkpoint with Kimi K2.5's text architecture (DeepSeek-V3: MLA + MoE) and a local BPE tokenizer.

Run with the real-engine lane's python, which has torch, transformers and tokenizers (kimictl itself does not
depend on them; no CLI path imports this module):

    KIMICTL_VLLM_PYTHON -m kimictl.sandbox.tiny_model DEST [--seed N] [--shard-size 2MB]

The shape is read from kimictl/data/models/tiny-deepseek-v3.yml, the facts the planner uses for the `cpu-smoke`
engine profile. DEST gets config.json (with `topk_method: noaux_tc` written explicitly: without it vLLM drops
`e_score_correction_bias` and loading fails with a KeyError), generation_config.json, safetensors shards with an
index, and a byte-level BPE tokenizer trained here on a built-in corpus (no hub, no download).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

FACTS = Path(__file__).resolve().parents[1] / "data" / "models" / "tiny-deepseek-v3.yml"
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# A small English corpus about what the lane serves; byte-level BPE still encodes any text.
CORPUS = """\
Kimi K2.5 serves on Atlas hosts with prefill and decode split across engines; the decode side pulls the KV cache
of this prompt from the prefill side before it generates. The planner assigns hosts to roles, data parallel ranks
to processes and tensor parallel groups to devices, then renders one command line per engine.
A mixture of experts layer routes every token to a few experts and one shared expert; multi-head latent attention
caches a compressed latent per token instead of full keys and values, so the cache is small and easy to move.
The proxy receives a completion request, sends the prompt to a prefill engine for one token, then asks a decode
engine to continue from the transferred cache. Health checks read the metrics endpoint and count prompt tokens,
generation tokens and external prefix cache queries. The supervisor restarts an engine that crashes and keeps its
logs; the operator reads the status, the logs and the plan before changing anything.
The quick brown fox jumps over the lazy dog. One two three four five six seven eight nine ten eleven twelve.
Hello, world! How are you today? The weather is fine, the servers are warm and the tokens keep flowing.
"""


def load_facts(path: Path = FACTS) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def train_tokenizer(vocab_size: int, corpus: str):
    """Byte-level BPE with `vocab_size` entries (the 3 special tokens included), trained on `corpus`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = [ln for ln in corpus.splitlines() if ln.strip()]
    tok.train_from_iterator(lines * 8, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} entries, want {vocab_size}: enlarge the corpus")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[1],
                                   pad_token=SPECIAL_TOKENS[2], model_max_length=1 << 20)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def model_config(text: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3 config.json values for the text facts (the keys vLLM's DeepseekV2/V3 loader reads)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": text["vocab_size"],
        "hidden_size": text["hidden_size"],
        "intermediate_size": text["intermediate_size"],
        "moe_intermediate_size": text["moe_intermediate_size"],
        "num_hidden_layers": text["num_hidden_layers"],
        "first_k_dense_replace": text["first_k_dense_replace"],
        "moe_layer_freq": 1,
        "num_attention_heads": text["num_attention_heads"],
        "num_key_value_heads": text["num_attention_heads"],
        "n_routed_experts": text["n_routed_experts"],
        "n_shared_experts": text["n_shared_experts"],
        "num_experts_per_tok": text["num_experts_per_tok"],
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "q_lora_rank": text["q_lora_rank"],
        "kv_lora_rank": text["kv_lora_rank"],
        "qk_nope_head_dim": text["qk_nope_head_dim"],
        "qk_rope_head_dim": text["qk_rope_head_dim"],
        "v_head_dim": text["v_head_dim"],
        "max_position_embeddings": text["max_position_embeddings"],
        "rope_theta": 50000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def expected_tensors(text: dict[str, Any]) -> set[str]:
    """The parameter names vLLM's DeepSeek-V3 loader expects, one per tensor (experts unfused)."""
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(text["num_hidden_layers"]):
        p = f"model.layers.{i}"
        names |= {f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"}
        names |= {f"{p}.self_attn.{n}.weight" for n in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                                           "kv_a_layernorm", "kv_b_proj", "o_proj")}
        mlps = [f"{p}.mlp"] if i < text["first_k_dense_replace"] else (
            [f"{p}.mlp.experts.{e}" for e in range(text["n_routed_experts"])] + [f"{p}.mlp.shared_experts"])
        if i >= text["first_k_dense_replace"]:
            names |= {f"{p}.mlp.gate.weight", f"{p}.mlp.gate.e_score_correction_bias"}
        names |= {f"{m}.{proj}.weight" for m in mlps for proj in ("gate_proj", "up_proj", "down_proj")}
    return names


def random_state(text: dict[str, Any], seed: int) -> dict[str, Any]:
    """Deterministic random bf16 weights with DeepSeek-V3's shapes (norms 1, router bias 0)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, heads = text["hidden_size"], text["num_attention_heads"]
    qk = text["qk_nope_head_dim"] + text["qk_rope_head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (text["vocab_size"], h), "lm_head.weight": (text["vocab_size"], h),
    }
    for i in range(text["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.self_attn.q_a_proj.weight": (text["q_lora_rank"], h),
            f"{p}.self_attn.q_b_proj.weight": (heads * qk, text["q_lora_rank"]),
            f"{p}.self_attn.kv_a_proj_with_mqa.weight": (text["kv_lora_rank"] + text["qk_rope_head_dim"], h),
            f"{p}.self_attn.kv_b_proj.weight": (heads * (text["qk_nope_head_dim"] + text["v_head_dim"]),
                                                text["kv_lora_rank"]),
            f"{p}.self_attn.o_proj.weight": (h, heads * text["v_head_dim"]),
        })
        if i < text["first_k_dense_replace"]:
            mlps = {f"{p}.mlp": text["intermediate_size"]}
        else:
            mlps = {f"{p}.mlp.experts.{e}": text["moe_intermediate_size"] for e in range(text["n_routed_experts"])}
            mlps[f"{p}.mlp.shared_experts"] = text["moe_intermediate_size"] * text["n_shared_experts"]
            shapes[f"{p}.mlp.gate.weight"] = (text["n_routed_experts"], h)
        for m, inter in mlps.items():
            shapes.update({f"{m}.gate_proj.weight": (inter, h), f"{m}.up_proj.weight": (inter, h),
                           f"{m}.down_proj.weight": (h, inter)})
    state = {name: (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
             for name, shape in sorted(shapes.items())}
    for i in range(text["num_hidden_layers"]):
        p = f"model.layers.{i}"
        ones = {f"{p}.input_layernorm.weight": h, f"{p}.post_attention_layernorm.weight": h,
                f"{p}.self_attn.q_a_layernorm.weight": text["q_lora_rank"],
                f"{p}.self_attn.kv_a_layernorm.weight": text["kv_lora_rank"]}
        state.update({k: torch.ones(n, dtype=torch.bfloat16) for k, n in ones.items()})
        if i >= text["first_k_dense_replace"]:
            # noaux_tc routing reads this bias in float32 (DeepSeek-V3 checkpoints store it so).
            state[f"{p}.mlp.gate.e_score_correction_bias"] = torch.zeros(text["n_routed_experts"],
                                                                          dtype=torch.float32)
    state["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    return state


def write_shards(state: dict[str, Any], dest: Path, shard_bytes: int) -> list[str]:
    """safetensors shards of at most ~shard_bytes each, plus model.safetensors.index.json."""
    from safetensors.torch import save_file

    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name in sorted(state):
        t = state[name]
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    files, weight_map, total = [], {}, 0
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(dest / fname), metadata={"format": "pt"})
        files.append(fname)
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files


def generate(dest: Path, seed: int = 0, shard_bytes: int = 2 << 20, facts: dict[str, Any] | None = None) -> dict:
    """Write the checkpoint and tokenizer into dest (created; existing files of the same names are replaced)."""
    facts = facts or load_facts()
    text = facts["text"]
    dest.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(text["vocab_size"], CORPUS)
    tok.save_pretrained(str(dest))
    state = random_state(text, seed)
    missing, extra = expected_tensors(text) - set(state), set(state) - expected_tensors(text)
    if missing or extra:  # the generator and the loader's naming must agree, or vLLM fails late and obscurely
        raise SystemExit(f"tensor names disagree with DeepSeek-V3: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(extra)[:5]}")
    files = write_shards(state, dest, shard_bytes)
    (dest / "config.json").write_text(json.dumps(model_config(text), indent=2) + "\n")
    (dest / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "do_sample": False}, indent=2) + "\n")
    params = sum(t.numel() for t in state.values())
    return {"dest": str(dest), "model": facts["name"], "parameters": params, "shards": files,
            "vocab_size": len(tok)}


def _size(text: str) -> int:
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
    for unit, mult in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kimictl.sandbox.tiny_model", description=__doc__.splitlines()[0])
    ap.add_argument("dest", type=Path, help="directory to write the checkpoint into")
    ap.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    ap.add_argument("--shard-size", default="2MB", help="max bytes per safetensors shard, e.g. 2MB (default)")
    args = ap.parse_args(argv)
    try:
        shard_bytes = _size(args.shard_size)
    except ValueError:
        ap.error(f"--shard-size: '{args.shard_size}' is not a size like 2MB")
    try:
        import safetensors  # noqa: F401
        import tokenizers  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        print(f"tiny_model: {exc.name} is missing; run this with the real-engine lane's python "
              "(bash scripts/vllm_lane.sh prints it)", file=sys.stderr)
        return 2
    print(json.dumps(generate(args.dest, args.seed, shard_bytes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
