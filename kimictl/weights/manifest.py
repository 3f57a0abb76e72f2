"""The checkpoint manifest: the files every host must hold, from the hub's own listing or a local directory.

The control node builds it once with the real client libraries (`modelscope_hub`, which `modelscope` delegates
to, and `huggingface_hub`; both imported lazily so `kimictl --help` never loads them) and the staging code
verifies every file against it.

- ModelScope lists `Sha256` and `Size` per file. Hugging Face lists `lfs.oid` (sha256) for LFS files, but only
  the git blob sha1 (sha1 of b"blob {size}\\0" + bytes) for small non-LFS files: that is kept as `git_sha1`.
- The whole listing is checked for unsafe names first (`check_names`): one bad name refuses the listing
  before anything is written. Then every path with a component starting with '.' is dropped: that is hub
  metadata (`.gitattributes`, `.msc`); the hubs do not serve such files to download clients, and the staging
  code keeps its own state under dot-names in the model directory.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import json
import os
import posixpath
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from kimictl.errors import InvalidInput, KimictlError
from kimictl.remote.weights_agent import file_digest, unsafe_name

DEFAULT_REVISION = {"modelscope": "master", "huggingface": "main"}
_CLIENT = {"modelscope": "modelscope_hub", "huggingface": "huggingface_hub"}
_ENDPOINT_ENV = {"modelscope": ("MODELSCOPE_ENDPOINT", "https://modelscope.cn"),
                 "huggingface": ("HF_ENDPOINT", "https://huggingface.co")}
DESCRIPTION = "quant_model_description.json"
_HEX = {"sha256": re.compile(r"[0-9a-f]{64}"), "git_sha1": re.compile(r"[0-9a-f]{40}")}
_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")
_ATTENTION = re.compile(r"\.self_attn\.(?:q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj)\.")
# Tags vllm-ascend registers a MoE scheme for (reference B3); FLOAT experts are left unquantized.
_MOE_SCHEMES = {"FLOAT", "W8A8_DYNAMIC", "W4A16", "W4A8_DYNAMIC", "W4A4_MXFP4", "W4A8_MXFP", "W8A8_MXFP8",
                "W8A8FP8_DYNAMIC", "W4A16_MXFP4"}
_NO_REVISION = re.compile(r"\brevision \S+ (?:does not exist|not found)", re.IGNORECASE)
_ASCEND = "vllm-ascend will not load it with --quantization ascend"


class UnsafeListing(InvalidInput):
    """A listing holds names that would escape or corrupt the model directory; nothing was written."""


class HubError(KimictlError):
    """The hub could not be used (exit 1). The message names endpoint and model id, never the token."""


class HubUnreachable(HubError):
    """No answer from the endpoint: connection refused, DNS, timeout."""


class HubAuthError(HubError):
    """The hub answered 401/403: the token is missing, wrong or lacks access."""


class HubNotFound(HubError):
    """The repository, revision or file does not exist on the hub."""


# One rule for both sides: the agent re-checks every name on the host before it writes.
unsafe_reason = unsafe_name


def check_names(paths: Iterable[str], *, where: str = "the file listing") -> None:
    """Raise UnsafeListing naming every unsafe, duplicate or file-vs-directory clashing name."""
    bad: list[str] = []
    seen: set[str] = set()
    for p in paths:
        if why := unsafe_reason(p) or ("listed twice" if p in seen else None):
            bad.append(f"{p!r}: {why}")
        seen.add(p)
    for p in sorted(seen):
        parents = ("/".join(p.split("/")[:i]) for i in range(1, p.count("/") + 1))
        if not unsafe_reason(p) and (clash := next((d for d in parents if d in seen), None)):
            bad.append(f"{p!r}: its parent {clash!r} is listed as a file")
    if bad:
        raise UnsafeListing(f"refusing {where}, nothing was written: unsafe names {'; '.join(bad)}",
                            hint="a hub or mirror that serves such names is broken or hostile")


class FileEntry(BaseModel):
    """One checkpoint file: repo-relative '/'-separated path, size, and the hash the listing gives for it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    size: int = Field(ge=0)
    sha256: str | None = None
    git_sha1: str | None = None

    @field_validator("path")
    @classmethod
    def _safe(cls, v: str) -> str:
        if why := unsafe_reason(v):
            raise ValueError(f"unsafe path {v!r}: {why}")
        return v

    @field_validator("sha256", "git_sha1", mode="before")
    @classmethod
    def _hex(cls, v: Any, info: ValidationInfo) -> str | None:
        if v is None or v == "":
            return None
        v = str(v).lower()
        if not _HEX[info.field_name].fullmatch(v):
            raise ValueError(f"{info.field_name} {v!r} is not a hex digest")
        return v

    @model_validator(mode="after")
    def _verifiable(self) -> FileEntry:
        if not (self.sha256 or self.git_sha1):
            raise ValueError(f"{self.path}: neither sha256 nor git_sha1 given, the file could not be verified")
        return self


