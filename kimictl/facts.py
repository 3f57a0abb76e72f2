"""Facts as data: hardware catalogue, model facts, vllm-ascend version profiles and switch rules."""

from __future__ import annotations

import functools
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
    npu_smi_name: str
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
    model_id: str
    served_model_name: str
    text: TextConfig
    vision: VisionConfig
    quant: QuantBytes
    scale_bytes_per_channel: int
    kv_cache_dtype_bytes: int
    runtime_reserve_mib: int
    hccl_buffers: int
    activation_bytes_per_token: int
    draft_model_gib: float

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
    additional_config: str | None = None
    value: Any                 # what "on" is spelled as
    off_value: Any = None      # what an explicit "off" is spelled as; None = leave unset


class Compat(Strict):
    cann: list[str]
    driver_min: str


class CheckSpec(Strict):
    id: str
    severity: Literal["error", "warning", "info"]
    title: str
    fix: str


class VersionProfile(Strict):
    version: str
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

    def image(self, hw: Hardware) -> str:
        return f"{self.image_repo}:{self.image_tag}{hw.image_suffix}"


class KvTransfer(Strict):
    """The P/D connector of a non-Ascend engine profile ({cluster} in extra_config values is kimi_cluster)."""

    kv_connector: str
    kv_connector_module_path: str | None = None
    extra_config: dict[str, Any] = Field(default_factory=dict)


class EngineProfile(Strict):
    """What engine runs and how it is spelled (data/engines/*.yml); `ascend` is production."""

    name: str
    description: str
    command: str                 # default engine command; kimi_engine_command replaces it
    serve_args: list[str]        # after the command, before kimictl's flags; "{model_dir}" is kimi_model_dir
    ascend: bool                 # Ascend env, version env/env_prepend, switches and additional-config apply
    runtime: Literal["container", "host"] | None = None  # required kimi_runtime, if any
    model: str | None = None     # models/<model>.yml instead of model.yml (Kimi K2.5 W4A8)
    serve: dict[str, Any] = Field(default_factory=dict)             # overlaid on the topology's serve flags
    drop_serve: dict[str, list[Any]] = Field(default_factory=dict)  # flag: values removed (with a warning)
    env: dict[str, str] = Field(default_factory=dict)               # replaces the version profile's env
    kv_transfer: KvTransfer | None = None  # None: the version profile's connector (MooncakeConnectorV1)
    min_ready_timeout_s: float = 0.0       # floor for deploy's readiness wait (start-up dominated by imports)
    router: str = "vllm-ascend-proxy"      # the P/D router (data/routers.yml) when the topology names none

    def facts(self) -> ModelFacts:
        return model_facts(self.model)


class SwitchRule(Strict):
    why: str
    roles: list[Literal["prefill", "decode", "colocated"]]
    hardware: list[str] | None = None
    max_ep: int | None = None
    min_tp: int | None = None
    off_note: str | None = None


def _load(path: Path) -> Any:
    with path.open() as f:
        return yaml.safe_load(f)


@functools.cache
def hardware_catalogue() -> dict[str, Hardware]:
    return {k: Hardware(name=k, **v) for k, v in _load(DATA_DIR / "hardware.yml").items()}


@functools.cache
def model_facts(name: str | None = None) -> ModelFacts:
    """Kimi K2.5 W4A8 (model.yml), or another model's facts from models/<name>.yml (engine profiles)."""
    return ModelFacts(**_load(DATA_DIR / "model.yml" if name is None else DATA_DIR / "models" / f"{name}.yml"))


@functools.cache
def switch_rules() -> dict[str, SwitchRule]:
    return {k: SwitchRule(**v) for k, v in _load(DATA_DIR / "switches.yml").items()}


@functools.cache
def check_specs() -> dict[str, CheckSpec]:
    return {k: CheckSpec(id=k, **v) for k, v in _load(DATA_DIR / "checks.yml").items()}


@functools.cache
def version_profiles() -> dict[str, VersionProfile]:
    profiles = [VersionProfile(**_load(p)) for p in sorted((DATA_DIR / "versions").glob("*.yml"))]
    return {p.version: p for p in profiles}


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".") if x.isdigit())


def newest_version() -> str:
    return max(version_profiles(), key=_version_key)


def version_profile(version: str | None) -> VersionProfile:
    """Profile for a vllm-ascend version ('0.23.0', 'v0.23.0.post1' and '0.23' all name 0.23.0)."""
    profiles = version_profiles()
    if version is None:
        return profiles[newest_version()]
    wanted = version.strip().lstrip("v")
    for name, prof in profiles.items():
        if wanted in (name, prof.image_tag.lstrip("v")) or name.startswith(wanted + "."):
            return prof
    raise InvalidInput(
        f"kimi_vllm_ascend_version: unsupported vllm-ascend version '{version}'; "
        f"supported: {', '.join(sorted(profiles, key=_version_key))}"
    )


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
