"""YAML loading that remembers where each key came from, so errors can point at file:line."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

from kimictl.errors import InvalidInput


class LineMap(dict):
    """A dict that also knows the line of each key (1-based) and of the mapping itself."""

    line: int = 0
    key_lines: dict[str, int]
    typed_keys: dict[str, Any]   # keys YAML read as another type (null, a boolean, a number), by their str()

    def line_of(self, key: str) -> int:
        return self.key_lines.get(key, self.line)


class _LineLoader(yaml.SafeLoader):
    pass


class _MergeError(yaml.constructor.ConstructorError):
    """`<<:` given something other than a mapping (or a list of mappings): the mapping holding it is `node`."""

    def __init__(self, node: yaml.MappingNode, key: yaml.Node, value: yaml.Node) -> None:
        kind = "a list of plain values" if isinstance(value, yaml.SequenceNode) else "a plain value"
        super().__init__(None, None, f"`<<:` merges {kind}, not a mapping of key: value", key.start_mark)
        self.node = node


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode, deep: bool = False) -> LineMap:
    # Merge keys (`<<: *defaults`) read the way Ansible reads them: the merged mappings' keys first, each key
    # written in this mapping wins over a merged one; only a key written twice in this mapping is a duplicate.
    own = {id(k) for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"}
    for key_node, value_node in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge" and not (
                isinstance(value_node, yaml.MappingNode) or (isinstance(value_node, yaml.SequenceNode)
                and all(isinstance(v, yaml.MappingNode) for v in value_node.value))):
            raise _MergeError(node, key_node, value_node)
    loader.flatten_mapping(node)
    out = LineMap()
    out.line = node.start_mark.line + 1
    out.key_lines = {}
    out.typed_keys = {}
    written: set[str] = set()
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, str):
            out.typed_keys[str(key)] = key
            key = str(key)
        if id(key_node) in own:
            if key in written:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}' (first at line {out.key_lines[key]})", key_node.start_mark
                )
            written.add(key)
        out[key] = loader.construct_object(value_node, deep=True)
        out.key_lines[key] = key_node.start_mark.line + 1
    return out


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)

# Aliases (*name) share one parsed node, but everything that walks the result (validation, merging, rendering)
# sees every repetition: nested aliases ("billion laughs") expand a small file into billions of values. An
# inventory of a few hundred hosts or any topology is far below this many values once aliases are expanded.
MAX_EXPANDED_NODES = 100_000


def _expanded_size(root: yaml.Node, cap: int) -> tuple[int, yaml.Node | None]:
    """The number of nodes the document has with every alias expanded (stopping above cap), and the first node
    that refers back to one of its own ancestors (a recursive alias, infinite once expanded), if any."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            children = _children(node)
            size[key] = min(cap + 1, 1 + sum(size[id(c)] for c in children))
            continue
        if key in size:
            continue
        if key in on_path:
            return cap + 1, node
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in size)
    return size[id(root)], None


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


MAX_BYTES = 16 << 20   # far above any inventory or topology; /dev/zero and the like stop here


