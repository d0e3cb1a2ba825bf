"""Helpers shared by the test modules: tiny models and folders built from config, the trainer's config shrunk to
seconds, multi-process training runs and their checks, and W&B's offline run files. Test modules import from here
(never from one another); fixtures live in conftest.py, the multi-process workers in tests/workers/."""
from __future__ import annotations

import csv
import functools
import gc
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from PIL import Image
from streaming import StreamingDataset

from framework import config as config_lib
from tests import zygote
from tests.zygote import Result, lightning_ranks
from tests.zygote import torchrun as forked_torchrun

config_lib.register()


TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class CompiledBlocks(pl.Callback):
    """Which of the model's blocks ran inside a torch.compile trace, and which ran eagerly: a forward hook on each
    block's first linear layer adds torch.compiler.is_compiling() (public API: Dynamo's counters are internals another
    torch version keeps elsewhere) to a counter of its block, and counts its calls. After the run, `compiled` holds one
    bool per block, `eager` whether the block ever ran outside a trace.

    The counters are tensors, which Dynamo guards on by shape and dtype only: a hook that added to a Python set made
    each block's graph guard on the set's contents, so every block compiled again once the set had changed, twice the
    compilations the framework itself makes."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from framework.distributed.fsdp import shard_units

        self.model = pl_module.model
        units = shard_units(pl_module.model)
        self.counts = [torch.zeros(2) for _ in units]  # each block's (compiled calls, calls)
        for count, unit in zip(self.counts, units):
            layer = next(m for m in unit.modules() if isinstance(m, torch.nn.Linear))
            layer.register_forward_hook(functools.partial(_count_compiled, count))

    @property
    def compiled(self) -> list[bool]:
        return [bool(count[0] > 0) for count in self.counts]

    @property
    def eager(self) -> list[bool]:
        return [bool(count[1] > count[0]) for count in self.counts]


def _count_compiled(count: torch.Tensor, *_: Any) -> None:  # a forward hook's return value would replace the output
    count.add_(torch.tensor([float(torch.compiler.is_compiling()), 1.0]))


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


def make_tiny_video_vae(root: Path, kind: str = "wan", seed: int = 0) -> Path:
    """A random video VAE saved as a diffusers folder: 4 latent channels, space / 4, time / 4 after the first frame
    (9 frames make 3 latent frames). kind: wan (per-channel latents_mean / latents_std), cogvideox or hunyuan (a
    scaling factor)."""
    import diffusers

    torch.manual_seed(seed)
    if kind == "wan":
        vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1], num_res_blocks=1,
                                         temperal_downsample=[True, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
                                         latents_std=[1.5, 0.5, 2.0, 1.0], scale_factor_spatial=4,
                                         scale_factor_temporal=4)
    elif kind == "cogvideox":
        vae = diffusers.AutoencoderKLCogVideoX(block_out_channels=(8, 8, 8), down_block_types=("CogVideoXDownBlock3D",) * 3,
                                               up_block_types=("CogVideoXUpBlock3D",) * 3, latent_channels=4,
                                               layers_per_block=1, norm_num_groups=2, scaling_factor=0.7)
    else:
        vae = diffusers.AutoencoderKLHunyuanVideo(block_out_channels=(8, 8, 8), latent_channels=4, layers_per_block=1,
                                                  down_block_types=("HunyuanVideoDownBlock3D",) * 3,
                                                  up_block_types=("HunyuanVideoUpBlock3D",) * 3, norm_num_groups=4,
                                                  spatial_compression_ratio=4, scaling_factor=0.6)
    vae.save_pretrained(root)
    return Path(root)


def write_video(path: Path, frames: list[np.ndarray], fps: int = 24) -> Path:
    """An H.264 video, lossless (qp 0, yuv444p), of uint8 frames (H, W, 3)."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps, options={"qp": "0"})
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv444p"
        for pixels in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return path


