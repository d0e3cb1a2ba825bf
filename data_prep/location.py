"""Where precompute reads and writes: a folder on this machine, or a prefix of an object store (`out=s3://bucket/prefix`,
`source.path=s3://...`) whose files pass through a local staging folder on their way in and out.

Precompute speaks to one `Location` for its output, by names relative to it ("parts.json", "done/part_000003.json",
"part_000003/index.json"), so that the same code writes a local folder or a bucket:

    exists(name), read_json(name), write_json(name, obj)   small files; a write is atomic either way
    read_jsons(names)                                      many small files (fetched side by side when remote)
    names(folder)                                          every file under a folder, recursively
    local(name)                                            where `name` lies on this machine: the file itself, or
                                                           its staged copy
    fetch(name), push(name)                                download into / upload from that copy (no-ops locally)
    writer_out(name)                                       MDSWriter's `out` for the MDS folder `name`

Streaming does the transfers (CONVENTIONS rule 7): MDSWriter(out=(local, remote)) uploads each shard once it is
closed and index.json last, its CloudUploader lists and uploads, its CloudDownloader downloads; they speak s3:// (and
S3-compatible stores through S3_ENDPOINT_URL), gs:// and oci:// (only s3:// is tested here). What this module adds to
them: reading a small remote file, telling whether one exists, and errors that name the config key to fix.
"""
from __future__ import annotations

import json
import os
import posixpath
import urllib.parse
from pathlib import Path
from typing import Any

from data_prep.record import write_json_atomic


def cache_dir() -> Path:
    """This machine's cache of things computed once and reused by later runs (`LATENTFORGE_CACHE`, default
    ~/.cache/latentforge): the evaluation's scorers, the verdicts of shard checks."""
    return Path(os.environ.get("LATENTFORGE_CACHE") or Path.home() / ".cache" / "latentforge")


def is_remote(path: str | None) -> bool:
    """An object-store URL (s3://, gs://, ...) rather than a path on this machine."""
    return path is not None and urllib.parse.urlparse(str(path)).scheme not in ("", "file")


def common_folder(urls: list[str]) -> str:
    """The deepest prefix holding every one of `urls` (one bucket), without a trailing slash: s3://b/p for
    s3://b/p/00000.tar and s3://b/p/00001.tar."""
    parsed = [urllib.parse.urlparse(u) for u in urls]
    buckets = {f"{p.scheme}://{p.netloc}" for p in parsed}
    if len(buckets) != 1:
        raise ValueError(f"source.path names tars in {len(buckets)} buckets ({sorted(buckets)}): one pattern reads one "
                         "bucket; copy the tars into one, or precompute each into its own out=.")
    return buckets.pop() + posixpath.commonpath([posixpath.dirname(p.path) for p in parsed]).rstrip("/")


