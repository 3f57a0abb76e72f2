"""The proxy's admin key: made by kimictl on first use, private, stable, refused when others can read it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimictl.cluster_secrets import proxy_admin_key, proxy_admin_key_path
from kimictl.errors import InvalidInput


def test_admin_key_is_made_once_private_and_refused_when_readable(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KIMICTL_STATE_DIR", str(tmp_path))
    assert proxy_admin_key("c1") is None  # status and rollout never make one
    key = proxy_admin_key("c1", create=True)
    path = proxy_admin_key_path("c1")
    assert key and len(key) >= 40 and path.read_text() == key + "\n"
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert proxy_admin_key("c1", create=True) == key == proxy_admin_key("c1")
    assert proxy_admin_key("c2", create=True) != key
    assert sorted(p.name for p in path.parent.iterdir()) == ["proxy-admin-key"]  # no temporary file left
    path.chmod(0o644)
    with pytest.raises(InvalidInput, match="readable by others"):
        proxy_admin_key("c1")
