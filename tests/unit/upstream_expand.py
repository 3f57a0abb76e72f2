"""Run inside an extracted vllm-ascend sdist (cwd and PYTHONPATH its root): expand multi-node recipes into per-rank
`vllm serve` commands and environments with vllm-ascend's own CI harness, as its launcher does on each node.

stdin: JSON {"recipes": {path: [node IPs]}, "nic": name}
stdout: JSON {path: [{"node", "role", "dp_rank", "argv", "env"}]}
"""

import json
import sys

from tests.e2e.nightly.multi_node.external_dp.scripts import runtime
from tests.e2e.nightly.multi_node.external_dp.scripts.external_dp_config import ExternalDPConfigLoader, RankResolver


def main() -> None:
    req = json.load(sys.stdin)
    runtime.get_net_interface = lambda ip: req["nic"]  # the harness looks the NIC of a real IP up on the host
    out = {}
    for path, ips in req["recipes"].items():
        cfg = ExternalDPConfigLoader.from_yaml(path, cluster_ips=ips)
        builder = runtime.ServerCommandBuilder(cfg)
        rows = []
        for rank in RankResolver(cfg).resolve():
            # What ExternalDPServerManager.start_current_node does on the rank's node: template env + its dist env.
            template = cfg.launch_templates[rank.node_index]
            dist = runtime.build_dist_envs(cfg.cluster_ips[rank.node_index], cfg.cluster_ips[0])
            template = type(template)(envs={**template.envs, **dist},
                                      server_cmd_template=template.server_cmd_template)
            cmd = builder.build(rank, template)
            rows.append({"node": rank.node_index, "role": rank.role, "dp_rank": rank.dp_rank, "argv": cmd.cmd,
                         "env": cmd.env})
        out[path] = rows
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
