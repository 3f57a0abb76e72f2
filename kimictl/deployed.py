"""What a cluster runs, as the control node recorded it: the current release, the render it was deployed from and
the topology it was made from. `kimictl rollout` changes it, `kimictl heal` heals it, `kimictl observe up` watches
it. The record is the cluster's (kimictl/cluster_record.py); the control node keeps a cache of it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kimictl import state
from kimictl.errors import InvalidInput, StateError
from kimictl.inventory import Inventory
from kimictl.render import Rendered
from kimictl.rundir import run_snapshot, run_topology


@dataclass(frozen=True)
class Deployment:
    """The current release record and its render snapshot."""

    record: state.ReleaseRecord
    rendered: Rendered

    def topology(self) -> str:
        """The topology the current release was made from: the effective file a rollout wrote, else the source."""
        eff = run_topology(self.record)
        if eff is not None:
            return str(eff)
        src = self.rendered.plan.topology_source
        if src and Path(src).exists():
            return src
        raise InvalidInput(f"the topology of the current release ({src or self.rendered.plan.topology}) is not "
                           "readable here", hint="pass --topology")


def current_deployment(cluster: str, inv: Inventory | None = None, accept_new_keys: bool = False) -> Deployment:
    """What the cluster runs, per its record (InvalidInput when no release of it is recorded). With the inventory,
    the record is read back from the cluster's record hosts first (kimictl/cluster_record.py); without it, this
    control node's cached copy is used."""
    if inv is not None:
        from kimictl.cluster_record import sync

        sync(inv, accept_new_keys=accept_new_keys)
    rec = state.current(cluster)
    if rec is None:
        raise InvalidInput(f"no current release of cluster {cluster} is recorded "
                           f"({state.control_dir(cluster) / state.CURRENT}"
                           f"{', nor on its record hosts' if inv is not None else ''}); nothing to roll out from",
                           hint="deploy first: kimictl deploy -i INV --topology T")
    return Deployment(rec, run_snapshot(rec, f"the current release of {cluster},"))


def cached_deployment(cluster: str) -> Deployment | None:
    """What this control node's cached record says the cluster runs, or None when it cannot say (nothing cached,
    no snapshot): a check of the input that needs no host before the cluster's record is read."""
    try:
        return current_deployment(cluster)
    except (InvalidInput, StateError):
        return None
