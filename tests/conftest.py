"""Shared fixtures: tiny random encoders built from config and a tiny digits dataset.

Streaming keeps shared memory keyed by a dataset's *local* folder, and two live StreamingDatasets
with the same local folder in one process fail. Tests that read a shared dataset therefore pass
their own cache folder (`data.local=tmp_path / "cache"`), which makes Streaming copy the shards.
"""
from __future__ import annotations

import gc
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The evaluation's digit classifier is cached on disk: one cache for this test session (subprocesses inherit
# it), shared by the session's xdist workers (they have the same run id; the cache writes are atomic).
_RUN_ID = os.environ.get("PYTEST_XDIST_TESTRUNUID")
if _RUN_ID:
    os.environ["LATENTFORGE_CACHE"] = os.path.join(tempfile.gettempdir(), f"latentforge-cache-{_RUN_ID}")
else:
    os.environ["LATENTFORGE_CACHE"] = tempfile.mkdtemp(prefix="latentforge-cache-")

# xdist workers share the cores: each computes with its share of them (and so do the processes it starts), or
# their OpenMP threads oversubscribe the machine and wait on each other (a 45 s test took 570 s with two workers
# of two threads each on 2 cores). An OMP_NUM_THREADS set by the user wins.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ["OMP_NUM_THREADS"] = str(max(1, _cores // _WORKERS))
    torch.set_num_threads(max(1, _cores // _WORKERS))

from tests.helpers import (  # noqa: E402  (after the environment above, which they read)
    S3_BUCKET, S3Server, TinyFeatures, digits_config, make_image_folder, make_tiny_clip, make_tiny_text_encoder, make_tiny_vae,
)


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_vae_dir(tmp_path_factory) -> Path:
    return make_tiny_vae(tmp_path_factory.mktemp("tiny_vae"))


@pytest.fixture
def extra_callback(monkeypatch):
    """extra_callback(cb): the next train() runs with `cb` among its callbacks."""
    import framework.train as train_lib

    base = train_lib.build_callbacks

    def add(cb):
        monkeypatch.setattr(train_lib, "build_callbacks", lambda cfg, run_dir: [*base(cfg, run_dir), cb])
        return cb

    return add


@pytest.fixture(scope="session")
def tiny_text_encoder_dir(tmp_path_factory) -> Path:
    return make_tiny_text_encoder(tmp_path_factory.mktemp("tiny_text_encoder"))


@pytest.fixture(scope="session")
def digits_shards(tmp_path_factory) -> Path:
    """The real digits training set (1,438 images x 3 captions) at 8x8, pixel codec, MiniLM text.

    Read-only: build data modules over it with their own `local` cache folder (see module doc).
    """
    from data_prep.precompute import precompute

    return precompute(digits_config(tmp_path_factory.mktemp("digits") / "data"), rank=0, world_size=1)


@pytest.fixture(scope="session")
def digits_val(tmp_path_factory) -> Path:
    """The held-out digits (359 images, one caption each) at 8x8 as the training set is encoded: a validation set
    (data.val_path) for the digits runs."""
    from data_prep.precompute import precompute

    return precompute(digits_config(tmp_path_factory.mktemp("digits_val") / "data",
                                    source={"name": "digits", "split": "heldout", "rows_per_image": 1}),
                      rank=0, world_size=1)


@pytest.fixture(scope="session")
def pairs_shards(tmp_path_factory) -> Path:
    """A small digit-pairs training set: 2 images of each of the 90 training pairs x 5 phrasings, 8x16."""
    from data_prep.precompute import precompute

    cfg = {"source": {"name": "digit_pairs", "pairs_per_combination": 2, "rows_per_image": 5}, "vae": "pixel",
           "text_encoder": "minilm", "resolution": 8, "width": 16,
           "out": str(tmp_path_factory.mktemp("pairs") / "data"), "progress": False}
    return precompute(cfg, rank=0, world_size=1)


@pytest.fixture(scope="session")
def moving_shards(tmp_path_factory) -> Path:
    """The moving digits' training clips (5,752: each training digit in 4 directions, 1 caption each), 8 frames of
    16x16, pixel codec, MiniLM text: latents (1, 8, 16, 16)."""
    from data_prep.precompute import precompute

    cfg = {"source": {"name": "moving_digits", "rows_per_image": 1}, "vae": "pixel", "text_encoder": "minilm",
           "resolution": 16, "num_frames": 8, "out": str(tmp_path_factory.mktemp("moving") / "data"), "progress": False}
    return precompute(cfg, rank=0, world_size=1)


# The longest modules (by their summed test time in a full run, 2026-11-26; test_video and test_bench, long ones late
# in the file order, added 2026-11-28) start first, one per worker, the rest
# following in file order: each module runs whole on one worker (--dist loadfile), and xdist's own order (most tests
# first) left the Slurm module, with few but long tests, for the end, where one worker ran it alone for minutes.
# `--no-loadscope-reorder` (pyproject.toml) keeps this order.
LONGEST_FIRST = ("test_train.py", "test_distributed.py", "test_slurm.py", "test_matrix.py", "test_video.py",
                 "test_decoupled.py", "test_checkpoints.py", "test_bench.py", "test_large_jobs.py", "test_remote.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: each module's tests keep their order


def pytest_collection_finish(session) -> None:
    """Move everything alive once the test modules are imported (torch, Lightning, diffusers: about 600,000
    objects) out of the collector's reach, as each test's survivors are after it (below): a collection walks only
    what the running test made, instead of about 0.6 s of walking per test (6 minutes of a 20-minute suite)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _isolated_streaming_env():
    """Each test starts single-process; LatentDataModule.setup sets these, so restore them after."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    saved = {k: os.environ.pop(k) for k in keys if k in os.environ}
    yield
    for k in keys:
        os.environ.pop(k, None)
    os.environ.update(saved)
    # A test's finished in-process runs leave StreamingDatasets in reference cycles. Collected at a random
    # later moment, they unlink their shared memory one segment at a time, and a training subprocess
    # that a later test starts meanwhile can pick up that half-removed prefix and wait forever on its
    # barrier. Collect them now, between tests, under the node's prefix lock: each rank of a multi-rank job that
    # another xdist worker starts meanwhile picks Streaming's first free prefix on its own, and a prefix freed
    # between the leader's pick and another rank's makes them disagree ("prefix=4 was not registered by local
    # leader"); jobs choose their prefix under the same lock.
    from framework.data.shards import prefix_lock

    with prefix_lock():
        gc.collect()
    # What is still alive now (module and session fixtures, caches, modules imported on first use) joins the frozen
    # objects: otherwise every later collection, this one after each test and the automatic ones within tests, walked
    # it all again (0.1 s a test by the middle of a full run, 88 s of the suite's CPU time in teardowns alone).
    gc.freeze()


@pytest.fixture(scope="session")
def s3(digits_shards) -> dict[str, str]:
    """A real S3-compatible server on loopback (tests/helpers.py S3Server), holding the digits shards at
    s3://latents/digits; its environment (endpoint and credentials) for the processes that read them."""
    with S3Server(S3_BUCKET) as server:
        for f in sorted(digits_shards.rglob("*")):
            if f.is_file():
                server.client.upload_file(str(f), S3_BUCKET, f"digits/{f.relative_to(digits_shards).as_posix()}")
        yield server.env


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """A short base folder of this session's own for tmp_path, unless --basetemp is given: a test's TMPDIR lies under
    it (tests/test_distributed.py's run folders), and data loader workers open Unix sockets under TMPDIR, whose paths
    may have at most 107 characters (framework/data/datamodule.py check_socket_room). pytest's default base
    (/tmp/pytest-of-USER/pytest-N/, and popen-gwN/ under it for each xdist worker) leaves too little room. Set on the
    xdist controller (workers get theirs from it) before pytest's tmp_path factory reads it; a unique folder, so
    pytest sessions side by side do not clear each other's."""
    if config.option.basetemp is None and not hasattr(config, "workerinput"):
        config.option.basetemp = tempfile.mkdtemp(prefix="lf-", dir=tempfile.gettempdir())
        config._latentforge_basetemp = config.option.basetemp


def pytest_unconfigure(config):
    """This session's own base folder is removed after a run that passed (kept after a failure, to look at)."""
    base = getattr(config, "_latentforge_basetemp", None)
    if base is not None and getattr(config, "_latentforge_passed", False):
        shutil.rmtree(base, ignore_errors=True)


def pytest_sessionfinish(session, exitstatus):
    session.config._latentforge_passed = exitstatus == 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A GPU-tier test skipped for want of a GPU is reported at its module, not its line, so the summary folds the
    whole tier into one line (tests/test_gpu.py)."""
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and item.get_closest_marker("gpu") and isinstance(rep.longrepr, tuple):
        path, _, reason = rep.longrepr
        rep.longrepr = (path, None, reason)


# Fixtures of the own-data tests, shared with the combinations test


@pytest.fixture(scope="module")
def own_data(tmp_path_factory) -> dict[str, Path]:
    """RGB 20x24 images with captions, one unreadable file and one uncaptioned image, encoded at 16 px; then
    the encoder folders move away (another machine), copies stay elsewhere."""
    from data_prep.precompute import precompute

    tmp = tmp_path_factory.mktemp("own")
    src = make_image_folder(tmp / "images", n=12, size=20)
    (src / "broken.png").write_bytes(b"not an image")
    (src / "broken.txt").write_text("a picture that cannot be read")
    Image.fromarray(np.zeros((20, 24, 3), np.uint8)).save(src / "uncaptioned.png")
    # shift_factor 0: stock diffusers pipelines decode without a shift (the export test compares with them)
    vae, text = make_tiny_vae(tmp / "vae", shift_factor=0.0), make_tiny_text_encoder(tmp / "text")
    data = precompute({"source": {"name": "folder", "path": str(src)}, "vae": str(vae), "text_encoder": str(text),
                       "resolution": 16, "out": str(tmp / "latents"), "max_bad_fraction": 0.2, "progress": False})
    moved = {"vae": tmp / "elsewhere" / "vae", "text": tmp / "elsewhere" / "text"}
    for key, folder in (("vae", vae), ("text", text)):
        shutil.move(str(folder), moved[key])
    return {"data": data, "tmp": tmp, **moved}


@pytest.fixture(scope="module")
def metric_nets(tmp_path_factory) -> dict[str, Path]:

    tmp = tmp_path_factory.mktemp("metric_nets")
    torch.manual_seed(0)
    torch.jit.script(TinyFeatures()).save(str(tmp / "features.pt"))
    return {"inception": tmp / "features.pt", "clip": make_tiny_clip(tmp / "clip"),
            "real": make_image_folder(tmp / "heldout", n=10, size=20, seed=1)}
