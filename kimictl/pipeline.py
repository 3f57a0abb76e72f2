"""The static half of every command: inventory + topology -> plan (-> render), no hosts touched."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kimictl.inventory import Inventory, load_inventory
from kimictl.plan import Plan, make_plan
from kimictl.topology import Topology, load_topology


@dataclass(frozen=True)
class Prepared:
    inventory: Inventory
    topology: Topology
    plan: Plan


def prepare(inventory: Path, topology: str) -> Prepared:
    """Load and validate both inputs and compile the plan (always over every host; --limit narrows what is
    changed, not the plan); any problem raises an exit-2 error."""
    inv = load_inventory(inventory)
    topo = load_topology(topology)
    return Prepared(inv, topo, make_plan(inv, topo))