def write_gray_video(path: Path, levels: list[int], fps: int = 24, size: int = 32) -> Path:
    """A lossless video whose frame i is uniformly gray at levels[i]."""
    return write_video(path, [np.full((size, size, 3), level, dtype=np.uint8) for level in levels], fps)


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


def rank_at(seed: int, micro: int, r: int = 0, W: int = 1) -> Any:
    """The per-sample draws (framework.training.draws.StepDraws) of the rank at stream position r of W, at micro-batch
    `micro`."""
    from framework.training.draws import StepDraws

    return StepDraws(seed, micro, r, W)


def make_tiny_gemma2(root: Path, words: list[str], seed: int = 0) -> Path:
    """A random 2-layer Gemma2Model (SANA's text encoder is Gemma-2's decoder) with a word-level GemmaTokenizerFast of
    `words` set up as Gemma-2's is: a BOS token first, padding on the left."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Gemma2Config, Gemma2Model, GemmaTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    GemmaTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
                       padding_side="left", add_bos_token=True, add_eos_token=False,
                       model_max_length=512).save_pretrained(root)
    torch.manual_seed(seed)
    cfg = Gemma2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                       pad_token_id=0, bos_token_id=2, eos_token_id=1)
    Gemma2Model(cfg).save_pretrained(root)
    return Path(root)


def make_image_folder(root: Path, n: int = 6, size: int = 20, seed: int = 0) -> Path:
    """n random RGB PNGs with same-named .txt captions, half of them in a sub-folder."""

    rng = np.random.default_rng(seed)
    root = Path(root)
    for i in range(n):
        folder = root / ("sub" if i % 2 else "")
        folder.mkdir(parents=True, exist_ok=True)
        arr = rng.integers(0, 256, (size, size + 4, 3), dtype=np.uint8)
        Image.fromarray(arr).save(folder / f"img{i:03d}.png")
        (folder / f"img{i:03d}.txt").write_text(f"a random picture number {i}" + " with stripes" * (i % 3))
    return root


def write_tars(pngs: list[Path], folder: Path, per_tar: int, metas: list[dict] | None = None) -> list[Path]:
    """img2dataset-style tars of `per_tar` images each: <i>.jpg, <i>.txt (the png's caption) and <i>.json (metas[i],
    default {})."""
    folder.mkdir(parents=True)
    tars = []
    for t in range(0, len(pngs), per_tar):
        tars.append(folder / f"{t // per_tar:05d}.tar")
        with tarfile.open(tars[-1], "w") as tar:
            for i, png in enumerate(pngs[t:t + per_tar], t):
                meta = json.dumps(metas[i] if metas else {}).encode()
                for ext, data in (("jpg", as_jpeg(png)), ("txt", png.with_suffix(".txt").read_bytes()),
                                  ("json", meta)):
                    info = tarfile.TarInfo(f"{i:09d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return tars


def as_jpeg(png: Path) -> bytes:
    buf = io.BytesIO()
    Image.open(png).convert("RGB").save(buf, format="JPEG")
    return buf.getvalue()


def digits_config(out: Path, text_encoder: str = "minilm", **overrides) -> dict:
    """A precompute config (plain dict) for the digits source at resolution 8 with the pixel codec."""
    cfg = {"source": {"name": "digits"}, "vae": "pixel", "text_encoder": text_encoder, "resolution": 8,
           "out": str(out), "progress": False}
    cfg.update(overrides)
    return cfg


S3_BUCKET = "latents"
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class S3Server:
    """A real S3-compatible server on loopback (moto's server mode, as Streaming's own tests use) with one bucket, and
    every request it has served, so that a test can count what was read or written: `env` holds its address and
    credentials for the code under test, `client` is a boto3 client of it, `requests` the (method, path) of each
    request in order. A context manager. moto keeps its buckets per process, so each user names a bucket of its own."""

    def __init__(self, bucket: str) -> None:
        self.bucket = bucket
        self.requests: list[tuple[str, str]] = []

    def __enter__(self) -> "S3Server":
        import boto3
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        wsgi = self._server._server  # werkzeug's server: each request is logged on its way to moto (moto logs none)
        serve = wsgi.app

        def logged(environ, start_response):
            self.requests.append((environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")))
            return serve(environ, start_response)

        wsgi.app = logged
        host, port = self._server.get_host_and_port()
        self.env = {**S3_CREDENTIALS, "S3_ENDPOINT_URL": f"http://{host}:{port}"}
        self.client = boto3.client("s3", endpoint_url=self.env["S3_ENDPOINT_URL"], aws_access_key_id="testing",
                                   aws_secret_access_key="testing", region_name="us-east-1")
        self.client.create_bucket(Bucket=self.bucket)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.stop()

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def keys(self, prefix: str) -> list[str]:
        """The objects under the folder `prefix` of the bucket, as names relative to it."""
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=f"{prefix}/")
        return sorted(o["Key"][len(prefix) + 1:] for page in pages for o in page.get("Contents", []))

    def download(self, prefix: str, dest: Path) -> Path:
        """Every object under `prefix` into the folder `dest`."""
        for name in self.keys(prefix):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            self.client.download_file(self.bucket, f"{prefix}/{name}", str(dest / name))
        return dest

    def served(self, method: str, since: int = 0) -> Counter:
        """How often each key of the bucket was requested with `method` (GET, PUT, ...) from request `since` on."""
        head = f"/{self.bucket}/"
        return Counter(p[len(head):] for m, p in self.requests[since:] if m == method and p.startswith(head) and p != head)


ROOT = Path(__file__).resolve().parents[1]


CONF = ROOT / "conf"


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides)


def cheap(tmp_path: Path, data: Path, *extra: str, steps: int = 3, run: str = "run") -> list[str]:
    """The quickstart config, shrunk: a few steps, no grids or eval, per-step CSV logging."""
    return [
        f"run.dir={tmp_path / run}",
        f"data.path={data}",
        f"data.local={tmp_path / run / 'cache'}",
        "data.batch_size=16",
        f"trainer.max_steps={steps}",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "eval.at_end=false",
        "sample.per_prompt=1",
        "sample.steps=2",
        "sample.prompts=[a handwritten 3]",
        *extra,
    ]


def losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


def with_callback(monkeypatch, callback: pl.Callback) -> None:
    import framework.train as train_lib

    base = train_lib.build_callbacks
    monkeypatch.setattr(train_lib, "build_callbacks", lambda cfg, run_dir: [*base(cfg, run_dir), callback])


FROZEN = "net.transformer_blocks.1.attn1.to_q"


STEPS = 4


# fsdp reduces gradients in another order than one process sums them: float32 round-off only.
TOL = dict(rtol=1e-4, atol=1e-5)


# Updates (w - w_init) of two correct runs differ by float round-off, which Adam amplifies into steps of up to
# a few 1e-6 where a gradient is pure round-off (attention key biases: softmax ignores them); a lost optimizer
# step or Adam state moves weights by ~1e-3. Per tensor: |dw_got - dw_ref| <= rtol |dw_ref| + atol sqrt(numel);
# measured: every correct run here within 0.14 of that bound.
UPDATE_TOL = dict(rtol=1e-2, atol=1e-5)


# A constant lr: a run stopped early by a smaller trainer.max_steps then has the schedule of the whole run.
LR = ["optimizer.lr=1e-3", "optimizer.warmup_steps=0", "optimizer.schedule=constant"]


DIGITS_MODEL = ("model=pixart_debug", "model.in_channels=1", "model.sample_size=8", "model.text_dim=384")


def train_args(run_dir: Path, data: Path, cache: Path, *overrides: str, model: tuple[str, ...] = DIGITS_MODEL) -> list[str]:
    """tests.workers.dist_train's arguments: the digits shards, the debug model (`model`: its overrides, for other
    data), per-step logging, no grids or eval."""
    return [
        f"run.dir={run_dir}", f"data.path={data}", f"data.local={cache}", *model, "trainer.accelerator=cpu",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false", "eval.at_end=false", "sample.every_n_steps=0",
        "sample.per_prompt=1", "sample.steps=1", "sample.prompts=[a handwritten 3]", "resume=auto", *LR,
        # Streaming orders samples by canonical node: the shipped data=shards choice (auto: 960 partitions of the
        # 4,314 digits), the same count on 1, 2 and 4 nodes, so every job size sees the same batches
        "data.num_canonical_nodes=auto", *overrides,
    ]


def train_env(tmp: Path, env: dict | None) -> dict[str, str]:
    gc.collect()  # finish off this process's dead StreamingDatasets first (see tests/conftest.py)
    inherited = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "NODE_RANK")
    full_env = {k: v for k, v in os.environ.items() if k not in inherited}
    full_env.update({"TMPDIR": str(tmp), "PROBE_FREEZE": FROZEN, **(env or {})})
    return full_env


# The least final grid of a run (one image a prompt, one sampler step) for tests that never look at it.
LEAST_GRID = ("sample.per_prompt=1", "sample.steps=1")


def forked_children(monkeypatch, module: str = "framework.train") -> list[list[str]]:
    """The `python -m MODULE` children a command starts with subprocess.run (a study's arms through
    framework.cli.train_child, the overhead bench's timed runs) forked from the test zygote: a fresh interpreter's
    imports cost more than a test-sized child's work. Returns the list their command lines are appended to; any
    other subprocess.run is left alone."""
    launched: list[list[str]] = []
    plain = subprocess.run

    def run(argv, *args, **kwargs):
        if list(argv[:3]) != [sys.executable, "-m", module]:
            return plain(argv, *args, **kwargs)
        launched.append(argv)
        proc = zygote.run(argv, env=kwargs.get("env"), timeout=600)
        if hasattr(kwargs.get("stdout"), "write"):  # the caller's log file (stderr=STDOUT)
            kwargs["stdout"].write(proc.stdout + proc.stderr)
        elif proc.returncode:  # train_child raises naming only the run folder: the child's output goes to the report
            print(proc.stdout[-3000:] + proc.stderr[-3000:])
        return proc

    monkeypatch.setattr(subprocess, "run", run)
    return launched


def run_train(run_dir: Path, data: Path, *overrides: str, timeout: int = 300, env: dict | None = None,
              wait: bool = True, model: tuple[str, ...] = DIGITS_MODEL) -> subprocess.CompletedProcess | subprocess.Popen:
    """Start `python -m tests.workers.dist_train` on the digits shards (or `data`, with `model` for it) with its own
    run.dir, cache and TMPDIR."""
    tmp = run_dir.parent / f"{run_dir.name}_tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tests.workers.dist_train",
           *train_args(run_dir, data, tmp / "cache", *overrides, model=model)]
    full_env = train_env(tmp, env)
    if not wait:  # one process (the caller starts the ranks, with their Slurm variables)
        return zygote.popen(cmd, env=full_env)
    if any(k.startswith("SLURM_") for k in full_env):  # one task of a Slurm job: its variables say which
        proc = zygote.run(cmd, env=full_env, timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc
    # Forked from the pre-imported zygote (tests/zygote.py), every rank at once as torchrun or srun would
    # start them (Lightning's own launcher would start rank 1 only once rank 0 is up, importing twice in turn).
    results = lightning_ranks("tests.workers.dist_train", cmd[3:], devices_of(overrides), full_env, tmp, timeout)
    out = "".join(f"--- rank {r} ---\n{res.stdout}{res.stderr}" for r, res in enumerate(results))
    assert all(res.returncode == 0 for res in results), f"{[res.returncode for res in results]}\n{out[-6000:]}"
    return Result(0, out)


def run_nodes(run_dir: Path, data: Path, nodes: int, devices: int, *overrides: str, timeout: int = 400) -> Result:
    """tests.workers.dist_train as a job of `nodes` x `devices` ranks on this machine, one launch per node with the node's
    own local cache folder (data.local) and /dev/shm, as on hosts that share the run folder but not their disks. Every
    rank forked from the test zygote (zygote.forked_nodes), so that many nodes fit a test; LATENTFORGE_TEST_FORK=0:
    a fresh launch per node (zygote.node_launches)."""
    tmp = run_dir.parent / f"{run_dir.name}_tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    per_node = [train_args(run_dir, data, tmp / f"node{n}_cache", f"trainer.num_nodes={nodes}",
                            f"trainer.devices={devices}", *overrides) for n in range(nodes)]
    if zygote.enabled():
        results = zygote.forked_nodes("tests.workers.dist_train", per_node, train_env(tmp, None), tmp, timeout, devices)
    else:
        results = zygote.node_launches("tests.workers.dist_train", per_node, train_env(tmp, None), tmp, timeout)
    out = "".join(f"--- launch {r} ---\n{res.stdout}{res.stderr}" for r, res in enumerate(results))
    assert all(res.returncode == 0 for res in results), f"{[res.returncode for res in results]}\n{out[-6000:]}"
    return Result(0, out)


def devices_of(overrides: tuple[str, ...] | list[str]) -> int:
    """The trainer.devices an override list asks for (the last one wins, as in Hydra)."""
    return next((int(o.split("=", 1)[1]) for o in reversed(overrides) if o.startswith("trainer.devices=")), 1)


def fsdp(sharding: str = "SHARD_GRAD_OP", devices: int = 2, batch: int = 8) -> list[str]:
    return ["strategy=fsdp", f"strategy.sharding={sharding}", f"trainer.devices={devices}",
            f"data.batch_size={batch}", "data.num_workers=1", "trainer.checkpoint_every_n_steps=2"]


def probe(run_dir: Path, rank: int = 0) -> dict:
    return json.loads((run_dir / f"probe_rank{rank}.json").read_text())


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from framework.inference.checkpoint import model_weights, read_checkpoint

    return model_weights(read_checkpoint(ckpt), "train")


def same_updates(got: Path, ref: Path, init: Path | None = None) -> None:
    """The final weights of run `got` moved from the start as those of run `ref` did (UPDATE_TOL, norms per
    tensor; the start: `init`'s init_weights.pt, default ref's). Frozen tensors must not move at all, and the
    reference must have trained (a typical weight moved far more than the tolerance)."""
    w0 = torch.load((init or ref) / "init_weights.pt", weights_only=True)
    wr, wg = weights(ref / "checkpoints" / "last.ckpt"), weights(got / "checkpoints" / "last.ckpt")
    assert wr.keys() == wg.keys() and set(w0) <= set(wr)
    rtol, atol = UPDATE_TOL["rtol"], UPDATE_TOL["atol"]
    moved, bad = [], []
    for k, start in w0.items():
        dr, dg = wr[k] - start, wg[k] - start
        if k.startswith(FROZEN):
            assert not dr.any() and not dg.any(), f"{k} is frozen but moved"
            continue
        moved.append(float(dr.abs().mean()))
        err, allowed = float((dg - dr).norm()), rtol * float(dr.norm()) + atol * dr.numel() ** 0.5
        if err > allowed:
            bad.append(f"{k}: |dw - dw_ref| {err:.3g} > {allowed:.3g} (|dw_ref| {float(dr.norm()):.3g})")
    moved.sort()
    assert moved[len(moved) // 2] > 100 * atol, f"the reference barely trained: median mean |update| {moved[len(moved) // 2]:.2e}"
    assert not bad, f"{len(bad)} of {len(moved)} tensors moved otherwise than in {ref.name}:\n" + "\n".join(bad[:10])


def folder_config(src: Path, out: Path, text_encoder: Path, **kw) -> dict:
    cfg = {"source": {"name": "folder", "path": str(src)}, "vae": "pixel", "text_encoder": str(text_encoder),
           "resolution": 8, "out": str(out), "progress": False}
    cfg.update(kw)
    return cfg


def read_rows(path: Path) -> list[dict]:
    from framework.data.shards import open_streaming

    ds = open_streaming(lambda: StreamingDataset(local=str(path), shuffle=False, batch_size=1))  # as the data module
    rows = [ds[i] for i in range(len(ds))]
    del ds
    return rows


MIXED_SIZES = [(40, 90), (40, 80), (80, 40), (90, 40), (60, 60), (50, 56), (30, 61), (64, 64)]  # (h, w) per image


BUCKETS = [[8, 16], [12, 12], [16, 8]]


def make_mixed_folder(root: Path, sizes=MIXED_SIZES, seed: int = 0) -> Path:
    """RGB PNGs of the given (height, width), each with a caption naming its layout."""

    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i, (h, w) in enumerate(sizes):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / f"img{i:03d}.png")
        layout = "landscape" if w > h else "portrait" if h > w else "square"
        (root / f"img{i:03d}.txt").write_text(f"a {layout} picture number {i}")
    return root


FAMILIES = ["pixart_debug", "sana_debug", "dit_debug"]


class CrashAt(pl.Callback):
    """Raises after optimizer step `step` (a crash: the last checkpoint is what survives)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("simulated crash")


def crash_and_resume(tmp_path, digits_shards, args: list[str], monkeypatch) -> tuple[dict, dict]:
    """A 4-step run, and the same run crashed after step 3 and resumed (checkpoints every 2 steps): the
    resumed run must log the same losses from the checkpoint on and end with the same weights."""
    import framework.train as train_lib

    args = [*args, "trainer.checkpoint_every_n_steps=2", "resume=auto"]
    full = train_lib.train(compose_cfg(cheap(tmp_path, digits_shards, *args, steps=4, run="full")))
    base = train_lib.build_callbacks
    monkeypatch.setattr(train_lib, "build_callbacks", lambda cfg, run_dir: [*base(cfg, run_dir), CrashAt(3)])
    with pytest.raises(RuntimeError, match="simulated crash"):
        train_lib.train(compose_cfg(cheap(tmp_path, digits_shards, *args, steps=4, run="crashed")))
    monkeypatch.setattr(train_lib, "build_callbacks", base)
    resumed = train_lib.train(compose_cfg(cheap(tmp_path, digits_shards, *args, steps=4, run="crashed")))
    lf, lr = losses(Path(full["run_dir"])), losses(Path(resumed["run_dir"]))
    assert [lr[s] for s in (2, 3)] == [lf[s] for s in (2, 3)]
    wf = torch.load(full["checkpoint"], weights_only=True)["state_dict"]
    wr = torch.load(resumed["checkpoint"], weights_only=True)["state_dict"]
    assert wf.keys() == wr.keys() and all(torch.equal(wf[k], wr[k]) for k in wf)
    return full, resumed


def reference_frechet(a: np.ndarray, b: np.ndarray) -> float:
    """The textbook formula with scipy's matrix square root, on features (N, D)."""
    from scipy import linalg

    mu1, mu2 = a.mean(0), b.mean(0)
    s1, s2 = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    covmean = linalg.sqrtm(s1 @ s2).real
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2 - 2 * covmean))


