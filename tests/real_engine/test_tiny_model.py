"""The tiny Kimi-shaped checkpoint: what vLLM needs is on disk, and transformers loads it with no key left over."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kimictl.facts import engine_profile

pytestmark = pytest.mark.real_engine

CHECK = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d = sys.argv[1]
tok = AutoTokenizer.from_pretrained(d)
model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True, dtype=torch.bfloat16)
text = "The proxy receives a completion request, then decode continues."
ids = tok(text, return_tensors="pt").input_ids
with torch.no_grad():
    logits = model(ids).logits
print(json.dumps({"vocab": len(tok), "roundtrip": tok.decode(ids[0], skip_special_tokens=True) == text,
                  "missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
                  "mismatched": [str(x) for x in info.get("mismatched_keys", [])], "arch": type(model).__name__,
                  "shape": list(logits.shape), "finite": bool(torch.isfinite(logits).all())}))
"""


def test_checkpoint_files_match_the_profile_facts(tiny_model: Path) -> None:
    text = engine_profile("cpu-smoke").facts().text
    cfg = json.loads((tiny_model / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["topk_method"] == "noaux_tc"  # without it vLLM drops e_score_correction_bias (KeyError on load)
    for key, value in text.model_dump().items():
        assert cfg[key] == value, key
    index = json.loads((tiny_model / "model.safetensors.index.json").read_text())
    shards = sorted(tiny_model.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == [p.name for p in shards]
    assert index["metadata"]["total_size"] <= sum(p.stat().st_size for p in shards)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in index["weight_map"]
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in index["weight_map"]
    assert (tiny_model / "tokenizer.json").exists() and (tiny_model / "tokenizer_config.json").exists()


def test_transformers_loads_it_and_runs_a_forward_pass(tiny_model: Path, lane_python: str) -> None:
    proc = subprocess.run([lane_python, "-c", CHECK, str(tiny_model)], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["arch"] == "DeepseekV3ForCausalLM"
    assert (got["missing"], got["unexpected"], got["mismatched"]) == ([], [], [])
    vocab = engine_profile("cpu-smoke").facts().text.vocab_size
    assert got["vocab"] == vocab and got["roundtrip"]
    assert got["shape"][0] == 1 and got["shape"][2] == vocab and got["finite"]
