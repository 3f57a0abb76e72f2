"""Facts as data: hardware catalogue, model facts, vllm-ascend version profiles and switch rules."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from kimictl.errors import InvalidInput

DATA_DIR = Path(__file__).parent / "data"
GIB = 1024**3
MIB = 1024**2


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Hardware(Strict):
    name: str
    description: str
    chip: str
    npu_smi_names: list[str]   # the chip names `npu-smi info` may show for this model
    npus: int
    chips_per_npu: int
    hbm_mib: int
    soc_version: str
    image_suffix: str
    kv_port_min: int
    fused_mc2: bool
    device_ping: str
    device_ip_query: str
    super_pod: bool

    @property
    def hbm_bytes(self) -> int:
        return self.hbm_mib * MIB


class TextConfig(Strict):
    num_hidden_layers: int
    first_k_dense_replace: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    vocab_size: int
    max_position_embeddings: int


class VisionConfig(Strict):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    merge_kernel: int


class QuantBytes(Strict):
    routed_experts: float
    attention: float
    shared_experts: float
    dense_mlp: float
    router: float
    embeddings: float
    lm_head: float
    vision: float
    projector: float


class ModelFacts(Strict):
    name: str
    model_id: str                # hub id; kimi_model_id selects these facts by it (case-insensitively)
    served_model_name: str
    text: TextConfig
    vision: VisionConfig
    quant: QuantBytes
    scale_bytes_per_channel: int
    checkpoint_shards: int = 1   # weight files the checkpoint is cut into (the weights fleet bench)
    kv_cache_dtype_bytes: int
    runtime_reserve_mib: int
    hccl_buffers: int
    activation_bytes_per_token: int
    drafts: dict[str, float]     # speculative method -> draft checkpoint GiB per NPU (estimate)

    @functools.cached_property
    def parts(self) -> dict[str, int]:
        """Checkpoint bytes per part, derived from the architecture and the W4A8 scheme."""
        t, v, q = self.text, self.vision, self.quant
        h = t.hidden_size
        moe_layers = t.num_hidden_layers - t.first_k_dense_replace
        heads = t.num_attention_heads
        # MLA projections: q_a, q_b, kv_a (latent + rope), kv_b, o.
        attn_shapes = [
            (h, t.q_lora_rank),
            (t.q_lora_rank, heads * (t.qk_nope_head_dim + t.qk_rope_head_dim)),
            (h, t.kv_lora_rank + t.qk_rope_head_dim),
            (t.kv_lora_rank, heads * (t.qk_nope_head_dim + t.v_head_dim)),
            (heads * t.v_head_dim, h),
        ]
        attn_params = sum(i * o for i, o in attn_shapes) * t.num_hidden_layers
        attn_channels = sum(o for _, o in attn_shapes) * t.num_hidden_layers
        expert_params = 3 * h * t.moe_intermediate_size  # gate, up, down
        expert_channels = 2 * t.moe_intermediate_size + h
        n_experts = t.n_routed_experts * moe_layers
        shared = t.n_shared_experts * moe_layers
        vis_layer = (v.hidden_size * 3 * v.hidden_size + v.hidden_size**2
                     + 2 * v.hidden_size * v.intermediate_size)
        merged = v.hidden_size * v.merge_kernel
        sc = self.scale_bytes_per_channel
        return {
            "routed_experts": round(n_experts * (expert_params * q.routed_experts + expert_channels * sc)),
            "attention": round(attn_params * q.attention + attn_channels * sc),
            "shared_experts": round(shared * (expert_params * q.shared_experts + expert_channels * sc)),
            "dense_mlp": round(t.first_k_dense_replace * 3 * h * t.intermediate_size * q.dense_mlp),
            "router": round(moe_layers * t.n_routed_experts * h * q.router),
            "embeddings": round(t.vocab_size * h * q.embeddings),
            "lm_head": round(t.vocab_size * h * q.lm_head),
            "vision": round(v.num_hidden_layers * vis_layer * q.vision),
            "projector": round((merged * merged + merged * h) * q.projector),
        }

    @property
    def total_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def kv_bytes_per_token(self) -> int:
        """MLA caches one latent (kv_lora + rope) per layer; every TP rank holds the whole latent."""
        t = self.text
        return (t.kv_lora_rank + t.qk_rope_head_dim) * t.num_hidden_layers * self.kv_cache_dtype_bytes


# Parts sharded by expert parallelism, by tensor parallelism, or replicated on every NPU.
EP_PARTS = ("routed_experts",)
TP_PARTS = ("attention", "shared_experts", "dense_mlp", "embeddings", "lm_head")
REPLICATED_PARTS = ("router", "vision", "projector")  # vision runs data-parallel (--mm-encoder-tp-mode data)


class SwitchSpelling(Strict):
    env: str | None = None
    additional_config: str | None = None  # a key; "a.b" nests: {"a": {"b": value}} (scheduler_config from 0.26)
    value: Any                 # what "on" is spelled as
    off_value: Any = None      # what an explicit "off" is spelled as; None = leave unset


class Compat(Strict):
    cann: list[str]
    driver_min: str                      # preflight fails below it (VER-001)
    driver_validated: str | None = None  # the HDK upstream validates this release with; preflight warns below it


_VERSION = re.compile(r"^v?(\d+(?:\.\d+)*)(?:(a|b|rc)(\d+))?(?:\.post(\d+))?$")


def version_key(v: str) -> tuple:
    """Order vllm-ascend versions: 0.26.0rc1 < 0.26.0 < 0.26.0.post1 (PEP 440 subset); unparsable sorts first."""
    m = _VERSION.match(v.strip())
    if not m:
        return ((), (-1, 0), 0)
    nums = tuple(int(x) for x in m.group(1).split("."))
    pre = ({"a": 0, "b": 1, "rc": 2}[m.group(2)], int(m.group(3))) if m.group(2) else (3, 0)
    return (nums, pre, int(m.group(4) or 0))


class CheckSpec(Strict):
    id: str
    severity: Literal["error", "warning", "info"]
    title: str
    fix: str


class VersionProfile(Strict):
    version: str
    upstream: str | None = None  # the PyPI release this profile was checked against (also accepted as its name)
    image_tag: str
    image_repo: str
    vllm: str
    cann: str
    torch_npu: str
    python: str
    kv_connector: str
    kv_connector_module_path: str | None = None
    compat: Compat
    switches: dict[str, SwitchSpelling]
    env: dict[str, str]
    env_prepend: dict[str, str] = Field(default_factory=dict)
    removed_env: dict[str, str] = Field(default_factory=dict)
    removed_additional_config: dict[str, str] = Field(default_factory=dict)
    # Keys this release's AscendConfig reads (tests check them against its source); None: not recorded.
    additional_config_keys: list[str] | None = None
    scheduler_config_keys: list[str] | None = None   # under additional_config.scheduler_config (0.26+)
    strict_additional_config: bool = False           # unknown keys fail start-up (extra="forbid", 0.28+)
    # Serve flag values this release's vLLM does not take (removed from renders, with a plan warning).
    drop_serve: dict[str, list[Any]] = Field(default_factory=dict)
    # Libraries preloaded when present where the engine runs (the image installs them; e.g. jemalloc).
    preload: list[str] = Field(default_factory=list)

    def image(self, hw: Hardware, repo: str | None = None) -> str:
        """The engine image: the profile's repository (or `repo`, a mirror's), its tag and the hardware's suffix."""
        return f"{repo or self.image_repo}:{self.image_tag}{hw.image_suffix}"

    @property
    def prerelease(self) -> bool:
        return version_key(self.version)[1][0] < 3

    def names(self) -> set[str]:
        """Strings that name this profile in kimi_vllm_ascend_version (without a leading v)."""
        return {self.version, self.image_tag.lstrip("v"), *([self.upstream] if self.upstream else [])}


