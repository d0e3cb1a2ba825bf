"""Judges: models that score how well an image fits its prompt, used to pick among candidates (best_of=N).

A judge is one small class registered by name (`@register_judge("name")`); `get_judge(name, path)` builds
it once per process. `score(images, prompts)` returns one number per image, higher is better;
`prefers(a, b, prompts)` is the pairwise comparison the knockout tournament asks (by default: the
higher score wins, ties to `a`).

- `digits`: an RBF support-vector classifier trained on the `judge` half of the training digits; the
  score is the margin of the requested digit over the best other one. The metrics' classifier trains
  on the other half (framework/evaluation/metrics.py), so picking cannot simply overfit the metric.
- `pairs`: the digits judge on each half of a digit-pairs image; the score is the smaller margin.
- `clip`: CLIP score (torchmetrics) from a local CLIP folder (`judge_path=...`), for real data.
- `vlm`: SANA-1.5's judge: a local vision-language model folder (`judge_path=...`, any transformers
  image-text-to-text model: Qwen2-VL, LLaVA, SmolVLM, ...) asked per (image, prompt) whether the image
  matches the prompt, to be answered yes or no. Its pairwise rule (`answer_prefers`): an image answered
  "yes" beats one answered "no"; between two "yes" the higher log-probability of "yes" wins, between two
  "no" the lower log-probability of "no". Its `score` is the log-probability of "yes".
- `digits_vlm`: the same rule with the digit classifier answering the question (yes when it reads every
  requested digit where the prompt puts it; the probability from its calibrated class probabilities): a
  judge with known answers, to measure the rule on the digit benchmarks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from data_prep.sources.digits import DIGIT_WORDS, MAX_VALUE

_WORD_TO_DIGIT = {w: d for d, w in enumerate(DIGIT_WORDS)}


def prompt_digit(prompt: str) -> int | None:
    """The digit a prompt asks for ('a handwritten 7', 'the digit seven'), or None."""
    for tok in re.findall(r"[a-z]+|\d", prompt.lower()):
        if tok.isdigit():
            return int(tok)
        if tok in _WORD_TO_DIGIT:
            return _WORD_TO_DIGIT[tok]
    return None


def requested_digits(prompts: Sequence[str], judge: str) -> list[int]:
    """The digit each prompt asks for; a prompt that names none is refused, naming the judge."""
    digits = [prompt_digit(p) for p in prompts]
    bad = [p for p, d in zip(prompts, digits) if d is None]
    if bad:
        raise ValueError(f"judge={judge} cannot tell which digit these prompts ask for: {bad[:3]}")
    return digits


def to_uint8_rgb(images: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) in [-1, 1] -> (N, 3, H, W) uint8 (a grey image repeated over the three channels)."""
    pixels = ((images.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return pixels.repeat(1, 3, 1, 1) if pixels.shape[1] == 1 else pixels


def to_digit_features(images: torch.Tensor) -> np.ndarray:
    """(N, C, H, W) in [-1, 1] -> (N, 64) on the 0..16 scale of scikit-learn's digits."""
    from framework.evaluation.metrics import to_unit_digits

    return (to_unit_digits(images) * MAX_VALUE).flatten(1).numpy()


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------


class Judge:
    """Scores (image, prompt) pairs; subclasses set `name` and implement `score`."""

    name = ""

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> np.ndarray:
        raise NotImplementedError

    def prefers(self, a: torch.Tensor, b: torch.Tensor, prompts: Sequence[str]) -> np.ndarray:
        """For each prompt, True when image a[i] is at least as good as b[i]."""
        return self.score(a, prompts) >= self.score(b, prompts)


JUDGES: dict[str, Callable[..., Judge]] = {}
_BUILT: dict[tuple[str, str | None], Judge] = {}


def register_judge(name: str):
    def add(cls):
        cls.name = name
        JUDGES[name] = cls
        return cls

    return add


def get_judge(name: str, path: str | None = None) -> Judge:
    """The judge `name`, built once per process (and per `path` for judges that load weights)."""
    if name not in JUDGES:
        raise ValueError(f"judge={name!r} is unknown; available: {sorted(JUDGES)}")
    key = (name, path)
    if key not in _BUILT:
        _BUILT[key] = JUDGES[name](path) if path is not None else JUDGES[name]()
    return _BUILT[key]


def _no_path(name: str, path: str | None) -> None:
    if path is not None:
        raise ValueError(f"judge={name} is built in and takes no judge_path (got {path!r})")


# --------------------------------------------------------------------------------------------
# Judges
# --------------------------------------------------------------------------------------------


@register_judge("digits")
class DigitJudge(Judge):
    """RBF SVM on the `judge` half of the training digits; score = margin of the requested digit."""

    def __init__(self, path: str | None = None) -> None:
        from sklearn.svm import SVC

        from data_prep.sources.digits import load_digits
        from framework.evaluation.metrics import training_half

        _no_path("digits", path)
        x_tr, y_tr = training_half("judge")
        # gamma=0.001, C=10 on raw 0..16 pixels is the classic setting for this data set.
        self.clf = SVC(gamma=0.001, C=10.0).fit(x_tr.reshape(len(x_tr), -1).astype(np.float64), y_tr)
        x_te, y_te = load_digits("heldout")
        self.heldout_accuracy = float((self.clf.predict(x_te.reshape(len(x_te), -1)) == y_te).mean())

    def margins(self, images: torch.Tensor, digits: Sequence[int]) -> np.ndarray:
        """Margin of each requested digit over the best other class (> 0 means judged right)."""
        dec = self.clf.decision_function(to_digit_features(images))  # (N, 10), one-vs-rest shape
        idx = np.arange(len(digits))
        own = dec[idx, list(digits)]
        dec[idx, list(digits)] = -np.inf
        return own - dec.max(axis=1)

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> np.ndarray:
        return self.margins(images, requested_digits(prompts, "digits"))


@register_judge("pairs")
class PairJudge(Judge):
    """The digits judge on the left and the right half; score = the smaller of the two margins."""

    def __init__(self, path: str | None = None) -> None:
        _no_path("pairs", path)
        self.digits = get_judge("digits")

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> np.ndarray:
        from data_prep.sources.digit_pairs import parse_pair

        pairs = [parse_pair(p) for p in prompts]
        bad = [p for p, lr in zip(prompts, pairs) if lr is None]
        if bad:
            raise ValueError(f"judge=pairs cannot read which digit goes where in: {bad[:3]} "
                             "(it knows the digit_pairs caption phrasings)")
        left, right = images.chunk(2, dim=-1)
        return np.minimum(self.digits.margins(left, [a for a, _ in pairs]),
                          self.digits.margins(right, [b for _, b in pairs]))


@register_judge("clip")
class ClipJudge(Judge):
    """CLIP score (100 x cosine of image and text embeddings, torchmetrics) from a local CLIP folder."""

    def __init__(self, path: str | None = None) -> None:
        from torchmetrics.multimodal.clip_score import CLIPScore

        if path is None or not Path(path).is_dir():
            raise ValueError(f"judge=clip needs judge_path=<a local CLIP folder (transformers CLIPModel + "
                             f"processor)>; got {path!r}")
        def load():  # torchmetrics takes hub names or a loader; ours reads the local folder only
            from transformers import CLIPModel, CLIPProcessor

            return CLIPModel.from_pretrained(path).eval(), CLIPProcessor.from_pretrained(path)

        self.metric = CLIPScore(model_name_or_path=load)

    @torch.no_grad()
    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> np.ndarray:
        from torchmetrics.functional.multimodal.clip_score import _clip_score_update

        pixels = to_uint8_rgb(images)
        scores, _ = _clip_score_update(list(pixels), list(prompts), self.metric.model, self.metric.processor)
        return scores.float().cpu().numpy()


# --------------------------------------------------------------------------------------------
# Yes / no judges (SANA-1.5's rule)
# --------------------------------------------------------------------------------------------


@dataclass
class Answers:
    """A judge's answers to "does this image match its prompt?", one per image."""

    yes: np.ndarray
    """True where the answer is "yes" (anything else counts as "no")."""
    logp_yes: np.ndarray
    """Log-probability of "yes" as the answer."""
    logp_no: np.ndarray
    """Log-probability of "no" as the answer."""

    def __getitem__(self, index) -> "Answers":
        return Answers(self.yes[index], self.logp_yes[index], self.logp_no[index])


def answer_prefers(a: Answers, b: Answers) -> np.ndarray:
    """SANA-1.5's pairwise rule, per pair: True where a wins. A "yes" beats a "no"; two "yes": the higher
    log-probability of "yes" wins; two "no": the lower log-probability of "no" (the less sure "no"). Ties go to a."""
    same = np.where(a.yes, a.logp_yes >= b.logp_yes, a.logp_no <= b.logp_no)
    return np.where(a.yes == b.yes, same, a.yes)


class YesNoJudge(Judge):
    """A judge that answers yes or no per (image, prompt); subclasses implement `answers`. `prefers` is SANA-1.5's
    rule on both answers; `score` (for selection=score) is the log-probability of "yes"."""

    def answers(self, images: torch.Tensor, prompts: Sequence[str]) -> Answers:
        raise NotImplementedError

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> np.ndarray:
        return self.answers(images, prompts).logp_yes

    def prefers(self, a: torch.Tensor, b: torch.Tensor, prompts: Sequence[str]) -> np.ndarray:
        both = self.answers(torch.cat([a, b]), [*prompts, *prompts])
        return answer_prefers(both[: len(a)], both[len(a):])


QUESTION = 'Does this image match the description "{prompt}"? Answer with yes or no.'
"""What the VLM is asked about each (image, prompt), as the single user turn of its chat template."""

ANSWER_WORDS = {"yes": ("yes", "Yes", " yes", " Yes"), "no": ("no", "No", " no", " No")}
"""Spellings of each answer; those the tokenizer encodes as one token are the answer's first tokens."""


def answer_token_ids(tokenizer, words: Sequence[str]) -> list[int]:
    """The ids of the spellings in `words` that are one (known) token each."""
    ids = []
    for w in words:
        enc = tokenizer.encode(w, add_special_tokens=False)
        if len(enc) == 1 and enc[0] != tokenizer.unk_token_id and enc[0] not in ids:
            ids.append(enc[0])
    return ids


@register_judge("vlm")
class VLMJudge(YesNoJudge):
    """A local transformers image-text-to-text model asked QUESTION per (image, prompt); the answer is its most likely
    first token, the log-probabilities those of the answer tokens (summed over spellings) at that position."""

    batch_size = 16

    def __init__(self, path: str | None = None) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        if path is None or not Path(path).is_dir():
            raise ValueError("judge=vlm needs judge_path=<a local vision-language model folder (a transformers "
                             f"image-text-to-text model and its processor: Qwen2-VL, LLaVA, SmolVLM, ...)>; got {path!r}")
        try:
            self.processor = AutoProcessor.from_pretrained(path, local_files_only=True)
            self.model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True,
                                                                     torch_dtype="auto").eval()
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"judge=vlm: {path} does not load as a transformers image-text-to-text model with its "
                             f"processor ({type(e).__name__}: {e})") from e
        if torch.cuda.is_available():
            self.model.to(torch.device("cuda", torch.cuda.current_device()))
        tok = self.processor.tokenizer
        self.yes_ids, self.no_ids = (answer_token_ids(tok, ANSWER_WORDS[w]) for w in ("yes", "no"))
        if not self.yes_ids or not self.no_ids:
            raise ValueError(f"judge=vlm: the tokenizer of {path} has no single token for 'yes' or 'no' "
                             f"(yes: {self.yes_ids}, no: {self.no_ids}), so the answer cannot be read")
        self._seen: dict[tuple[bytes, str], tuple[bool, float, float]] = {}

    def text(self, prompt: str) -> str:
        turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION.format(prompt=prompt)}]}]
        return self.processor.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)

    @torch.no_grad()
    def ask(self, pixels: torch.Tensor, prompt: str) -> list[tuple[bool, float, float]]:
        """(answer is yes, log p(yes), log p(no)) for each uint8 (3, H, W) image of `pixels` under one prompt (one
        text, so the batch needs no padding)."""
        from PIL import Image

        pil = [Image.fromarray(p.permute(1, 2, 0).numpy()) for p in pixels]
        inputs = self.processor(images=pil, text=[self.text(prompt)] * len(pil), return_tensors="pt")
        inputs = inputs.to(self.model.device)
        logp = torch.log_softmax(self.model(**inputs).logits[:, -1].float(), dim=-1).cpu()
        yes = torch.isin(logp.argmax(-1), torch.tensor(self.yes_ids))
        lp_yes, lp_no = (logp[:, ids].logsumexp(-1) for ids in (self.yes_ids, self.no_ids))
        return [(bool(y), float(a), float(b)) for y, a, b in zip(yes, lp_yes, lp_no)]

    def answers(self, images: torch.Tensor, prompts: Sequence[str]) -> Answers:
        """Each (image, prompt) is asked once per judge: a tournament's winners are not asked again."""
        if images.ndim != 4:
            raise ValueError(f"judge=vlm judges images (N, C, H, W); got a batch of shape {tuple(images.shape)}")
        pixels = to_uint8_rgb(images)
        keys = [(p.numpy().tobytes(), q) for p, q in zip(pixels, prompts)]
        todo: dict[str, dict[bytes, int]] = {}  # prompt -> each distinct image not asked yet -> its first row
        for i, (image, prompt) in enumerate(keys):
            if (image, prompt) not in self._seen:
                todo.setdefault(prompt, {}).setdefault(image, i)
        for prompt, first in todo.items():
            rows = list(first.values())
            for s in range(0, len(rows), self.batch_size):
                chunk = rows[s : s + self.batch_size]
                for i, got in zip(chunk, self.ask(pixels[chunk], prompt)):
                    self._seen[keys[i]] = got
        got = [self._seen[k] for k in keys]
        return Answers(*(np.array(col) for col in zip(*got)))


