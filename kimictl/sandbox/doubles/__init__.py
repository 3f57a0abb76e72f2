"""Stdlib-only Ascend tool doubles (npu-smi, hccn_tool) installed on each sandbox host."""