class ConnectorPort(Strict):
    """The fixed port a KV connector binds on the hosts of `roles`: the instance's kv_port (`{port_base}` in env
    values) plus the engine's DP rank (`{port}`). The plan reserves it and preflight checks it free."""

    what: str                                                # e.g. "NIXL side channel"
    roles: list[Literal["prefill", "decode"]] = Field(min_length=1)


class ConnectorRouter(Strict):
    """What one P/D router kind needs for this connector."""

    args: list[str] = Field(default_factory=list)  # added to the router's command line
    prefill_bootstrap_port: bool = False           # the router gets each prefill URL followed by its connector port
    # The router learns the prefill engines' ids once, at its start, from this path on each prefill's connector port:
    # the proxy front watches it and restarts the routers when the ids change (a prefill engine restarted).
    engine_ids_at_start: str | None = None


class KvTransfer(Strict):
    """A P/D KV connector of a non-Ascend engine profile. Placeholders: {cluster} (kimi_cluster) in extra_config;
    {ip} (the host's IP), {nic} (kimi_nic), {port} and {port_base} (ConnectorPort) in env values."""

    kv_connector: str
    module: str | None = None         # a shim of kimictl's own, shipped to <kimi_state_dir>/bin/<module>.py and
    #                                   loaded through kv_connector_module_path (PYTHONPATH=<kimi_state_dir>/bin)
    config: dict[str, Any] = Field(default_factory=dict)        # more top-level --kv-transfer-config keys
    extra_config: dict[str, Any] = Field(default_factory=dict)  # kv_connector_extra_config
    env: dict[str, str] = Field(default_factory=dict)
    port: ConnectorPort | None = None
    routers: dict[str, ConnectorRouter] = Field(min_length=1)   # the router kinds that speak its P/D protocol