def make_tiny_clip(root: Path) -> Path:
    """A random 2-layer CLIP with a byte-level tokenizer (no merges), saved as a transformers folder."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer
    from transformers.models.clip.tokenization_clip import bytes_to_unicode

    root.mkdir(parents=True, exist_ok=True)
    chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)} | {c + "</w>": len(chars) + i for i, c in enumerate(chars)}
    vocab |= {"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1}
    (root / "vocab.json").write_text(json.dumps(vocab))
    (root / "merges.txt").write_text("#version: 0.2\n")
    tok = CLIPTokenizer(str(root / "vocab.json"), str(root / "merges.txt"))
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    torch.manual_seed(0)
    layers = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    cfg = CLIPConfig(text_config=dict(vocab_size=len(vocab), max_position_embeddings=77, **layers),
                     vision_config=dict(image_size=32, patch_size=8, **layers), projection_dim=16)
    CLIPModel(cfg).save_pretrained(root)
    CLIPProcessor(image_processor=images, tokenizer=tok).save_pretrained(root)
    return root


def make_tiny_vlm(root: Path, prompts: list[str], seed: int = 0) -> Path:
    """A random LLaVA (a 1-layer CLIP vision tower on 16x16 images, a 2-layer Llama) with a word-level tokenizer of the
    prompts' words plus "yes" and "no", and a chat template: a local image-text-to-text folder as transformers saves
    one. A random model's answer hardly depends on the image, so its output head is set to read one direction of the
    last hidden state that the image moves and the prompt does not (the largest image-driven direction across random
    images, made orthogonal to each prompt's mean, in judge=vlm's question) and a second such direction: "yes" along
    the first and "no" against it, both shifted by the second, every other token at 0, so over random images "yes",
    "no" and a third token all occur as answers."""
    from PIL import Image
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast)

    from framework.evaluation.judge import QUESTION

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "<image>": 4}
    for w in ["user", "assistant", ":", "yes", "no", *" ".join(prompts).split()]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        unk_token="<unk>", model_input_names=["input_ids", "attention_mask"],
                                        extra_special_tokens={"image_token": "<image>"})
    template = ("{% for m in messages %}{{ m['role'] }} : {% for c in m['content'] %}{% if c['type'] == 'image' %}"
                "<image> {% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endfor %}"
                "{% if add_generation_prompt %}assistant : {% endif %}")
    images = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    proc = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=4, num_additional_image_tokens=1,
                          vision_feature_select_strategy="default", chat_template=template)
    proc.save_pretrained(root)
    torch.manual_seed(seed)
    cfg = LlavaConfig(vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                     num_attention_heads=2, image_size=16, patch_size=4),
                      text_config=LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                              max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                                              eos_token_id=2, tie_word_embeddings=False),
                      image_token_index=4)
    model = LlavaForConditionalGeneration(cfg).eval()
    rng = np.random.default_rng(seed)
    seen: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(args[0][:, -1]))
    with torch.no_grad():
        for q in prompts:
            turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION.format(prompt=q)}]}]
            pil = [Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)) for _ in range(32)]
            model(**proc(images=pil, text=[proc.apply_chat_template(turn, add_generation_prompt=True)] * 32,
                         return_tensors="pt"))
        hook.remove()
        h = torch.stack(seen).double()  # (prompts, images, hidden)
        means = h.mean(1)
        top = torch.linalg.svd((h - means[:, None]).flatten(0, 1), full_matrices=False).Vh[:2].T
        d, e = torch.linalg.qr(torch.cat([means.T, top], dim=1)).Q[:, -2:].T  # two directions, prompt-free
        d, e = (v / ((h @ v).std() + 1e-12) * 3.0 for v in (d, e))  # logits of a few units either side of 0
        model.lm_head.weight.zero_()
        model.lm_head.weight[vocab["yes"]] = (d + e).float()  # both below 0 (another token first) where e < -|d|
        model.lm_head.weight[vocab["no"]] = (e - d).float()
    model.save_pretrained(root)
    return root


def torchrun(nproc: int, *args: str, tmp: Path, fork: bool = False,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess | Result:
    """`torchrun --standalone --nproc_per_node=N ARGS` (the command as users run it); fork=True: the same ranks
    forked from the test zygote (tests/zygote.py), for workers whose launch is not what is tested."""
    extra = env or {}
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(TMPDIR=str(tmp), OMP_NUM_THREADS="1", **extra)
    if fork:
        assert args[0] == "-m"
        return forked_torchrun(nproc, args[1], *args[2:], env=env)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


class TinyFeatures(torch.nn.Module):
    """A random feature network in the FID Inception's calling convention: uint8 (N, 3, H, W) -> (N, 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.float() / 127.5 - 1).relu().mean((2, 3))


