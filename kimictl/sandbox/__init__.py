"""Local simulated Atlas cluster: network-namespace hosts, Ascend tool doubles, simulated engine."""
