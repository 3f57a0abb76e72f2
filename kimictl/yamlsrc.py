"""YAML loading that remembers where each key came from, so errors can point at file:line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kimictl.errors import InvalidInput


class LineMap(dict):
    """A dict that also knows the line of each key (1-based) and of the mapping itself."""

    line: int = 0
    key_lines: dict[str, int]

    def line_of(self, key: str) -> int:
        return self.key_lines.get(key, self.line)


class _LineLoader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode, deep: bool = False) -> LineMap:
    loader.flatten_mapping(node)
    out = LineMap()
    out.line = node.start_mark.line + 1
    out.key_lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, str):
            key = str(key)
        if key in out:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key '{key}' (first at line {out.key_lines[key]})", key_node.start_mark
            )
        out[key] = loader.construct_object(value_node, deep=True)
        out.key_lines[key] = key_node.start_mark.line + 1
    return out


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(path: Path, what: str) -> Any:
    """Parse a YAML file; syntax errors become InvalidInput naming file:line."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InvalidInput(f"{what} not found: {path}") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"cannot read {what} {path}: {exc}") from None
    try:
        return yaml.load(text, Loader=_LineLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise InvalidInput(f"{where}: invalid YAML in {what}: {exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise InvalidInput(f"{path}: invalid YAML in {what}: {exc}") from None


def yaml_type_hint(value: Any) -> str:
    """Explain values YAML typed differently from what the user probably meant."""
    if isinstance(value, bool):
        return f" (YAML read this as the boolean {value}: yes/no/on/off/true/false are booleans; quote it)"
    if value is None:
        return " (YAML read this as null: an empty value or ~; give a value)"
    if isinstance(value, (int, float)):
        return f" (YAML read this as the number {value!r}; quote it if it is a name)"
    return ""