def remote_error(url: str, err: Exception, key: str) -> Exception:
    """The error to raise for a failed transfer of `url`, naming what to fix: the store's address, the credentials, or
    the config key `key` (botocore's errors are told apart by class name, so botocore need not be importable here)."""
    kind, text = type(err).__name__, str(err)
    if kind in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError", "ReadTimeoutError"):
        endpoint = os.environ.get("S3_ENDPOINT_URL")
        return ConnectionError(f"{key}: could not reach the object store for {url} ({text}): check S3_ENDPOINT_URL "
                               f"({'= ' + endpoint if endpoint else 'unset: the provider default'}).")
    if kind in ("NoCredentialsError", "PartialCredentialsError") or any(
            code in text for code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "Forbidden")):
        return PermissionError(f"{key}: no access to {url} ({text}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                               "(or AWS_PROFILE) on every node, with read and write access to the bucket.")
    if any(s in text for s in ("NoSuchBucket", "does not exist", "not found", "404")):
        return FileNotFoundError(f"{key}: {url} does not exist ({text}): check {key}= (the bucket must exist; "
                                 "precompute creates no bucket).")
    return RuntimeError(f"{key}: transfer of {url} failed: {kind}: {text}")


# ---------------------------------------------------------------------------------------------
# A folder on this machine
# ---------------------------------------------------------------------------------------------


class Location:
    """A folder on this machine: every file is where `local` says, and nothing is transferred."""

    def __init__(self, root: Path) -> None:
        self.root = root  # the files on this machine (a remote location's staged copies)
        self.url = str(root)

    def __str__(self) -> str:
        return self.url

    def join(self, name: str) -> str:
        return f"{self.url}/{name}" if name else self.url

    def local(self, name: str) -> Path:
        return self.root / name

    def exists(self, name: str) -> bool:
        return self.local(name).exists()

    def is_empty(self) -> bool:
        return not self.root.is_dir() or not any(self.root.iterdir())

    def names(self, folder: str = "") -> list[str]:
        """The files under `folder` (the whole location for ""), recursively, as names relative to the location."""
        base = self.local(folder)
        return sorted(p.relative_to(self.root).as_posix() for p in base.rglob("*") if p.is_file()) if base.is_dir() else []

    def read_json(self, name: str) -> Any:
        return json.loads(self.fetch(name).read_text())

    def read_jsons(self, names: list[str]) -> list[Any]:
        """Several small files, in order (a remote location fetches them side by side: a run's done markers are one
        per input tar, tens of thousands for a web-scale source)."""
        return [self.read_json(name) for name in names]

    def write_json(self, name: str, obj: Any) -> None:
        """Atomically: a reader, even one on another machine, never sees half a file."""
        path = self.local(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, obj)
        self.push(name)

    def fetch(self, name: str) -> Path:
        """`name` on this machine, to read."""
        return self.local(name)

    def push(self, name: str) -> None:
        """Publish `name`, written at local(name)."""

    def writer_out(self, name: str) -> str | tuple[str, str]:
        """MDSWriter's `out` for the MDS folder `name`."""
        return str(self.local(name))


# ---------------------------------------------------------------------------------------------
# A prefix of an object store, staged through a local folder
# ---------------------------------------------------------------------------------------------


class RemoteLocation(Location):
    """The prefix `url` of an object store. A file is written to its staged copy under `staging`, then uploaded (and
    the copy deleted); one is read by downloading it there. The store is the truth: `exists` and `names` ask it,
    never the staging folder, so another machine with a fresh staging folder sees the same files. `key` names the
    config key the URL came from, for the errors."""

    def __init__(self, url: str, staging: Path, key: str) -> None:
        from streaming.base.storage.download import CloudDownloader
        from streaming.base.storage.upload import CloudUploader

        super().__init__(staging)
        self.url, self.key = url.rstrip("/"), key
        self._prefix = urllib.parse.urlparse(self.url).path.strip("/")  # the object keys' common start
        staging.mkdir(parents=True, exist_ok=True)
        try:  # S3's uploader checks here that the bucket exists and that we may read it
            self.uploader = CloudUploader.get((str(staging), self.url), exist_ok=True)
            self.downloader = CloudDownloader.get(self.url)  # one client for every download, made at the first
        except Exception as err:
            raise remote_error(self.url, err, key) from None

    def _keys(self, start: str) -> list[str]:
        """The names (relative to the location) of the objects whose name starts with `start`."""
        try:
            keys = self.uploader.list_objects(start)
        except NotImplementedError:
            raise ValueError(f"{self.key}={self.url}: Streaming cannot list the objects of this store; use s3://, gs:// "
                             "or oci://.") from None
        except Exception as err:
            raise remote_error(self.join(start), err, self.key) from None
        cut = len(self._prefix) + 1 if self._prefix else 0
        return [k[cut:] for k in keys or []]

    def exists(self, name: str) -> bool:
        return name in self._keys(name)

    def is_empty(self) -> bool:
        return not self._keys("")

    def names(self, folder: str = "") -> list[str]:
        return sorted(self._keys(f"{folder.strip('/')}/" if folder else ""))

    def read_json(self, name: str) -> Any:
        obj = super().read_json(name)
        self.local(name).unlink()  # the store's small files pass through staging; none stays there
        return obj

    def read_jsons(self, names: list[str]) -> list[Any]:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=16) as pool:  # boto3's clients are thread-safe
            return list(pool.map(self.read_json, names))

    def fetch(self, name: str) -> Path:
        path = self.local(name)
        path.unlink(missing_ok=True)  # Streaming keeps a file that is there already: never read a stale copy
        try:
            self.downloader.download(self.join(name), str(path))
        except Exception as err:
            raise remote_error(self.join(name), err, self.key) from None
        return path

    def push(self, name: str) -> None:
        try:
            self.uploader.upload_file(name)  # local(name) to url/name, then the local copy is deleted
        except Exception as err:
            raise remote_error(self.join(name), err, self.key) from None

    def writer_out(self, name: str) -> tuple[str, str]:
        return str(self.local(name)), self.join(name)


def open_output(out: str, staging: Path | None) -> Location:
    """precompute's `out=`: a local folder, or a remote prefix staged through `staging` (this rank's own folder)."""
    if not is_remote(out):
        return Location(Path(out).expanduser().resolve())
    if staging is None:
        raise ValueError(staging_error(f"out={out}"))
    return RemoteLocation(out, staging, key="out")


def staging_error(what: str) -> str:
    return (f"{what} is remote: set staging=DIR, a local folder for the files on their way to or from the object store "
            "(each rank stages one part's shards and one input tar at a time in DIR/rank_<rank>/, deleted once "
            "uploaded or encoded).")
