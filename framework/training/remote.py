"""`trainer.checkpoint_dir=s3://bucket/prefix`: checkpoints kept on object storage as well as in run.dir.

Each checkpoint is written to run.dir/checkpoints as always (whole, swapped in; a sharded one by every rank), and
global rank 0 then uploads it in a background thread, file by file (boto3's managed transfers, through the S3 client
Streaming's uploader sets up: S3_ENDPOINT_URL and the AWS credentials, as for data.path=s3://...), as
`<prefix>/stepNNNNNNN.ckpt[/...]`; after the last file it writes `<prefix>/latest`, which names it. So `latest` only
ever names a checkpoint that is all there, and a job killed mid-upload leaves the previous one named. The newest
`trainer.keep_checkpoints` (at least one) stay remote, older ones are deleted. The end of training waits for the
last upload. `resume=auto` takes the newer of run.dir's newest checkpoint and the remote `latest`, which global
rank 0 downloads into run.dir/checkpoints first (the other ranks wait for it): a run whose run.dir is gone, or that
moves to another cluster, continues from object storage.
"""

from __future__ import annotations

import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn


LATEST = "latest"


def check_url(url: str) -> None:
    """trainer.checkpoint_dir must be an object-store URL."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"trainer.checkpoint_dir={url!r}: give an object-store URL, s3://bucket/prefix (checkpoints "
                         "are in run.dir/checkpoints in any case; null keeps them there only)")


def remote_name(step: int) -> str:
    return f"step{step:07d}.ckpt"


class Remote:
    """One checkpoint prefix on object storage, through the boto3 client Streaming's S3Uploader builds (its endpoint
    and credentials) and its listing."""

    def __init__(self, url: str, local: Path) -> None:
        from streaming.base.storage.upload import CloudUploader

        check_url(url)
        self.url, self.local = url.rstrip("/"), local
        local.mkdir(parents=True, exist_ok=True)
        try:
            self.uploader = CloudUploader.get(out=(str(local), self.url), keep_local=True, exist_ok=True)
        except Exception as err:  # botocore's errors: a missing bucket, bad credentials, no endpoint
            raise RuntimeError(f"trainer.checkpoint_dir={url}: the object store refused ({err}); check the bucket, "
                               "the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) and S3_ENDPOINT_URL") from err
        parsed = urllib.parse.urlparse(self.url)
        self.bucket, self.prefix = parsed.netloc, parsed.path.strip("/")

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def latest(self) -> str | None:
        """The name `latest` gives (None: nothing uploaded yet)."""
        from botocore.exceptions import ClientError

        try:
            body = self.uploader.s3.get_object(Bucket=self.bucket, Key=self._key(LATEST))["Body"].read()
        except ClientError as err:
            if err.response["Error"]["Code"] in ("NoSuchKey", "404"):
                return None
            raise
        return body.decode().strip() or None

    def upload(self, path: Path, name: str) -> None:
        """A complete local checkpoint (file or folder) as `name`, then `latest` naming it."""
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            rel = Path(name) / f.relative_to(path) if path.is_dir() else Path(name)
            self.uploader.s3.upload_file(str(f), self.bucket, self._key(str(rel)))
        self.uploader.s3.put_object(Bucket=self.bucket, Key=self._key(LATEST), Body=name.encode())

    def names(self) -> list[str]:
        """The checkpoints under the prefix, oldest first."""
        keys = self.uploader.list_objects(None) or []
        start = len(self.prefix) + 1 if self.prefix else 0
        return sorted({k[start:].split("/")[0] for k in keys if k[start:].startswith("step")})

    def keys_of(self, name: str) -> list[str]:
        """The objects of checkpoint `name`: the file itself, or every file under its folder (not step1.ckpt.x)."""
        key = self._key(name)
        return [k for k in self.uploader.list_objects(name) or [] if k == key or k.startswith(key + "/")]

    def delete(self, name: str) -> None:
        keys = self.keys_of(name)
        for i in range(0, len(keys), 1000):  # DeleteObjects takes up to 1,000 keys a call
            self.uploader.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})

    def download(self, name: str) -> Path:
        """`name` into run.dir/checkpoints (under a temporary name, then renamed: whole or not at all)."""
        import shutil

        target, tmp = self.local / name, self.local / f"{name}.download"
        for leftover in (tmp, target):  # an earlier download cut off, or an older copy of the same name
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink(missing_ok=True)
        keys = self.keys_of(name)
        if not keys:
            raise FileNotFoundError(f"{self.url}/{LATEST} names {name}, which is not there")
        for key in keys:
            rel = key[len(self._key(name)):].lstrip("/")
            dest = tmp / rel if rel else tmp
            dest.parent.mkdir(parents=True, exist_ok=True)
            self.uploader.s3.download_file(self.bucket, key, str(dest))
        tmp.rename(target)
        return target


def step_of(name: str) -> int:
    return int(name.removeprefix("step").removesuffix(".ckpt"))


# --------------------------------------------------------------------------------------------
# Upload during training
# --------------------------------------------------------------------------------------------


class UploadCheckpoints(pl.Callback):
    """Upload each new complete checkpoint of run.dir/checkpoints (global rank 0, one background thread)."""

    def __init__(self, url: str, local: Path, keep: int) -> None:
        self.url, self.local, self.keep = url, local, max(1, keep)
        self.remote: Remote | None = None
        self._thread: threading.Thread | None = None
        self._uploaded = -1  # the newest step uploaded
        self._error: BaseException | None = None
        self._last_seen: tuple[Any, int] = (None, -1)  # last.ckpt's (mtime, inode) and step

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.is_global_zero:
            self.remote = Remote(self.url, self.local)
            latest = self.remote.latest()
            self._uploaded = step_of(latest) if latest else -1

    def _newest_local(self) -> tuple[int, Path] | None:
        """The newest complete local checkpoint: the numbered ones by name, last.ckpt (a folder or file of its own
        when the final step falls between saves) by its metadata, read once per version of it."""
        from framework.inference.checkpoint import checkpoint_step, is_complete

        found = []
        for p in self.local.glob("step*.ckpt"):
            try:
                found.append((step_of(p.name), p))
            except ValueError:
                continue  # not a name ModelCheckpoint writes
        last = self.local / "last.ckpt"
        try:
            if not last.is_symlink() and is_complete(last):
                stamp = (last.stat().st_mtime_ns, last.stat().st_ino)
                if self._last_seen[0] != stamp:
                    self._last_seen = (stamp, checkpoint_step(last))
                found.append((self._last_seen[1], last))
        except (OSError, KeyError, RuntimeError, EOFError):
            pass  # being swapped in just now: the next look finds it
        return max(found, key=lambda f: f[0]) if found else None

    def _sync(self) -> None:
        assert self.remote is not None
        try:
            newest = self._newest_local()
            if newest is None or newest[0] <= self._uploaded:
                return
            step, path = newest
            t0 = time.perf_counter()
            try:
                self.remote.upload(path, remote_name(step))
            except FileNotFoundError:
                return  # pruned locally while being read: a newer one exists
            self._uploaded = step
            rank_zero_info(f"trainer.checkpoint_dir: step {step} uploaded to {self.remote.url}/{remote_name(step)} in "
                           f"{time.perf_counter() - t0:.1f} s")
            for old in self.remote.names()[:-self.keep]:
                self.remote.delete(old)
        except BaseException as err:  # kept for the end of training, which reports it
            self._error = err

    def _kick(self) -> None:
        if self.remote is None or (self._thread is not None and self._thread.is_alive()):
            return
        self._thread = threading.Thread(target=self._sync, name="checkpoint-upload", daemon=True)
        self._thread.start()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._kick()
        if self._error is not None:
            rank_zero_warn(f"trainer.checkpoint_dir: an upload failed ({self._error}); retrying at the next step")
            self._error = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # FinalCheckpoint (earlier in the callback list) has written and completed last.ckpt by now.
        if self.remote is None:
            return
        self.wait()
        self._kick()  # the final checkpoint
        self.wait()
        if self._error is not None:
            raise RuntimeError(f"trainer.checkpoint_dir: the last upload to {self.url} failed: {self._error}; the "
                               f"checkpoint is in {self.local}") from self._error

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()


# --------------------------------------------------------------------------------------------
# Resume
# --------------------------------------------------------------------------------------------


def check_start(url: str, local: Path, start_step: int) -> None:
    """Refuse a run that starts behind the prefix's `latest` (a fresh run, or a resume from an older checkpoint): its
    checkpoints would not be uploaded until it passed that step, and `latest` would go on naming the other run's."""
    name = Remote(url, local).latest()
    if name is not None and step_of(name) > start_step:
        raise ValueError(f"trainer.checkpoint_dir={url} holds a run's checkpoints up to step {step_of(name)} (latest: "
                         f"{name}) and this run starts at step {start_step}: resume=auto continues that run; to start "
                         "another, give it a prefix of its own")


def fetch_newer(url: str, local: Path, local_step: int | None, writer: bool, timeout_s: float = 1800) -> Path | None:
    """resume=auto: the remote `latest` in run.dir/checkpoints when it is newer than `local_step` (the newest local
    checkpoint's step; None: there is none), else None. The run.dir writer downloads it; the other ranks wait."""
    remote = Remote(url, local)
    name = remote.latest()
    if name is None or (local_step is not None and step_of(name) <= local_step):
        return None
    target = local / name
    if writer:
        t0 = time.perf_counter()
        remote.download(name)
        rank_zero_info(f"resume=auto: {url}/{name} is newer than run.dir's checkpoints; downloaded in "
                       f"{time.perf_counter() - t0:.1f} s")
        return target
    deadline = time.monotonic() + timeout_s
    while not target.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"resume=auto: waited {timeout_s:.0f} s for global rank 0 to download {url}/{name}")
        time.sleep(0.5)
    return target

