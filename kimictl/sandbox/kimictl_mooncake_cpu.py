"""CPU-only shim: vLLM's in-tree MooncakeConnector on a CPU torch (real-engine lane only; never for NPUs).

Used by the cpu-smoke engine profile with `kimi_kv_connector: mooncake`. vLLM 0.32's MooncakeConnectorWorker asks
torch for the current accelerator device (`torch.accelerator.current_device_index()`), which raises "Cannot access
accelerator device when none is available" on a CPU-only torch. This module makes that one call answer device 0
when there is no accelerator, and re-exports vLLM's connector unchanged; the engine loads it in every process
through kv_connector_module_path. The upstream fix would be the same one-line fallback.

It runs inside the engine (the lane's venv: Python 3.11, vllm, torch), never on the control node: deploy ships it
to <kimi_state_dir>/bin/ on the engine hosts and the engine's PYTHONPATH names that directory.
"""

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import MooncakeConnector

_device_index = torch.accelerator.current_device_index


def _device_index_or_cpu(*args, **kwargs):
    if torch.accelerator.current_accelerator() is None:
        return 0
    return _device_index(*args, **kwargs)


torch.accelerator.current_device_index = _device_index_or_cpu

__all__ = ["MooncakeConnector"]
