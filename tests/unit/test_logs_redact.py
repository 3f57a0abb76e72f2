"""Redaction: every pattern, configured literal values, JSON/env/argv forms, and what must stay readable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimictl.errors import InvalidInput
from kimictl.logs import MASK, SECRET_ENV_VARS, Redactor

SECRET = "Zq7-secret-VALUE-93xk"


def red(text: str, *literals: str) -> tuple[str, Redactor]:
    r = Redactor.with_literals(literals)
    return r.redact(text), r


@pytest.mark.parametrize("text", [
    # env files and shells
    f"HF_TOKEN={SECRET}", f"HF_TOKEN='{SECRET}'", f'export HUGGING_FACE_HUB_TOKEN="{SECRET}"',
    f"MODELSCOPE_API_TOKEN={SECRET}", f"VLLM_API_KEY = {SECRET}", f"db_password={SECRET}", f"PASSWD={SECRET}",
    f"client_secret={SECRET}", f"AWS_CREDENTIALS={SECRET}", f"x ApiKey={SECRET} y", f"GET /m?access_token={SECRET}&a=1",
    # YAML / headers / python repr
    f"password: {SECRET}", f"  api-key: '{SECRET}'", f"Authorization: Bearer {SECRET}",
    f"authorization: Basic {SECRET}", f"Cookie: sid={SECRET}; theme=dark", f"Set-Cookie: sid={SECRET}",
    f"non-default args: {{'api_key': ['{SECRET}'], 'port': 8000}}", f"{{'token': '{SECRET}'}}",
    # JSON
    f'{{"api_key": "{SECRET}"}}', f'{{"HF_TOKEN":"{SECRET}","x":1}}', f'{{"Authorization": "Bearer {SECRET}"}}',
    f'{{"env": {{"OPENAI_API_KEY": "{SECRET}"}}}}', f'{{"password": "a\\"{SECRET}"}}',
    # argv
    f"vllm serve /m --api-key {SECRET} --port 8000", f"vllm serve /m --api-key={SECRET}",
    f"vllm serve /m --api-key '{SECRET}' \\", f'["vllm", "serve", "--api-key", "{SECRET}"]',
    f"['--api-key', '{SECRET}']", f'[\n  "--api-key",\n  "{SECRET}"\n]', f"--hf-token {SECRET}",
    # bearer anywhere
    f"curl -H 'X: y' then bearer {SECRET} done",
])
def test_every_listed_form_is_masked(text: str) -> None:
    out, r = red(text)
    assert SECRET not in out and "VALUE-93xk" not in out, out
    assert MASK in out and r.total >= 1


@pytest.mark.parametrize(("text", "value", "kind"), [
    ("pulling with hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345 now", "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345", "huggingface"),
    ("ms token ms-01635b88-cd3c-4e98-ad6a-be706be66187 used", "01635b88-cd3c-4e98-ad6a-be706be66187", "modelscope"),
    ("jar m_session_id=9f8e7d6c5b4a; path=/", "9f8e7d6c5b4a", "modelscope-session"),
    ("key sk-AbCdEfGhIjKlMnOpQrStUvWx in use", "sk-AbCdEfGhIjKlMnOpQrStUvWx", "openai"),
])
def test_token_shapes_without_a_key_are_masked(text: str, value: str, kind: str) -> None:
    out, r = red(text)
    assert value not in out and r.counts == {kind: 1}


def test_literal_values_are_masked_wherever_they_appear() -> None:
    lit = "0p3n-s3same-literal"
    text = f"no key here: {lit}\njson: {json.dumps({'note': 'x ' + lit})}\nurl: https://h/?q={lit}&x\nend{lit}end"
    out, r = red(text, lit)
    assert lit not in out and out.count(MASK) == 4 and r.counts["literal"] == 4


def test_literals_come_from_the_environment_and_the_secrets_file(tmp_path: Path) -> None:
    env = {k: f"value-of-{k.lower()}" for k in SECRET_ENV_VARS} | {"UNRELATED": "keep-this-value"}
    secrets = tmp_path / "s.txt"
    secrets.write_text("from-file-secret-1\n\n  from-file-secret-2  \nab\n")
    r = Redactor.from_config(env, secrets)
    text = " ".join([*env.values(), "from-file-secret-1", "from-file-secret-2"])
    out = r.redact(text)
    assert not any(v in out for k, v in env.items() if k != "UNRELATED")
    assert "from-file-secret" not in out and "keep-this-value" in out
    assert r.skipped_short == 1  # "ab": too short to match literally


def test_missing_secrets_file_is_invalid_input(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput):
        Redactor.from_config({}, tmp_path / "nope")


def test_json_and_env_stay_parseable_after_redaction() -> None:
    doc = {"env": {"HF_TOKEN": SECRET, "HCCL_BUFFSIZE": "1024"}, "argv": ["vllm", "--api-key", SECRET],
           "max_tokens": 16}
    out, _ = red(json.dumps(doc, indent=1))
    back = json.loads(out)
    assert back["env"] == {"HF_TOKEN": MASK, "HCCL_BUFFSIZE": "1024"}
    assert back["argv"] == ["vllm", "--api-key", MASK] and back["max_tokens"] == 16
    env_out, _ = red(f"HF_TOKEN='{SECRET}'\nVLLM_USE_V1='1'\n")
    assert env_out == f"HF_TOKEN='{MASK}'\nVLLM_USE_V1='1'\n"


@pytest.mark.parametrize("text", [
    "--max-num-batched-tokens 8192 --tokenizer-mode auto --max-model-len 4096",
    "Avg prompt throughput: 12.0 tokens/s, Avg generation throughput: 3.0 tokens/s",
    '{"max_tokens": 16, "prompt_tokens": 5, "total_tokens": 21, "usage": {"completion_tokens": 16}}',
    "long_prefill_token_threshold=2048 num_tokens=4", "vllm:prompt_tokens_total 128.0",
    "HCCL_BUFFSIZE=1024 ASCEND_RT_VISIBLE_DEVICES=0,1,2,3 task-queue disk-usage 10ms-",
])
def test_ordinary_engine_output_is_untouched(text: str) -> None:
    out, r = red(text)
    assert out == text and r.total == 0


def test_a_benign_word_does_not_shield_a_secret_key() -> None:
    out, _ = red(f"secret_tokens={SECRET}")
    assert SECRET not in out


def test_counts_do_not_double_count_a_literal_inside_a_key_form() -> None:
    out, r = red(f"HF_TOKEN={SECRET}", SECRET)
    assert out == f"HF_TOKEN={MASK}" and r.counts == {"literal": 1}


def test_large_input_without_secrets_is_unchanged() -> None:
    line = "INFO engine 000: Avg prompt throughput: 1.0 tokens/s, Running: 1 reqs, KV cache usage: 0.1%\n"
    text = line * 20000 + f"tail HF_TOKEN={SECRET}\n"
    out, r = red(text)
    assert out.startswith(line * 20000) and SECRET not in out and r.total == 1