class TinyI3D(torch.nn.Module):
    """A random video network in the calling convention of FVD's I3D TorchScript: float (N, 3, T, H, W) in [-1, 1] ->
    (N, 4) features with return_features (their softmax without); it refuses to rescale or resize, as the evaluation
    does both itself."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv3d(3, 4, (2, 16, 16), stride=(1, 16, 16))

    def forward(self, x: torch.Tensor, rescale: bool = False, resize: bool = False,
                return_features: bool = False) -> torch.Tensor:
        if rescale or resize:
            raise ValueError("the caller rescales and resizes")
        feats = self.conv(x).tanh().mean((2, 3, 4))
        return feats if return_features else feats.softmax(-1)


# ---------------------------------------------------------------------------------------------
# What an offline W&B run wrote: the records of its `run-<id>.wandb` transaction log. wandb keeps no Python
# reader for this file since its core moved to a separate service, so the tests parse it here. The layout is
# LevelDB's log format after a 7-byte header (":W&B", 0xBEE1, version): 32 KiB blocks of chunks, each
# `crc32 (4) | length (2, little endian) | type (1) | data`, type 1 a whole record and 2/3/4 the first, middle
# and last piece of a longer one. Each record is a protobuf `wandb_internal_pb2.Record`.
# ---------------------------------------------------------------------------------------------

BLOCK, CHUNK_HEADER, FILE_HEADER = 32768, 7, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> Iterator[Any]:
    """Every Record in a .wandb file, in order; read while W&B still writes it (wait_for_exit), the record being
    written (its chunk not wholly on disk yet) ends the read."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pieces = FILE_HEADER, b""
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # the tail of a block too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        if kind == 0 and length == 0:  # zero padding up to the next block
            pos += left
            continue
        if pos + CHUNK_HEADER + length > len(data):  # being written: its bytes are not all there yet
            return
        chunk = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        pieces = chunk if kind in (FULL, FIRST) else pieces + chunk
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(pieces)
            yield rec