@register_judge("digits_vlm")
class DigitVLMJudge(YesNoJudge):
    """The digit classifier answering the VLM's question: "yes" when its most probable class is the requested digit
    (on each half of a digit-pairs image), p(yes) the product of the requested digits' probabilities (scikit-learn's
    sigmoid-calibrated SVC probabilities; trained on the `judge` half of the digits, as the digits judge)."""

    def __init__(self, path: str | None = None) -> None:
        from sklearn.calibration import CalibratedClassifierCV
        from sklearn.svm import SVC

        from framework.evaluation.metrics import training_half

        _no_path("digits_vlm", path)
        x_tr, y_tr = training_half("judge")
        self.clf = CalibratedClassifierCV(SVC(gamma=0.001, C=10.0), ensemble=False).fit(
            x_tr.reshape(len(x_tr), -1).astype(np.float64), y_tr)

    def read(self, images: torch.Tensor, digits: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(most probable class is the digit, probability of the digit) per image."""
        proba = self.clf.predict_proba(to_digit_features(images))
        idx = np.arange(len(digits))
        return proba.argmax(1) == np.asarray(digits), proba[idx, list(digits)]

    def answers(self, images: torch.Tensor, prompts: Sequence[str]) -> Answers:
        from data_prep.sources.digit_pairs import parse_pair

        pairs = [parse_pair(p) for p in prompts]
        if all(lr is not None for lr in pairs):
            left, right = images.chunk(2, dim=-1)
            (ok_l, p_l), (ok_r, p_r) = self.read(left, [a for a, _ in pairs]), self.read(right, [b for _, b in pairs])
            yes, p = ok_l & ok_r, p_l * p_r
        else:
            yes, p = self.read(images, requested_digits(prompts, "digits_vlm"))
        p = np.clip(p, 1e-12, 1 - 1e-12)
        return Answers(yes, np.log(p), np.log1p(-p))
