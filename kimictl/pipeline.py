"""The static half of every command: inventory + topology -> plan (-> render), no hosts touched."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kimictl.errors import InvalidInput
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
    try:
        return Prepared(inv, topo, make_plan(inv, topo))
    except InvalidInput as exc:
        raise in_files(exc, inventory, topology) from None


def in_files(exc: InvalidInput, inventory: Path, topology: str) -> InvalidInput:
    """A plan's error (inventory x topology) says which two inputs it is about, as the user named them."""
    exc.message = f"{inventory} with topology {topology}: {exc.message}"
    return exc
