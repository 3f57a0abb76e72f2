"""Upstream source distributions (data/upstream.yml): fetch once through the package index, verify the pinned
sha256, cache and extract. kimictl runs files from them (the sandbox's vllm-ascend P/D proxy); nothing of them is
copied into the repository."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tarfile
import urllib.error
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from kimictl.errors import KimictlError
from kimictl.facts import DATA_DIR, _load

DEFAULT_INDEX = "https://pypi.org/simple"
TIMEOUT_S = 60
STAMP = ".kimictl-sha256"


class UpstreamUnavailable(KimictlError):
    """A pinned sdist is neither cached nor fetchable."""


class UpstreamMismatch(KimictlError):
    """The index states, or serves, other bytes than data/upstream.yml pins."""


@functools.cache
def pins() -> dict[str, Any]:
    return _load(DATA_DIR / "upstream.yml")


def cache_dir() -> Path:
    return Path(os.environ.get("KIMICTL_UPSTREAM_CACHE") or Path.home() / ".cache" / "kimictl" / "upstream")


def index_url() -> str:
    """The simple index pip uses (PIP_INDEX_URL), else PyPI's."""
    return (os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX).rstrip("/")


def release_of(image_tag: str) -> str:
    """The upstream release of a version profile's image tag (v0.23.0.post1 -> 0.23.0.post1)."""
    return image_tag.removeprefix("v")


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href" and v]


def _file_url(filename: str) -> tuple[str, str | None]:
    """(download URL, sha256 the index states) of one file of the package, from its simple-index page."""
    page = f"{index_url()}/{pins()['package']}/"
    req = urllib.request.Request(page, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
        body, kind = resp.read(), resp.headers.get("Content-Type", "")
    if "json" in kind:
        for f in json.loads(body)["files"]:
            if f["filename"] == filename:
                return urllib.parse.urljoin(page, f["url"]), f.get("hashes", {}).get("sha256")
    else:
        links = _Links()
        links.feed(body.decode())
        for href in links.hrefs:
            url, _, frag = href.partition("#")
            if url.rsplit("/", 1)[-1] == filename:
                return urllib.parse.urljoin(page, url), frag.removeprefix("sha256=") or None
    raise FileNotFoundError(f"{filename} is not listed on {page}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pin(release: str) -> dict[str, str]:
    try:
        return pins()["sdists"][release]
    except KeyError:
        raise UpstreamUnavailable(f"no sha256 is pinned for {pins()['package']} {release} in data/upstream.yml",
                                  hint="pin it there (file and sha256 from the package index)") from None


def fetch(release: str) -> Path:
    """The verified tarball of a pinned release in the cache, downloaded when missing."""
    pin = _pin(release)
    dest = cache_dir() / pin["file"]
    if dest.exists() and _sha256(dest) == pin["sha256"]:
        return dest
    try:
        url, stated = _file_url(pin["file"])
        if stated and stated != pin["sha256"]:
            raise UpstreamMismatch(f"the index {index_url()} states sha256 {stated} for {pin['file']}; "
                                   f"data/upstream.yml pins {pin['sha256']}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(f"{dest.name}.{os.getpid()}.part")
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp, part.open("wb") as out:
            shutil.copyfileobj(resp, out)
    except (urllib.error.URLError, OSError, FileNotFoundError, ValueError) as exc:
        raise UpstreamUnavailable(f"{pin['file']} is not cached in {cache_dir()} and cannot be fetched from "
                                  f"{index_url()}: {exc}") from None
    got = _sha256(part)
    if got != pin["sha256"]:
        part.unlink()
        raise UpstreamMismatch(f"{url}: sha256 {got}, data/upstream.yml pins {pin['sha256']}")
    part.replace(dest)
    return dest


def source_tree(release: str) -> Path:
    """The extracted source tree of a pinned release (extracted once, next to the tarball)."""
    pin = _pin(release)
    stem = pin["file"].removesuffix(".tar.gz")
    top = cache_dir() / stem
    if (top / STAMP).exists() and (top / STAMP).read_text() == pin["sha256"]:
        return top / stem
    tarball = fetch(release)
    tmp = top.with_name(f"{stem}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(tarball) as tar:
        tar.extractall(tmp, filter="data")
    (tmp / STAMP).write_text(pin["sha256"])
    shutil.rmtree(top, ignore_errors=True)
    tmp.replace(top)
    return top / stem


def upstream_file(release: str, relpath: str) -> Path:
    """One file of a pinned release's source tree."""
    path = source_tree(release) / relpath
    if not path.is_file():
        raise UpstreamUnavailable(f"{pins()['package']} {release} has no {relpath}")
    return path