def wait_for_exit(path: str | Path, timeout: float = 60.0) -> None:
    """W&B's service writes the log asynchronously: wait until the run's exit record is on disk. Until then a read
    can end inside a record still being written: `records` stops before a chunk not wholly there, and a record whose
    chunks are there but not yet final reads as not yet written."""
    from google.protobuf.message import DecodeError

    def exited() -> bool:
        try:
            return any(r.WhichOneof("record_type") == "exit" for r in records(path))
        except DecodeError:
            return False

    deadline = time.time() + timeout
    while not exited():
        assert time.time() < deadline, f"{path} has no exit record after {timeout} s"
        time.sleep(0.5)


def history(path: str | Path) -> list[dict[str, Any]]:
    """The logged rows (wandb.log calls), each as {key: value}."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return rows


def run_ids(path: str | Path) -> list[str]:
    return [rec.run.run_id for rec in records(path) if rec.WhichOneof("record_type") == "run"]


def run_record(path: str | Path) -> Any:
    """The first run record: the run's id, display name, group and tags as W&B received them."""
    return next(rec.run for rec in records(path) if rec.WhichOneof("record_type") == "run")


def wandb_config(path: str | Path) -> dict[str, Any]:
    """The run's config: the run record's and every later config update, merged (top-level keys)."""
    out: dict[str, Any] = {}
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        items = rec.run.config.update if kind == "run" else rec.config.update if kind == "config" else []
        for i in items:
            out[i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
    return out
