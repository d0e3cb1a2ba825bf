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

import lightning.pytorch as pl
import numpy as np
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

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# ---------------------------------------------------------------------------------------------
# Builders (plain functions: other test files import them)
# ---------------------------------------------------------------------------------------------


class CompiledBlocks(pl.Callback):
    """Which of the model's blocks ran inside a torch.compile trace: a forward hook on each block's first linear
    layer records torch.compiler.is_compiling() (public API: Dynamo's counters are internals another torch version
    keeps elsewhere). After the run, `compiled` holds one bool per block."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from framework.distributed.fsdp import shard_units

        self.model = pl_module.model
        units = shard_units(pl_module.model)
        self.seen: list[set[bool]] = [set() for _ in units]
        for seen, unit in zip(self.seen, units):
            layer = next(m for m in unit.modules() if isinstance(m, torch.nn.Linear))
            layer.register_forward_hook(lambda *_, seen=seen: seen.add(torch.compiler.is_compiling()))

    @property
    def compiled(self) -> list[bool]:
        return [True in seen for seen in self.seen]


def make_tiny_vae(root: Path, scaling_factor: float = 0.5, shift_factor: float = 0.1, seed: int = 0) -> Path:
    """A random 2-level AutoencoderKL (downsample 2, 4 latent channels) saved as a diffusers folder."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=4, sample_size=16, scaling_factor=scaling_factor, shift_factor=shift_factor,
    )
    vae.save_pretrained(root)
    return Path(root)


def make_tiny_dc_ae(root: Path, scaling_factor: float = 0.5, seed: int = 0) -> Path:
    """A random 2-level AutoencoderDC (SANA's deterministic autoencoder; downsample 2, 4 latent channels) saved as a
    diffusers folder."""
    from diffusers import AutoencoderDC

    torch.manual_seed(seed)
    ae = AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=8, encoder_block_types=("ResBlock",) * 2,
        decoder_block_types=("ResBlock",) * 2, encoder_block_out_channels=(8, 16), decoder_block_out_channels=(8, 16),
        encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1), encoder_qkv_multiscales=((), ()),
        decoder_qkv_multiscales=((), ()), upsample_block_type="interpolate", downsample_block_type="Conv",
        scaling_factor=scaling_factor,
    )
    ae.save_pretrained(root)
    return Path(root)


def make_tiny_text_encoder(root: Path, hidden_size: int = 32, seed: int = 0, vocab: list[str] | None = None) -> Path:
    """A random 2-layer BertModel with MiniLM's tokenizer files copied in (no download needed); with `vocab`, a
    WordPiece tokenizer of those words written here instead (no MiniLM package needed either)."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    torch.manual_seed(seed)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    if vocab is None:
        from data_prep.encoders import minilm_path

        src = minilm_path()
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy(src / name, root / name)
    else:
        words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *dict.fromkeys(vocab)]
        (root / "vocab.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
        BertTokenizerFast(vocab_file=str(root / "vocab.txt"), model_max_length=128).save_pretrained(root)
    size = sum(1 for _ in open(root / "vocab.txt", encoding="utf-8"))
    cfg = BertConfig(vocab_size=size, hidden_size=hidden_size, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=2 * hidden_size, max_position_embeddings=128)
    BertModel(cfg).save_pretrained(root)
    return root


def make_image_folder(root: Path, n: int = 6, size: int = 20, seed: int = 0) -> Path:
    """n random RGB PNGs with same-named .txt captions, half of them in a sub-folder."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    root = Path(root)
    for i in range(n):
        folder = root / ("sub" if i % 2 else "")
        folder.mkdir(parents=True, exist_ok=True)
        arr = rng.integers(0, 256, (size, size + 4, 3), dtype=np.uint8)
        Image.fromarray(arr).save(folder / f"img{i:03d}.png")
        (folder / f"img{i:03d}.txt").write_text(f"a random picture number {i}" + " with stripes" * (i % 3))
    return root


def digits_config(out: Path, text_encoder: str = "minilm", **overrides) -> dict:
    """A precompute config (plain dict) for the digits source at resolution 8 with the pixel codec."""
    cfg = {"source": {"name": "digits"}, "vae": "pixel", "text_encoder": text_encoder, "resolution": 8,
           "out": str(out), "progress": False}
    cfg.update(overrides)
    return cfg


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_vae_dir(tmp_path_factory) -> Path:
    return make_tiny_vae(tmp_path_factory.mktemp("tiny_vae"))


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
def pairs_shards(tmp_path_factory) -> Path:
    """A small digit-pairs training set: 2 images of each of the 90 training pairs x 5 phrasings, 8x16."""
    from data_prep.precompute import precompute

    cfg = {"source": {"name": "digit_pairs", "pairs_per_combination": 2, "rows_per_image": 5}, "vae": "pixel",
           "text_encoder": "minilm", "resolution": 8, "width": 16,
           "out": str(tmp_path_factory.mktemp("pairs") / "data"), "progress": False}
    return precompute(cfg, rank=0, world_size=1)


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
    # barrier. Collect them now, between tests.
    gc.collect()


S3_BUCKET = "latents"
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="session")
def s3(digits_shards) -> dict[str, str]:
    """A real S3-compatible server on loopback (moto's server mode, as Streaming's own tests use), holding the digits
    shards at s3://latents/digits; its environment (endpoint and credentials) for the processes that read them."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {**S3_CREDENTIALS, "S3_ENDPOINT_URL": f"http://{host}:{port}"}
    client = boto3.client("s3", endpoint_url=env["S3_ENDPOINT_URL"], aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    client.create_bucket(Bucket=S3_BUCKET)
    for f in sorted(digits_shards.rglob("*")):
        if f.is_file():
            client.upload_file(str(f), S3_BUCKET, f"digits/{f.relative_to(digits_shards).as_posix()}")
    yield env
    server.stop()


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