class Manifest(BaseModel):
    """The files of one checkpoint revision, sorted by path."""

    model_config = ConfigDict(extra="forbid")

    source: Literal["modelscope", "huggingface", "local"]
    model_id: str
    revision: str
    files: list[FileEntry]

    @field_validator("files")
    @classmethod
    def _sorted_unique(cls, v: list[FileEntry]) -> list[FileEntry]:
        v = sorted(v, key=lambda e: e.path)
        if dup := sorted({a.path for a, b in itertools.pairwise(v) if a.path == b.path}):
            raise ValueError(f"paths listed twice: {dup}")
        return v

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def digest(self) -> str:
        """sha256 of the canonical JSON of (model_id, revision, files): what a complete host directory holds."""
        doc = {"model_id": self.model_id, "revision": self.revision, "files": [f.model_dump() for f in self.files]}
        return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def to_json(self) -> str:
        return self.model_dump_json(indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        try:
            return cls.model_validate_json(text)
        except ValidationError as exc:
            raise InvalidInput(f"not a valid weights manifest ({exc.error_count()} error(s))",
                               details=[f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:10]],
                               ) from None


# --- hub access -------------------------------------------------------------------------------------------

class _Deadline(Exception):
    pass


def _call(fn: Callable[[], Any], timeout: float) -> Any:
    """Run fn in a daemon thread and give up after timeout seconds (the clients' own retries take minutes)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["ok"] = fn()
        except Exception as exc:
            box["err"] = exc

    worker = threading.Thread(target=run, name="kimictl-hub", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise _Deadline
    if "err" in box:
        raise box["err"]
    return box["ok"]


def _prepare(source: str, revision: str | None, endpoint: str | None) -> tuple[str, str]:
    """Check the source and import its client; return (revision, 'source hub ENDPOINT') for messages."""
    if source not in _CLIENT:
        raise InvalidInput(f"cannot list weights source {source!r}: expected modelscope or huggingface "
                           "(a local directory is read with local_manifest)")
    try:
        importlib.import_module(_CLIENT[source])
    except ImportError as exc:
        raise KimictlError(f"the {source} client library ({_CLIENT[source]}) cannot be imported: {exc}") from None
    env, default = _ENDPOINT_ENV[source]
    return revision or DEFAULT_REVISION[source], f"{source} hub {endpoint or os.environ.get(env) or default}"


def _hub_error(exc: Exception, where: str, model_id: str, revision: str, path: str | None, token: str | None,
               timeout: float) -> HubError:
    """Map a client exception to a one-line HubError; the token never appears, even inside client text."""
    def clean(text: str) -> str:
        return text.replace(token, "***") if token else text

    what = f"{path} of {model_id}@{revision}" if path else f"{model_id}@{revision}"

    if isinstance(exc, _Deadline):
        return HubUnreachable(f"{where} did not answer for {what} within {timeout:g}s")
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and len(chain) < 6:
        chain.append(e)
        e = e.__cause__ or e.__context__
    names = {c.__name__ for x in chain for c in type(x).__mro__}
    status = next((s for x in chain if isinstance(s := getattr(getattr(x, "response", None), "status_code", None),
                                                   int)), None)
    details = [clean(f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}")]
    code = f" (HTTP {status})" if status else ""
    if status in (401, 403) or names & {"AuthenticationError", "PermissionDeniedError", "GatedRepoError"}:
        return HubAuthError(f"{where} refused access to {what}{code}: the token is missing, wrong or lacks access",
                            details=details)
    if status == 404 or names & {"NotExistError", "RepositoryNotFoundError", "RevisionNotFoundError",
                                 "EntryNotFoundError"}:
        if "RevisionNotFoundError" in names or any(_NO_REVISION.search(str(x)) for x in chain):
            what = f"revision {revision!r} of {model_id}"
        return HubNotFound(f"{what} not found on {where}", details=details)
    if names & {"ConnectionError", "NetworkError", "TransportError", "Timeout", "TimeoutError",
                "RequestTimeoutError"}:
        return HubUnreachable(f"cannot reach {where} for {what}", details=details)
    return HubError(f"{where} failed for {what}", details=details)


def _list(source: str, model_id: str, revision: str, endpoint: str | None,
          token: str | None) -> list[tuple[str, int, str | None, str | None]]:
    """(path, size, sha256, git_sha1) of every file in the repo, straight from the client."""
    if source == "modelscope":
        # modelscope.hub.api.HubApi.get_model_files (1.40.2) keeps only Path/Size; the modelscope_hub API it
        # delegates to also keeps Sha256.
        from modelscope_hub.api import HubApi

        files = HubApi(endpoint=endpoint, token=token).list_repo_files(model_id, "model", revision=revision)
        return [(f.path, f.size, f.sha256, None) for f in files if f.type != "tree"]
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    tree = HfApi(endpoint=endpoint, token=token).list_repo_tree(model_id, revision=revision, recursive=True)
    return [(e.path, e.lfs.size, e.lfs.sha256, None) if e.lfs else (e.path, e.size, None, e.blob_id)
            for e in tree if isinstance(e, RepoFile)]


def fetch_manifest(source: str, model_id: str, revision: str | None, endpoint: str | None, token: str | None,
                   *, timeout: float = 60) -> Manifest:
    """List model_id@revision on the hub with its real client and build the manifest (no file is downloaded).

    endpoint None means the client's own default (its env variable, else the public hub); os.environ is never
    touched. Raises UnsafeListing (exit 2) before returning if any listed name is unsafe, HubError otherwise.
    """
    revision, where = _prepare(source, revision, endpoint)
    what = f"{model_id}@{revision}"
    try:
        raw = _call(lambda: _list(source, model_id, revision, endpoint, token), timeout)
    except Exception as exc:
        raise _hub_error(exc, where, model_id, revision, None, token, timeout) from None
    check_names((p for p, *_ in raw), where=f"the listing of {what} from {where}")
    try:
        files = [FileEntry(path=p, size=size, sha256=sha, git_sha1=sha1) for p, size, sha, sha1 in raw
                 if not any(part.startswith(".") for part in p.split("/"))]
    except ValidationError as exc:
        raise HubError(f"{where} lists files of {what} that cannot be verified",
                       details=[e["msg"] for e in exc.errors()[:10]]) from None
    if not files:
        raise HubError(f"{where} lists no files for {what}")
    return Manifest(source=source, model_id=model_id, revision=revision, files=files)


def fetch_small(source: str, model_id: str, revision: str | None, endpoint: str | None, token: str | None,
                path: str, dest_dir: Path, *, timeout: float = 60) -> bytes:
    """Download one small file (an index, the quant description) into dest_dir with the real client."""
    revision, where = _prepare(source, revision, endpoint)
    check_names([path], where=f"the file name {path!r}")

    def download() -> str | Path:
        if source == "modelscope":
            from modelscope_hub.api import HubApi

            return HubApi(endpoint=endpoint, token=token).download_file(model_id, "model", path, revision=revision,
                                                                          local_dir=dest_dir)
        from huggingface_hub import hf_hub_download

        return hf_hub_download(model_id, path, revision=revision, local_dir=dest_dir, endpoint=endpoint, token=token)

    Path(dest_dir).mkdir(parents=True, exist_ok=True)
    try:
        return Path(_call(download, timeout)).read_bytes()
    except Exception as exc:
        raise _hub_error(exc, where, model_id, revision, path, token, timeout) from None


# --- local directories ------------------------------------------------------------------------------------

def _sha256_file(path: Path) -> tuple[int, str]:
    return path.stat().st_size, file_digest(path, "sha256")


def local_manifest(path: Path, model_id: str = "local") -> Manifest:
    """Hash every regular file under path (dot-names skipped, file symlinks followed, directory symlinks not)."""
    root = Path(path)
    if not root.is_dir():
        raise InvalidInput(f"{root} is not a directory")
    names: list[str] = []
    try:
        for dirpath, dirnames, filenames in os.walk(root, onerror=_raise):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = Path(dirpath).relative_to(root)
            names += [(rel / f).as_posix() for f in filenames if not f.startswith(".") and Path(dirpath, f).is_file()]
        check_names(names, where=f"the files under {root}")
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # hashlib releases the GIL
            hashes = list(pool.map(lambda n: _sha256_file(root / n), names))
    except OSError as exc:
        raise KimictlError(f"cannot read the checkpoint under {root}: {exc}") from None
    files = [FileEntry(path=n, size=size, sha256=h) for n, (size, h) in zip(names, hashes, strict=True)]
    return Manifest(source="local", model_id=model_id, revision="local", files=files)


def _raise(exc: OSError) -> None:
    raise exc


# --- shape check ------------------------------------------------------------------------------------------

def _few(items: list[str], n: int = 5) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def _tags(counts: Counter[str]) -> str:
    return ", ".join(f"{tag} ({n} tensors)" for tag, n in counts.most_common())


def _description_warnings(desc: Any) -> list[str]:
    if not isinstance(desc, dict):
        return [f"{DESCRIPTION} is not a JSON object: {_ASCEND}"]
    out = []
    experts = Counter(str(v) for k, v in desc.items() if _EXPERT.search(k))
    attention = Counter(str(v) for k, v in desc.items() if _ATTENTION.search(k))
    if not experts:
        out.append(f"{DESCRIPTION} tags no routed expert tensors (*.mlp.experts.N.*): this is not the W4A8 MoE "
                   "checkpoint the plan expects")
    elif unknown := sorted(set(experts) - _MOE_SCHEMES):
        out.append(f"routed experts are tagged {_tags(experts)}; vllm-ascend has no MoE scheme for "
                   f"{', '.join(unknown)}: {_ASCEND}")
    elif set(experts) != {"W4A8_DYNAMIC"}:
        out.append(f"routed experts are tagged {_tags(experts)}, not W4A8_DYNAMIC: the plan sizes NPU memory for "
                   "W4A8 experts, and wider experts may not fit")
    if not attention:
        out.append(f"{DESCRIPTION} tags no attention projections (*.self_attn.*_proj.*): the checkpoint does not "
                   "follow the W4A8 recipe the plan expects")
    elif set(attention) != {"W8A8"}:
        out.append(f"attention projections are tagged {_tags(attention)}, not W8A8: this is not the msModelSlim "
                   "W4A8 recipe the plan's memory and accuracy figures assume")
    if desc.get("group_size") not in (0, None):
        out.append(f"{DESCRIPTION} has group_size {desc['group_size']!r}: vllm-ascend's W4A8_DYNAMIC MoE only "
                   "supports per-channel (0) and refuses it")
    return out


def checkpoint_warnings(manifest: Manifest, read_small: Callable[[str], bytes] | None, *,
                        quantization: str | None = "ascend") -> list[str]:
    """What looks off about the checkpoint's shape, as sentences saying what it means; [] = looks right.

    read_small(path) returns a listed file's bytes (e.g. functools.partial(fetch_small, ..., dest_dir=D)); with
    None only presence is checked. quantization="ascend" adds the msModelSlim W4A8 description checks.
    """
    paths = {f.path for f in manifest.files}
    out: list[str] = []

    def read_json(name: str) -> Any:
        if read_small is None:
            return None
        try:
            return json.loads(read_small(name))
        except (KimictlError, OSError, ValueError) as exc:
            out.append(f"{name} could not be read ({exc}): its contents were not checked")
            return None

    if "config.json" not in paths:
        out.append("config.json is missing: vllm cannot build the model without it")
    if not any(p.endswith(".safetensors") for p in paths):
        out.append("no *.safetensors file is listed: there are no weights to load")
    indexes = sorted(p for p in paths if p.endswith(".safetensors.index.json"))
    if not indexes:
        out.append("no *.safetensors.index.json is listed: nothing says which shards make up the model, so a "
                   "missing shard would only show when vllm fails to load")
    for index in indexes:
        data = read_json(index)
        if data is None:
            continue
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            out.append(f"{index} has no weight_map: vllm cannot tell which shard holds which tensor")
            continue
        base = posixpath.dirname(index)
        missing = sorted({posixpath.join(base, str(s)) for s in weight_map.values()} - paths)
        if missing:
            out.append(f"{index} names {len(missing)} shard(s) missing from the listing ({_few(missing)}): "
                       "vllm will fail to load the weights")
    if quantization == "ascend":
        if DESCRIPTION not in paths:
            out.append(f"{DESCRIPTION} is missing: {_ASCEND} (it is msModelSlim's per-tensor quantization map)")
        elif (desc := read_json(DESCRIPTION)) is not None:
            out += _description_warnings(desc)
    return out
