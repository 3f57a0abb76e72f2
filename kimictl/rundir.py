"""What a deploy or rollout keeps in its run directory (named by `state.new_run_dir`), and the render a recorded
release was deployed from, read back from it (rollback, rollout and heal start from it).

  rendered/      the rendered files of the hosts the run touches
  plan.json      the plan (the newest deploy run's goes into `logs --bundle`)
  rendered.json  the whole render: enough to deploy this release again without the topology file
  topology.yml   a rollout's effective topology (the next rollout's default)

It stands above render (it reads and writes a `Rendered`) and state (a `ReleaseRecord` names its run directory),
so state itself stays below render.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from kimictl.errors import StateError
from kimictl.render import Rendered, write_rendered
from kimictl.state import ReleaseRecord, read_text


def save_run(run_dir: Path, rendered: Rendered, full: Rendered, topology_yaml: str | None = None) -> None:
    """What a run deploys: the files of the hosts it touches (rendered/), the plan, the whole render as
    rendered.json (enough to deploy this release again without the topology file) and, for a rollout, the
    effective topology (the next rollout's default)."""
    write_rendered(rendered, run_dir / "rendered")
    (run_dir / "plan.json").write_text(json.dumps(full.plan.model_dump(mode="json"), indent=1))
    (run_dir / "rendered.json").write_text(full.model_dump_json())
    if topology_yaml is not None:
        (run_dir / "topology.yml").write_text(topology_yaml)


def run_snapshot(rec: ReleaseRecord, what: str) -> Rendered:
    """The render a recorded release was deployed from (its run directory's rendered.json)."""
    snap = Path(rec.run_dir or "") / "rendered.json"
    text = read_text(snap) if rec.run_dir else None
    if text is None:
        raise StateError(f"{what} {rec.release} has no render snapshot ({snap})",
                         hint="converge with `kimictl deploy` once; its run directory keeps one")
    try:
        return Rendered.model_validate_json(text)
    except ValidationError as exc:
        raise StateError(f"the render snapshot {snap} of release {rec.release} is damaged "
                         f"({exc.error_count()} error(s))", hint="converge with `kimictl deploy` once") from None


def run_topology(rec: ReleaseRecord) -> Path | None:
    """The effective topology a rollout wrote into the run directory of this release, if any."""
    path = Path(rec.run_dir or "") / "topology.yml"
    return path if rec.run_dir and path.exists() else None