class EngineMetrics(Strict):
    """Prometheus names the engine exposes that a rollout's drain reads (its own spelling, per engine)."""

    busy: list[str] = Field(min_length=1)      # gauges: > 0 while the engine runs, queues or holds work
    activity: list[str] = Field(min_length=1)  # counters: any change means it served something meanwhile
    running: list[str] = Field(min_length=1)   # gauges: requests in its batch (heal: > 0 with no activity = hung)


class EngineProfile(Strict):
    """What engine runs and how it is spelled (data/engines/*.yml); `ascend` is production."""

    name: str
    description: str
    command: str                 # default engine command; kimi_engine_command replaces it
    serve_args: list[str]        # after the command, before kimictl's flags; "{model_dir}" is kimi_model_dir
    ascend: bool                 # Ascend env, version env/env_prepend, switches and additional-config apply
    runtime: Literal["container", "host"] | None = None  # required kimi_runtime, if any
    model: str | None = None     # models/<model>.yml whatever kimi_model_id says (else kimi_model_id picks)
    serve: dict[str, Any] = Field(default_factory=dict)             # overlaid on the topology's serve flags
    drop_serve: dict[str, list[Any]] = Field(default_factory=dict)  # flag: values removed (with a warning)
    env: dict[str, str] = Field(default_factory=dict)               # replaces the version profile's env
    # P/D connectors by name, the first the default (kimi_kv_connector picks another); none: the version
    # profile's connector (MooncakeConnectorV1).
    kv_connectors: dict[str, KvTransfer] = Field(default_factory=dict)
    min_ready_timeout_s: float = 0.0       # floor for deploy's readiness wait (start-up dominated by imports)
    metrics: EngineMetrics                 # what "busy" and "served something" are called on its /metrics
    router: str = "vllm-ascend-proxy"      # the P/D router (data/routers.yml) when the topology names none
    probe_timeout_s: float | None = None   # deploy's smoke and status's pair probe wait this long (else 60/30 s)

    def connector(self, name: str | None) -> tuple[str, KvTransfer] | None:
        """(name, connector) that kimi_kv_connector picks (None: the default); None without profile connectors."""
        if not self.kv_connectors:
            if name:
                raise InvalidInput(f"kimi_kv_connector: engine profile {self.name} moves KV with the version "
                                   "profile's connector only (MooncakeConnectorV1); remove kimi_kv_connector")
            return None
        name = name or next(iter(self.kv_connectors))
        if name not in self.kv_connectors:
            raise InvalidInput(f"kimi_kv_connector: engine profile {self.name} has no connector '{name}'; "
                               f"known: {', '.join(self.kv_connectors)} (default {next(iter(self.kv_connectors))})")
        return name, self.kv_connectors[name]

    def facts(self, model_id: str | None = None) -> ModelFacts:
        """The profile's own model, else the facts kimi_model_id names (Kimi K2.5 W4A8 when unknown)."""
        if self.model:
            return model_facts(self.model)
        return (find_model(model_id) if model_id else None) or model_facts()