def _read(path: Path, what: str) -> str:
    """The file's text: a regular file of at most MAX_BYTES (a device, or a pipe nobody writes, is refused at once,
    never read forever)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)   # O_NONBLOCK: opening a FIFO must not wait for a writer
    except FileNotFoundError:
        raise InvalidInput(f"{what} not found: {path}") from None
    except OSError as exc:
        raise InvalidInput(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            kind = "a directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "not a regular file"
            raise InvalidInput(f"cannot read {what} {path}: it is {kind}")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise InvalidInput(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        raise InvalidInput(f"{what} {path} is larger than {MAX_BYTES >> 20} MiB: not an {what} file")
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise InvalidInput(f"{path}:{line}: {what} is not UTF-8 text (byte {data[exc.start]:#04x})") from None


def _path_of(root: yaml.Node, target: yaml.Node) -> str:
    """The key path (`templates[1].envs`) of the first place `target` appears under root ("" for root itself)."""
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    while stack:
        node, at = stack.pop()
        if node is target:
            return at
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            items = [(v, f"{at}.{k.value}" if at else str(k.value)) for k, v in node.value
                     if isinstance(k, yaml.ScalarNode)]
        elif isinstance(node, yaml.SequenceNode):
            items = [(v, f"{at}[{i}]") for i, v in enumerate(node.value)]
        else:
            items = []
        stack.extend(reversed(items))
    return ""


def _oversized_path(node: yaml.Node, cap: int) -> tuple[str, yaml.Node]:
    """Where an oversized document grows: the key path down to the smallest value that still expands past cap."""
    path: list[str] = []
    while True:
        if isinstance(node, yaml.MappingNode):
            pairs = [(k, v) for k, v in node.value]
        elif isinstance(node, yaml.SequenceNode):
            pairs = [(None, v) for v in node.value]
        else:
            break
        big = next(((k, v) for i, (k, v) in enumerate(pairs) if _expanded_size(v, cap)[0] > cap), None)
        if big is None:
            break
        key, node = big
        index = [v for _, v in pairs].index(node)
        path.append(str(key.value) if isinstance(key, yaml.ScalarNode) else f"[{index}]")
    return ".".join(path).replace(".[", "["), node


def load_yaml(path: Path, what: str) -> Any:
    """Parse a YAML file; syntax errors become InvalidInput naming file:line."""
    text = _read(path, what)
    loader = None
    try:
        loader = _LineLoader(text)
        node = loader.get_single_node()
        if node is None:
            return None
        size, loop = _expanded_size(node, MAX_EXPANDED_NODES)
        if loop is not None:
            raise InvalidInput(f"{path}:{loop.start_mark.line + 1}: the YAML anchor (&name) here is used inside "
                               f"itself (*name), so the {what} never ends")
        if size > MAX_EXPANDED_NODES:
            key, where = _oversized_path(node, MAX_EXPANDED_NODES)
            raise InvalidInput(f"{path}:{where.start_mark.line + 1}: {key or what} expands to more than "
                               f"{MAX_EXPANDED_NODES} values through YAML aliases (*name); write the values out or "
                               "use fewer nested aliases")
        doc = loader.construct_document(node)
    except _MergeError as exc:
        key = _path_of(node, exc.node) or what
        raise InvalidInput(f"{path}:{exc.problem_mark.line + 1}: {key}: {exc.problem}; write {key} as a mapping "
                           "(or merge a mapping: `<<: *name` where &name is a mapping)") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = "; ".join(x for x in (exc.context, exc.problem) if x) or str(exc)
        raise InvalidInput(f"{where}: invalid YAML in {what}: {problem}") from None
    except yaml.reader.ReaderError as exc:
        line = text[:exc.position].count("\n") + 1
        char = exc.character if isinstance(exc.character, int) else ord(exc.character)
        raise InvalidInput(f"{path}:{line}: invalid YAML in {what}: the character U+{char:04X} is not allowed "
                           "in YAML") from None
    except yaml.YAMLError as exc:
        raise InvalidInput(f"{path}: invalid YAML in {what}: {exc}") from None
    except RecursionError:
        raise InvalidInput(f"{path}: {what} is nested too deeply to read") from None
    finally:
        if loader is not None:
            loader.dispose()
    nul = _nul_at(doc)
    if nul:
        key, line = nul
        raise InvalidInput(f"{path}:{line}: {key or what} holds a NUL character (\\0): no argument, environment "
                           "variable or file name can carry it")
    return doc


def _nul_at(doc: Any, key: str = "", line: int = 1) -> tuple[str, int] | None:
    """The key path and line of the first string (or key) holding a NUL character (a "\\0" escape in YAML)."""
    if isinstance(doc, str):
        return (key, line) if "\0" in doc else None
    if isinstance(doc, LineMap):
        for k, v in doc.items():
            path = f"{key}.{k}" if key else k
            found = (path, doc.line_of(k)) if "\0" in k else _nul_at(v, path, doc.line_of(k))
            if found:
                return found
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            found = _nul_at(v, f"{key}[{i}]", line)
            if found:
                return found
    return None


def yaml_type_hint(value: Any) -> str:
    """Explain values YAML typed differently from what the user probably meant."""
    if isinstance(value, bool):
        return f" (YAML read this as the boolean {value}: yes/no/on/off/true/false are booleans; quote it)"
    if value is None:
        return " (YAML read this as null: an empty value or ~; give a value)"
    if isinstance(value, (int, float)):
        return f" (YAML read this as the number {value!r}; quote it if it is a name)"
    return ""
