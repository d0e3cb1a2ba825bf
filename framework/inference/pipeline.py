"""Prompt -> image generation, shared by training grids, framework.sample and framework.eval.

Text is encoded with the encoder recorded in the dataset's dataset.json, latents are decoded with
its image codec, and the denoiser comes either from the live LightningModule or a checkpoint.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from PIL import Image, ImageDraw, ImageFont

from framework.inference.checkpoint import CKPT_KEY, model_weights, read_checkpoint, weights_used
from framework.inference.caching import BranchRunner, CacheSchedule, ScheduledSampling, resolve_schedule
from framework.models.backbones import Denoiser, ModelConfig, build_denoiser
from framework.models.objectives import DEFAULT_SAMPLER, Objective, ObjectiveConfig, sample_latents
from framework.distributed.sequence import group_of

# --------------------------------------------------------------------------------------------
# Encoders for generation
# --------------------------------------------------------------------------------------------


def with_encoders(info: dict[str, Any], vae: str | None = None, text_encoder: str | None = None,
                  keys: tuple[str, str] = ("vae", "text_encoder"), text: bool = True) -> dict[str, Any]:
    """`info` (a dataset summary) with its image codec and text encoder replaced where given, after checking
    that they exist on this machine (the text encoder only when `text`: prompts may all be precomputed):
    dataset.json records the folders of the machine that ran precompute, which a training node or a laptop
    may not have. `keys` name the settings in the error (training: sample.vae / sample.text_encoder)."""
    from data_prep.encoders import minilm_path

    info = {**info, **({"image_codec": vae} if vae else {}), **({"text_encoder": text_encoder} if text_encoder else {})}
    checks = [(info["image_codec"], keys[0], "VAE")] + ([(info["text_encoder"], keys[1], "text encoder")] if text else [])
    for spec, key, what in checks:
        if spec == "pixel":
            continue
        # As load_text_encoder resolves it; minilm_path() itself says when its package is not installed.
        path = minilm_path() if spec == "minilm" else Path(spec).expanduser()
        if not path.is_dir():
            source = "given" if spec in (vae, text_encoder) else f"recorded in the dataset's dataset.json ({info.get('path')})"
            raise FileNotFoundError(f"the {what} folder {spec} ({source}) is not on this machine; set {key}=PATH to a "
                                    f"local copy of it (the same weights the dataset was encoded with)")
    return info


# --------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------


class Pipeline:
    """Denoiser + objective + the dataset's encoders, ready to turn prompts into images."""

    def __init__(
        self,
        model: Denoiser,
        objective: Objective,
        empty_text: torch.Tensor,
        dataset_info: dict[str, Any],
        device: torch.device | str = "cpu",
    ) -> None:
        self.model, self.objective, self.info = model, objective, dataset_info
        self.device = torch.device(device)
        self.empty_text = empty_text.float()
        self._codec = None  # the image codec (a VAE), loaded by the first decode: a rank that never decodes never loads it
        self._build: Any = None  # from_checkpoint(lazy=True): builds the denoiser on its first use (ensure_model)
        self._sequence: Any = None  # the SequenceParallel to split it over when built (split_when_built)
        self._group_size = 1  # decode_ranks: the denoising ranks' sequence-parallel group size
        self._text_encoder = None
        # The dataset's precomputed grid prompts: generating them loads no text encoder.
        self._cache: dict[str, torch.Tensor] = {p: e.float() for p, e in dataset_info.get("prompt_embeds", {}).items()}

    def sizes(self) -> list[tuple[int, int]]:
        """The latent sizes the model was trained at: its aspect-ratio buckets, or its one size."""
        return [tuple(b) for b in self.info.get("buckets") or []] or [tuple(self.model.cfg.latent_hw)]

    def latent_size(self, height: int | None = None, width: int | None = None,
                    aspect: str | None = None) -> tuple[int, int]:
        """The latent (h, w) for an image of height x width pixels, or of aspect ratio "W:H" (the trained bucket nearest
        it); the model's own size when neither is given. A size the model was not trained at is refused."""
        ds, sizes = int(self.info.get("downsample", 1)), self.sizes()
        pixels = lambda s: f"{s[0] * ds}x{s[1] * ds}"
        if aspect is not None:
            if height is not None or width is not None:
                raise ValueError(f"aspect={aspect} with height / width: give one or the other")
            try:
                w, h = (float(v) for v in str(aspect).split(":"))
                assert w > 0 and h > 0
            except (ValueError, AssertionError):
                raise ValueError(f"aspect={aspect}: write it as width:height, e.g. aspect=16:9") from None
            if len(sizes) == 1:
                raise ValueError(f"aspect={aspect}: this model was trained at {pixels(sizes[0])} only (its dataset has no "
                                 "aspect-ratio buckets; precompute with buckets=... to train several shapes)")
            from data_prep.buckets import nearest_bucket

            return sizes[nearest_bucket(h, w, sizes)]
        if height is None and width is None:
            return tuple(self.model.cfg.latent_hw)
        if height is None or width is None or height % ds or width % ds:
            raise ValueError(f"height={height} width={width}: give both, multiples of the VAE's downsampling {ds}")
        size = (height // ds, width // ds)
        if size not in sizes:
            near = sorted(sizes, key=lambda s: abs(math.log(s[0] / s[1]) - math.log(size[0] / size[1])))[:3]
            raise ValueError(f"height={height} width={width}: the model was not trained at that size; its sizes nearest "
                             f"that aspect ratio are {', '.join(pixels(s) for s in near)} (or use aspect=W:H)")
        return size

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, device: str = "cpu", weights: str = "ema",
                        vae: str | None = None, text_encoder: str | None = None, lazy: bool = False) -> "Pipeline":
        """The pipeline of a checkpoint (one file or a sharded folder), EMA weights when present and asked for;
        `vae` / `text_encoder` replace the encoder folders the dataset recorded (checked to exist). lazy: the
        denoiser is built, loaded and moved to `device` on its first use (ensure_model), the file memory-mapped
        until then: a rank that only decodes (decode_ranks) never holds it."""
        return cls.from_checkpoint_dict(read_checkpoint(path, mmap=lazy), device, weights, path, vae, text_encoder, lazy)

    @classmethod
    def from_checkpoint_dict(cls, ckpt: dict[str, Any], device: str = "cpu", weights: str = "ema",
                             path: str | os.PathLike = "checkpoint", vae: str | None = None,
                             text_encoder: str | None = None, lazy: bool = False) -> "Pipeline":
        """Like from_checkpoint, for a checkpoint already read with read_checkpoint (`path` names it in errors)."""
        extra = ckpt[CKPT_KEY]
        cfg = extra["config"]
        used, model_cfg = weights_used(ckpt, weights), ModelConfig(**cfg["model"])

        def build() -> Denoiser:
            model = build_denoiser(model_cfg)
            missing, unexpected = model.load_state_dict(model_weights(ckpt, used), strict=False)
            if missing or unexpected:
                raise ValueError(f"ckpt={path} does not fit its own model config: missing {missing[:3]}, "
                                 f"unexpected {unexpected[:3]}")
            return model.to(device).eval()

        objective = Objective(ObjectiveConfig(**cfg["objective"]))
        info = with_encoders(extra["dataset"], vae, text_encoder)
        if not lazy:
            return cls(build(), objective, extra["empty_text"], info, device)
        return cls.deferred(build, model_cfg, objective, extra["empty_text"], info, device)

    @classmethod
    def deferred(cls, build: Any, model_cfg: ModelConfig, objective: Objective, empty_text: torch.Tensor,
                 dataset_info: dict[str, Any], device: torch.device | str = "cpu") -> "Pipeline":
        """A pipeline whose denoiser `build()` makes on its first use (ensure_model); until then `model` is a
        meta-device placeholder of `model_cfg` (its config and structure, no memory)."""
        with torch.device("meta"):
            placeholder = build_denoiser(model_cfg)
        pipe = cls(placeholder.eval(), objective, empty_text, dataset_info, device)
        pipe._build = build
        return pipe

    def ensure_model(self) -> Denoiser:
        """The denoiser, built and loaded now if the pipeline was made lazily (and split over its sequence-parallel
        group if split_when_built asked for it)."""
        if self._build is not None:
            self.model, self._build = self._build(), None
            if self._sequence is not None:
                from framework.distributed.sequence import install

                install(self.model, self._sequence)
        return self.model

    def split_when_built(self, sp: Any, group_size: int) -> None:
        """Split the lazily built denoiser over `sp` (a SequenceParallel; None on a rank that only decodes) when it is
        built; `group_size`: the denoising groups' size, which every rank of decode_ranks needs to know."""
        if self._build is None:
            raise RuntimeError("split_when_built: the denoiser is already built; split it with sequence.install")
        self._sequence, self._group_size = sp, group_size

    @property
    def codec(self) -> Any:
        """The dataset's image codec (or sample.vae's), loaded on first use."""
        if self._codec is None:
            from data_prep.encoders import load_image_codec

            self._codec = load_image_codec(self.info["image_codec"], device=self.device,
                                           image_mode=self.info.get("image_mode", "RGB"))
        return self._codec

    def encode(self, prompts: Sequence[str]) -> list[torch.Tensor]:
        """Per-token embeddings of each prompt (cached; the encoder loads on first use)."""
        todo = [p for p in dict.fromkeys(prompts) if p not in self._cache]
        if todo:
            if self._text_encoder is None:
                from data_prep.encoders import load_text_encoder

                self._text_encoder = load_text_encoder(self.info["text_encoder"], device=self.device)
            for p, e in zip(todo, self._text_encoder.encode(list(todo))):
                self._cache[p] = e.float().cpu()
        return [self._cache[p] for p in prompts]

    def free_text_encoder(self) -> None:
        """Drop the text encoder (a T5-XXL is ~9.5 GB) until the next prompt that needs it; embeddings stay cached."""
        self._text_encoder = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[str],
        steps: int = 20,
        guidance: float = 4.0,
        sampler: str | None = None,
        seed: int = 0,
        labels: Sequence[int | None] | None = None,
        batch_size: int = 64,
        split_ranks: bool = False,
        candidates: int = 1,
        progress: bool = False,
        cache_schedule: str | CacheSchedule | None = None,
        decode_ranks: int | str = 0,
        decode_on_rank0: bool = False,
        size: tuple[int, int] | None = None,
    ) -> torch.Tensor | None:
        """Images (N * candidates, C, H, W) in [-1, 1], each prompt's candidates together.

        Candidate j of prompt i depends only on (prompt i, seed, i, j), so the first candidates are the
        same whatever `candidates` is, and candidate 0 is what plain sampling (candidates=1) draws.
        All N * candidates images are drawn in batches of `batch_size`: the cost grows linearly.
        split_ranks: inside a multi-process job, every rank must call this (a sharded model needs all
        ranks in each forward); each rank then generates its own contiguous share of the prompts and
        every rank gets all images back, the same ones one process would draw. With decode_on_rank0 the
        ranks send their shares' latents to rank 0, which alone decodes them (and alone loads the VAE, a
        training job's grids); the other ranks get None. A sequence-parallel model
        (framework/distributed/sequence.py) is called by every rank of the job too; its groups share the prompts.
        progress: a bar over the batches (on rank 0).
        cache_schedule: a CacheSchedule, or a `cache_schedule=` value (a file, uniform:K): sampling reuses the
        branches it skips from the previous step (framework/inference/caching.py); refused when made for another
        sampler, step count or model.
        decode_ranks: inside a multi-process job, every rank calls this; the last `decode_ranks` ranks decode
        while the others denoise (framework/inference/decoupled.py); "auto": K from the first batch's measured
        denoising and decoding times. Rank 0 gets all images, the same ones plain sampling draws; the other ranks
        get None.
        size: the latent (h, w) to generate at (`latent_size()`: one the model was trained at); None: the model's.
        """
        if size is not None and tuple(size) not in self.sizes():
            raise ValueError(f"size={tuple(size)}: the model was trained at latent sizes {self.sizes()}")
        hw = tuple(size) if size is not None else tuple(self.model.cfg.latent_hw)
        if candidates < 1:
            raise ValueError(f"candidates={candidates} must be >= 1")
        if self.model.cfg.num_classes is not None and (labels is None or any(lbl is None for lbl in labels)):
            raise ValueError("this model is class-conditional: give a class label for every prompt")
        labels = list(labels) if labels is not None else [None] * len(prompts)
        per_candidate = [noise_seeds(seed, len(prompts), j) for j in range(candidates)]
        noise = [per_candidate[j][i] for i in range(len(prompts)) for j in range(candidates)]
        prompts = [p for p in prompts for _ in range(candidates)]
        labels = [lbl for lbl in labels for _ in range(candidates)]
        n = len(prompts)
        schedule = self.schedule(cache_schedule, sampler, steps)
        sp = group_of(self.model)
        if decode_ranks:
            if sp is not None and sp is not self._sequence:  # (split_denoisers' groups are the supported way)
                raise ValueError("decode_ranks with a model split for sequence_parallel over every rank: split only the "
                                 "denoising ranks (framework.cli.share_ranks with both set)")
            if split_ranks:
                raise ValueError("decode_ranks and split_ranks: choose one way to share generation between ranks")
            return self._generate_decoupled(prompts, labels, noise, steps, guidance, sampler, batch_size, progress,
                                            schedule, decode_ranks, hw)
        self.ensure_model()  # (decode_ranks: only the denoising ranks build it)
        world = _world_size() if split_ranks or sp is not None else 1
        if world == 1:
            return self._generate(prompts, labels, noise, steps, guidance, sampler, batch_size, hw, progress, schedule)
        import torch.distributed as dist

        # Equal shares (the last ones padded with a repeat of image 0) so that every rank runs the
        # same number of forwards, which FSDP's collectives need. A sequence-parallel group (P consecutive
        # ranks, framework/distributed/sequence.py) draws one share together; its P copies are identical.
        if not split_ranks:  # a sequence-parallel model: every group draws every image
            shares, share = 1, 0
        else:
            shares, share = (sp.dp_size, sp.dp_rank) if sp is not None else (world, dist.get_rank())
        per = math.ceil(n / shares)
        idx = [i for i in range(share * per, (share + 1) * per) if i < n]
        idx += [0] * (per - len(idx))
        decode_here = not (decode_on_rank0 and shares > 1)
        leader = sp is None or sp.rank == 0  # a sequence-parallel group's copies are identical: one rank decodes
        mine = self._generate([prompts[i] for i in idx], [labels[i] for i in idx], [noise[i] for i in idx],
                              steps, guidance, sampler, batch_size, hw, progress and dist.get_rank() == 0,
                              schedule, decode=decode_here and leader).to(self.device)
        if decode_here and sp is not None and sp.size > 1:
            mine = _from_group_leader(mine, sp, leader)
        if shares == 1:
            return mine.cpu()
        if not decode_here:  # the latents to rank 0, decoded there alone
            gathered = [torch.empty_like(mine) for _ in range(world)] if dist.get_rank() == 0 else None
            dist.gather(mine, gathered, dst=0)
            if dist.get_rank() != 0:
                return None
            z = torch.cat(gathered[:: world // shares])[:n].to(self.device)
            return torch.cat([self.decode(z[i : i + batch_size]) for i in range(0, n, batch_size)])
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        return torch.cat(gathered[:: world // shares])[:n].cpu()

    def schedule(self, spec: str | CacheSchedule | None, sampler: str | None, steps: int) -> CacheSchedule | None:
        """The cache schedule `spec` names, checked against this model, the sampler and the step count."""
        name = sampler or DEFAULT_SAMPLER[self.objective.cfg.name]
        if isinstance(spec, CacheSchedule):
            spec.check(self.model, self.objective.cfg.name, name, steps)
            return spec
        return resolve_schedule(spec, self.model, self.objective.cfg.name, name, steps)

    def _generate(self, prompts: list[str], labels: list[int | None], seeds: list[int], steps: int,
                  guidance: float, sampler: str | None, batch_size: int, hw: tuple[int, int], progress: bool = False,
                  schedule: CacheSchedule | None = None, decode: bool = True) -> torch.Tensor:
        """Images of the prompts in batches, from latents of size `hw`; decode=False: their scaled latents."""
        from tqdm import tqdm

        n, out = len(prompts), []
        bar = tqdm(total=n, desc="generate", unit="img", disable=not progress, leave=False)
        with self._branch_runner(schedule) as runner:
            for i in range(0, n, batch_size):
                z = self._denoise_batch(prompts[i : i + batch_size], labels[i : i + batch_size],
                                        seeds[i : i + batch_size], steps, guidance, sampler, runner, schedule, hw)
                out.append(self.decode(z) if decode else z)
                bar.update(len(out[-1]))
        bar.close()
        return torch.cat(out)

    def _generate_decoupled(self, prompts: list[str], labels: list[int | None], seeds: list[int], steps: int,
                            guidance: float, sampler: str | None, batch_size: int, progress: bool,
                            schedule: CacheSchedule | None, decode_ranks: int, hw: tuple[int, int]) -> torch.Tensor | None:
        """The batches of _generate, denoised and decoded on separate ranks (framework/inference/decoupled.py)."""
        import torch.distributed as dist
        from tqdm import tqdm

        from framework.inference.decoupled import choose_decode_ranks, generate_decoupled

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"decode_ranks={decode_ranks} needs a multi-process job: launch with "
                             f"torchrun --nproc_per_node={decode_ranks + 1} (or more)")
        n = len(prompts)
        batches = [{"size": min(batch_size, n - i), "slice": slice(i, i + batch_size)} for i in range(0, n, batch_size)]
        bar = tqdm(total=n, desc="denoise", unit="img", disable=not (progress and dist.get_rank() == 0), leave=False)
        active: dict[str, BranchRunner | None] = {"runner": None}  # the cache runner, once installed

        def denoise(batch: dict) -> torch.Tensor:
            s = batch["slice"]
            return self._denoise_batch(prompts[s], labels[s], seeds[s], steps, guidance, sampler, active["runner"],
                                       schedule, hw)

        shape = (self.model.cfg.in_channels, *hw)
        if decode_ranks == "auto":
            if self._group_size > 1:
                raise ValueError("decode_ranks=auto with sequence_parallel: give the number of decoding ranks")
            decode_ranks = choose_decode_ranks(self, batches[0], denoise, shape)
        denoising = dist.get_rank() < dist.get_world_size() - decode_ranks
        if denoising:  # a decoding rank never builds the denoiser
            self.ensure_model()
        with self._branch_runner(schedule if denoising else None) as active["runner"]:
            images = generate_decoupled(self, batches, decode_ranks, denoise, shape, bar.update, self._group_size)
        bar.close()
        return images

    @contextmanager
    def _branch_runner(self, schedule: CacheSchedule | None) -> Iterator[BranchRunner | None]:
        """The model's branches wrapped for cached sampling while inside (None and nothing done without a schedule)."""
        if schedule is None:
            yield None
            return
        runner = BranchRunner(self.model)
        with runner.installed():
            yield runner

    def _denoise_batch(self, chunk: list[str], labels: list[int | None], seeds: list[int], steps: int,
                       guidance: float, sampler: str | None, runner: BranchRunner | None,
                       schedule: CacheSchedule | None, hw: tuple[int, int]) -> torch.Tensor:
        """Scaled latents (b, C, H, W) of one batch, (H, W) = hw; both CFG halves in one forward, so they share one
        branch cache."""
        from framework.models.conditioning import guidance_batch, guide, pad_and_stack

        C, (H, W) = self.model.cfg.in_channels, hw
        text, mask = pad_and_stack([e.to(self.device) for e in self.encode(chunk)])  # (b, L, D)
        lab = torch.tensor(labels, device=self.device) if self.model.cfg.num_classes is not None else None
        text2, mask2, lab = guidance_batch(self.model, text, mask, lab, self.empty_text)
        steps_run = ScheduledSampling(runner, schedule) if runner is not None else None
        if runner is not None:
            runner.reset()

        def denoise(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            if steps_run is not None:
                steps_run.next_step()
            return guide(self.model(x.repeat(2, 1, 1, 1), t.repeat(2), text2, mask2, lab), guidance)  # (b, C, H, W)

        # One generator per image keeps image i independent of the batch it lands in.
        x = torch.stack([torch.randn(C, H, W, generator=torch.Generator().manual_seed(s)) for s in seeds])
        return sample_latents(denoise, self.objective.sampler(sampler), x, steps, self.device)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Scaled latents -> pixels in [-1, 1] (undoes the data module's scaling)."""
        raw = z / self.info["scaling_factor"] + self.info["shift_factor"]
        return self.codec.decode(raw).float().clamp(-1, 1).cpu()


def noise_seeds(seed: int, n: int, candidate: int = 0) -> list[int]:
    """The initial-noise seed of each of n prompts for one candidate stream (0: plain sampling)."""
    stream = seed if candidate == 0 else (seed * 0x9E3779B97F4A7C15 + candidate) % 2**63
    return torch.randint(0, 2**62, (n,), generator=torch.Generator().manual_seed(stream)).tolist()


def _from_group_leader(images: torch.Tensor, sp: Any, leader: bool) -> torch.Tensor:
    """The images the sequence-parallel group's first rank decoded, on every rank of the group (the others hold
    their latents until then): the shape, then the images, broadcast inside the group."""
    import torch.distributed as dist

    src = dist.get_global_rank(sp.group, 0)
    shape = torch.tensor(list(images.shape) if leader else [0] * images.dim(), dtype=torch.long, device=images.device)
    dist.broadcast(shape, src=src, group=sp.group)
    out = images if leader else torch.empty(tuple(shape.tolist()), dtype=torch.float32, device=images.device)
    dist.broadcast(out, src=src, group=sp.group)
    return out


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# --------------------------------------------------------------------------------------------
# Pictures
# --------------------------------------------------------------------------------------------


def to_pil(img: torch.Tensor, size: int | None = None) -> Image.Image:
    """(C, H, W) in [-1, 1] -> PIL image, upscaled with nearest neighbour to `size` (tiny latents stay crisp)."""
    arr = ((img.clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()
    im = Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr)
    if size and max(im.size) < size:  # keep the aspect ratio (digit pairs are 8x16)
        f = size / max(im.size)
        im = im.resize((round(im.width * f), round(im.height * f)), Image.NEAREST)
    return im


def save_grid(images: torch.Tensor, captions: Sequence[str], path: str | os.PathLike, ncol: int | None = None,
              cell: int = 96) -> Path:
    """Write a PNG grid with each image's prompt printed under it."""
    n = len(images)
    ncol = ncol or min(n, 10)
    nrow = math.ceil(n / ncol)
    label_h = 28
    cell_w = round(cell * images.shape[-1] / images.shape[-2])  # cell is the height; wide images get wide cells
    grid = Image.new("RGB", (ncol * cell_w, nrow * (cell + label_h)), "white")
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default()
    for i, (img, cap) in enumerate(zip(images, captions)):
        r, c = divmod(i, ncol)
        x, y = c * cell_w, r * (cell + label_h)
        grid.paste(to_pil(img).convert("RGB").resize((cell_w, cell), Image.NEAREST), (x, y))
        for k, line in enumerate(_wrap(cap, max(4, cell_w // 6))[:2]):
            draw.text((x + 2, y + cell + 1 + 12 * k), line, fill="black", font=font)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path


def _wrap(text: str, width: int) -> list[str]:
    lines, cur = [], ""
    for word in text.split():
        if cur and len(cur) + 1 + len(word) > width:
            lines.append(cur)
            cur = word
        else:
            cur = f"{cur} {word}".strip()
    return lines + ([cur] if cur else [])
