"""vllm-ascend's source distributions for tests (fetched, sha256-verified and cached by kimictl/upstream.py).

The sdists carry vllm-ascend's own multi-node CI recipes and its source. Tests read both from an extracted copy in
the cache (KIMICTL_UPSTREAM_CACHE, default ~/.cache/kimictl/upstream); nothing is copied into the repository. When
the cache has no verified copy and the index cannot be reached, `sdist()` skips the test and says why.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import yaml
from prerequisites import require_or_skip

from kimictl import upstream

# kimictl's pins (package, sdists: file, sha256, profile) plus the test-only recipe selection.
TEST_PINS = Path(__file__).resolve().parents[1] / "data" / "upstream.yml"
PINS = {**upstream.pins(), **yaml.safe_load(TEST_PINS.read_text())}


@cache
def sdist(release: str) -> Path:
    """The extracted source tree of a pinned release; skips the test when it cannot be had (and says why). A tarball
    with other bytes than pinned fails the test."""
    try:
        return upstream.source_tree(release)
    except upstream.UpstreamUnavailable as exc:
        require_or_skip(f"vllm-ascend {release} sdist: {exc.message}")


def recipe_paths() -> list[Path]:
    """The Kimi P/D CI recipes of the pinned recipe release, sorted."""
    root = sdist(PINS["recipes"]["release"])
    return sorted(root.glob(PINS["recipes"]["glob"]))


# --- what a release reads, from its source (parsed with ast, never imported) ------------------------------------


def _text(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _mapping_reads(tree: ast.AST, is_mapping) -> set[str]:
    """String keys read from a mapping: m.get("k"), m["k"], "k" in m, and helper(m, "k", ...) calls."""
    keys: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault") and is_mapping(f.value) \
                    and n.args and _text(n.args[0]):
                keys.add(_text(n.args[0]))
            for i, arg in enumerate(n.args):
                if is_mapping(arg):
                    key = next((_text(a) for a in n.args[i + 1:] if _text(a)), None)
                    if key:
                        keys.add(key)
        elif isinstance(n, ast.Subscript) and is_mapping(n.value) and _text(n.slice):
            keys.add(_text(n.slice))
        elif isinstance(n, ast.Compare) and len(n.ops) == 1 and isinstance(n.ops[0], (ast.In, ast.NotIn)) \
                and is_mapping(n.comparators[0]) and _text(n.left):
            keys.add(_text(n.left))
    return keys


def _named(name: str):
    return lambda n: (isinstance(n, ast.Name) and n.id == name) or (isinstance(n, ast.Attribute) and n.attr == name)


def _class(tree: ast.AST, name: str) -> ast.ClassDef | None:
    return next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name), None)


def _fields(cls: ast.ClassDef | None) -> set[str]:
    if cls is None:
        return set()
    return {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            and not s.target.id.startswith("_")}


class SourceKeys:
    """The additional_config keys, scheduler_config keys and env vars one vllm-ascend release reads."""

    def __init__(self, root: Path) -> None:
        pkg = root / "vllm_ascend"
        config = ast.parse((pkg / "ascend_config.py").read_text())
        top: set[str] = set()
        for path in sorted(pkg.rglob("*.py")):  # keys are read outside ascend_config.py too (platform, utils)
            try:
                top |= _mapping_reads(ast.parse(path.read_text()), _named("additional_config"))
            except SyntaxError:
                continue
        ascend = _class(config, "AscendConfig")
        # 0.28+: AscendConfig is a pydantic dataclass; its fields are keys, plus the keys init_ascend_config strips
        # before validation (consumed elsewhere, or derived and ignored).
        top |= _fields(ascend)
        for n in ast.walk(config):
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_NON_USER_INPUT_KEYS"
                                                 for t in n.targets):
                top |= {k for e in n.value.elts if (k := _text(e)) and not k.startswith("_")}
        self.additional_config = top
        self.scheduler_config = _mapping_reads(config, _named("scheduler_config")) | _fields(
            _class(config, "SchedulerConfig")) if "scheduler_config" in top else set()
        self.strict = ascend is not None and re.search(r"extra\s*=\s*['\"]forbid", ast.unparse(ascend)) is not None
        env: set[str] = set()
        for tree in (ast.parse((pkg / "envs.py").read_text()), config):
            for n in ast.walk(tree):
                if isinstance(n, ast.Dict):  # envs.py: env_variables = {"NAME": lambda: ...}
                    env |= {k for key in n.keys if key is not None and (k := _text(key)) and k.isupper()}
                elif isinstance(n, ast.Call) and n.args and _text(n.args[0]) and (
                        (isinstance(n.func, ast.Attribute) and n.func.attr == "getenv")
                        or (isinstance(n.func, ast.Attribute) and n.func.attr == "get"
                            and _named("environ")(n.func.value))):
                    env.add(_text(n.args[0]))
                elif isinstance(n, ast.Compare) and len(n.ops) == 1 and isinstance(n.ops[0], ast.In) \
                        and _named("environ")(n.comparators[0]) and _text(n.left):
                    env.add(_text(n.left))
        self.env = env


@cache
def source_keys(release: str) -> SourceKeys:
    return SourceKeys(sdist(release))