class AutoSwitch(Strict):
    """When the planner turns a switch on by itself (the topology does not mention it)."""

    unless_off: str | None = None        # ...unless the topology turns this other switch off
    max_batched_tokens: int | None = None  # ...and only when --max-num-batched-tokens is at most this


class SwitchRule(Strict):
    why: str
    roles: list[Literal["prefill", "decode", "colocated"]]
    hardware: list[str] | None = None
    max_ep: int | None = None
    min_tp: int | None = None
    off_note: str | None = None
    auto: AutoSwitch | None = None
    min_hccl_buffsize_mib: int | None = None  # on: warn when HCCL_BUFFSIZE is below it
    unavailable_note: str | None = None  # set: a version without the switch warns with this instead of failing


def _load(path: Path) -> Any:
    with path.open() as f:
        return yaml.safe_load(f)


@functools.cache
def hardware_catalogue() -> dict[str, Hardware]:
    return {k: Hardware(name=k, **v) for k, v in _load(DATA_DIR / "hardware.yml").items()}


DEFAULT_MODEL = "kimi-k2.5-w4a8"


def _model_doc(name: str) -> dict[str, Any]:
    doc = _load(DATA_DIR / "models" / f"{name}.yml")
    base = doc.pop("inherits", None)
    return {**_model_doc(base), **doc} if base else doc


@functools.cache
def model_facts(name: str | None = None) -> ModelFacts:
    """models/<name>.yml (default Kimi K2.5 W4A8); `inherits: other` takes the other file's numbers."""
    return ModelFacts(**_model_doc(name or DEFAULT_MODEL))


@functools.cache
def model_catalogue() -> dict[str, ModelFacts]:
    """The models kimi_model_id can name (models/*.yml, less those an engine profile pins, e.g. the lane's)."""
    pinned = {p.model for p in engine_profiles().values() if p.model}
    return {p.stem: model_facts(p.stem) for p in sorted((DATA_DIR / "models").glob("*.yml")) if p.stem not in pinned}


def find_model(model_id: str) -> ModelFacts | None:
    """The facts whose hub id is model_id (case-insensitive: hubs spell W4A8 and w4a8 alike), else None."""
    wanted = model_id.lower()
    return next((m for m in model_catalogue().values() if m.model_id.lower() == wanted), None)


@functools.cache
def switch_rules() -> dict[str, SwitchRule]:
    return {k: SwitchRule(**v) for k, v in _load(DATA_DIR / "switches.yml").items()}


class Deviation(Strict):
    """One deliberate difference of kimictl's renders from vllm-ascend's recipes (data/deviations.yml)."""

    id: str
    what: str
    reason: str


@functools.cache
def deviations() -> dict[str, Deviation]:
    return {k: Deviation(id=k, **v) for k, v in _load(DATA_DIR / "deviations.yml").items()}


class LogLine(Strict):
    """A log line the operator's guide explains (data/log_lines.yml): `kimictl logs` names its row."""

    anchor: str     # the row in docs/operators.md
    what: str
    pattern: str    # a Python regex, searched in each line
    example: str    # a line the pattern matches, quoted in the row


@functools.cache
def log_lines() -> list[LogLine]:
    return [LogLine(**x) for x in _load(DATA_DIR / "log_lines.yml")]


@functools.cache
def check_specs() -> dict[str, CheckSpec]:
    return {k: CheckSpec(id=k, **v) for k, v in _load(DATA_DIR / "checks.yml").items()}


@functools.cache
def version_profiles() -> dict[str, VersionProfile]:
    profiles = [VersionProfile(**_load(p)) for p in sorted((DATA_DIR / "versions").glob("*.yml"))]
    return {p.version: p for p in profiles}


def switch_spellings() -> list[tuple[str, SwitchSpelling]]:
    """Every spelling of every switch in any version profile (a recipe or a raw key may use any of them)."""
    return [(name, sp) for prof in version_profiles().values() for name, sp in prof.switches.items()]


def spells_config_key(sp: SwitchSpelling, path: str) -> bool:
    """Whether an additional-config key ("a", or "scheduler_config.a" for one nested there) is this spelling of a
    switch; a key spelled at the top level or under scheduler_config names the same switch either way."""
    def unnest(p: str) -> str:
        return p.removeprefix("scheduler_config.")

    return bool(sp.additional_config) and unnest(sp.additional_config or "") == unnest(path)


def newest_version() -> str:
    """The default profile: the newest final release (release candidates are opt-in)."""
    return max((p.version for p in version_profiles().values() if not p.prerelease), key=version_key)


def version_profile(version: str | None) -> VersionProfile:
    """Profile for a vllm-ascend version: its name, upstream release or image tag ('0.23.0', '0.23.0.post1',
    'v0.23.0.post1' name 0.23.0; '0.30.0rc2'), or a prefix of one ('0.23', '0.30')."""
    profiles = version_profiles()
    if version is None:
        return profiles[newest_version()]
    if version != version.strip():   # it would reach image tags and pip pins with the spaces
        raise InvalidInput(f"kimi_vllm_ascend_version: {version!r} has spaces around it; write the version alone "
                           f"({version.strip()!r})")
    wanted = version.lstrip("v")
    for prof in profiles.values():
        if wanted in prof.names():
            return prof
    # a prefix names a release line (major.minor at least): '0' alone would pick whatever is newest
    prefixed = [p for p in profiles.values() if "." in wanted and any(n.startswith(wanted + ".") for n in p.names())]
    if prefixed:
        return max(prefixed, key=lambda p: version_key(p.version))
    listed = ", ".join(sorted((p.upstream or p.version for p in profiles.values()), key=version_key))
    raise InvalidInput(f"kimi_vllm_ascend_version: unsupported vllm-ascend version '{version}'; supported: {listed}")


@functools.cache
def engine_profiles() -> dict[str, EngineProfile]:
    profiles = [EngineProfile(**_load(p)) for p in sorted((DATA_DIR / "engines").glob("*.yml"))]
    return {p.name: p for p in profiles}


def engine_profile(name: str | None) -> EngineProfile:
    """The engine profile named by kimi_engine_profile (default ascend)."""
    profiles = engine_profiles()
    try:
        return profiles[name or "ascend"]
    except KeyError:
        raise InvalidInput(f"kimi_engine_profile: unknown engine profile '{name}'; "
                           f"known: {', '.join(sorted(profiles))}") from None


class SystemDirs(Strict):
    exact: frozenset[str]
    tree: tuple[str, ...]

    def why_refused(self, path: str) -> str | None:
        """Why `path` (absolute, normalised) may not be a kimictl directory, or None when it may."""
        if path in self.exact or path in self.tree:
            return f"'{path}' is a system directory"
        for top in self.tree:
            if path.startswith(top + "/"):
                return f"'{path}' is inside the system directory '{top}'"
        return None


@functools.cache
def system_dirs() -> SystemDirs:
    """Directories refused as state/model/media directories (data/system_dirs.yml)."""
    return SystemDirs(**_load(DATA_DIR / "system_dirs.yml"))
