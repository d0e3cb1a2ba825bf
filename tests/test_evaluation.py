"""The evaluation (classifier, Fréchet distance, held-out prompts), the digit-pairs source and best-of-N picking."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from data_prep.sources.digit_pairs import HELDOUT_PAIRS, TRAIN_PAIRS, pair_captions, parse_pair
from data_prep.sources.digits import MAX_VALUE, digit_captions, heldout_digit_captions, load_digits
from framework.inference.sampling import SamplingPlan
from framework.inference.bestof import knockout, pick_by_score, select
from framework.evaluation.judge import Answers, Judge, answer_prefers, get_judge
from framework.evaluation.metrics import digit_scorer, frechet_distance, real_digit_images, training_half
from tests.helpers import make_tiny_clip, make_tiny_vlm, reference_frechet

# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


def test_fd_separates_real_digits_from_noise_and_matches_the_formula():
    scorer = digit_scorer()
    assert scorer.heldout_accuracy >= 0.95
    feats = scorer.featurizer()
    train, _ = real_digit_images("train")
    held, _ = real_digit_images("heldout")
    noise = torch.rand(len(held), 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1
    blurred = torch.nn.functional.avg_pool2d(held, 3, stride=1, padding=1, count_include_pad=False)

    real_fd = frechet_distance(train, held, feats)
    blur_fd = frechet_distance(train, blurred, feats)
    noise_fd = frechet_distance(train, noise, feats)
    assert frechet_distance(held, held, feats) < 1e-3 * real_fd + 1e-6  # identical sets: ~0
    assert real_fd * 3 < blur_fd < noise_fd and noise_fd > 20 * real_fd
    ref = reference_frechet(feats(train).double().numpy(), feats(held).double().numpy())
    assert real_fd == pytest.approx(ref, rel=1e-3)


def test_scorer_and_judge_train_on_disjoint_halves_and_the_scorer_is_cached():
    xs, ys = training_half("scorer")
    xj, yj = training_half("judge")
    x, _ = load_digits("train")
    as_set = lambda imgs: {im.tobytes() for im in imgs}
    assert len(xs) + len(xj) == len(x) and abs(len(xs) - len(xj)) <= 1
    assert sorted(as_set(xs) | as_set(xj)) == sorted(as_set(x))
    # Duplicated images aside, no image of one half is in the other.
    assert len(as_set(xs) & as_set(xj)) <= 2
    assert set(np.unique(ys)) == set(np.unique(yj)) == set(range(10))

    from data_prep.location import cache_dir
    from framework.evaluation.metrics import DigitScorer

    first = digit_scorer()
    assert len(list(cache_dir().glob("digit_scorer_v*.pt"))) == 1
    again = DigitScorer()  # loads the cached weights
    held, _ = real_digit_images("heldout")
    assert np.array_equal(first.predict(held), again.predict(held))
    assert get_judge("digits").heldout_accuracy >= 0.95


def test_the_scorer_trains_to_the_same_weights_whatever_the_thread_count():
    """The cached scorer is whichever process trained it first; its weights must not depend on that process's thread
    count, or one set of images has two fds (the evaluation's processes and a test's reference disagreed in fd's 8th
    digit). Fewer steps than the scorer's 400, from a caller on 2 threads and on 1; the caller's count is restored."""
    from framework.evaluation.metrics import train_digit_net

    xs, ys = training_half("scorer")
    threads = torch.get_num_threads()
    weights = []
    try:
        for n in (2, 1):
            torch.set_num_threads(n)
            weights.append([p.clone() for p in train_digit_net(xs, ys, steps=8).parameters()])
            assert torch.get_num_threads() == n
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*weights))


def test_held_out_phrasings_never_appear_in_training_captions():
    from data_prep.config import SourceConfig
    from data_prep.sources import get_source
    from framework.evaluation.judge import prompt_digit

    captions = {c for r in get_source(SourceConfig(name="digits", rows_per_image=5)).records() for c in r.captions}
    held = [c for d in range(10) for c in heldout_digit_captions(d)]
    assert captions == {c for d in range(10) for c in digit_captions(d)}
    assert not captions & set(held)
    assert [prompt_digit(c) for c in held] == [d for d in range(10) for _ in heldout_digit_captions(d)]


# --------------------------------------------------------------------------------------------
# Digit pairs
# --------------------------------------------------------------------------------------------


def test_pair_source_round_trips_through_the_shards(pairs_shards, tmp_path):
    from streaming import StreamingDataset

    images, labels = load_digits("train")
    pool = {d: {im.tobytes() for im in images[labels == d]} for d in range(10)}
    out = pairs_shards
    info = json.loads((Path(out) / "dataset.json").read_text())
    assert info["latent_size"] == [8, 16] and info["num_images"] == 2 * len(TRAIN_PAIRS) == 180

    seen = set()
    from framework.data.shards import open_streaming

    rows = open_streaming(lambda: StreamingDataset(remote=str(out), local=str(tmp_path / "cache"), shuffle=False,
                                                   batch_size=1))  # as the data module opens its datasets
    for row in rows:
        a, b = divmod(int(row["label"]), 10)
        pixels = np.round((row["latents"].astype(np.float32)[0] + 1) * 127.5)  # pixel codec: [-1, 1]
        digits = np.round(pixels * MAX_VALUE / 255).astype(np.uint8)  # back to 0..16
        assert digits[:, :8].tobytes() in pool[a] and digits[:, 8:].tobytes() in pool[b]
        assert parse_pair(row["caption"]) == (a, b) and row["caption"] in pair_captions(a, b)
        seen.add((a, b))
    assert seen == set(TRAIN_PAIRS) and not seen & set(HELDOUT_PAIRS)
    # Each held-out pair's digits still appear on both sides in training.
    for a, b in HELDOUT_PAIRS:
        assert any(p[0] == a for p in seen) and any(p[1] == b for p in seen)
    # Every phrasing says which digit is where, unambiguously.
    assert all(parse_pair(c) == (a, b) for a in range(10) for b in range(10) for c in pair_captions(a, b))
    assert parse_pair("a 3 next to a 7") is None


def test_pair_metrics_score_real_pairs_high_and_swapped_pairs_low():
    from framework.evaluation.scoring import real_reference, score_images
    from framework.evaluation.prompts import prompt_set

    ps = prompt_set("pairs", seeds=1, phrasings=1)
    ref = real_reference("pairs")  # 4 real held-out pairs per ordered pair, in (a, b) order
    real = ref[::4]
    metrics = score_images(ps, real)
    assert metrics["pair_accuracy"] >= 0.85 and metrics["heldout_pair_accuracy"] >= 0.7
    assert metrics["fd"] < 5
    swapped = torch.cat(real.chunk(2, dim=-1)[::-1], dim=-1)  # right digit on the left
    bad = score_images(ps, swapped)
    same = np.array([a == b for a, b in ps.targets])
    assert bad["pair_accuracy"] <= same[~ps.heldout].mean() + 0.05


# --------------------------------------------------------------------------------------------
# Best-of-N
# --------------------------------------------------------------------------------------------


class Oracle(Judge):
    """Knows each candidate's true quality (its pixel value); counts how it is asked."""

    name = "oracle"

    def __init__(self) -> None:
        self.calls = 0

    def score(self, images, prompts):
        self.calls += 1
        return images.flatten(1).mean(1).numpy()


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13])
def test_tournament_with_an_oracle_judge_returns_the_best_candidate(n):
    rng = np.random.default_rng(n)
    quality = np.stack([rng.permutation(n) for _ in range(6)]).astype(np.float32)  # (P, N)
    cands = torch.from_numpy(quality)[:, :, None, None, None].expand(6, n, 1, 2, 2).clone()
    prompts = [f"p{i}" for i in range(6)]
    judge = Oracle()
    best = select(cands, prompts, judge, "tournament", 1)
    assert torch.equal(best[:, 0, 0, 0, 0], torch.from_numpy(quality.max(1)))
    assert judge.calls == 2 * int(np.ceil(np.log2(n)))  # one batched comparison per round (two scores each)
    by_score = select(cands, prompts, Oracle(), "score", 1)
    assert torch.equal(by_score, best)
    if n >= 3:
        two = select(cands, prompts, Oracle(), "tournament", 2)[:, :, 0, 0, 0].numpy()
        assert two.shape == (6, 2) and (two.max(1) == quality.max(1)).all()
        top = select(cands, prompts, Oracle(), "score", 2)[:, :, 0, 0, 0].numpy()
        assert (top == -np.sort(-quality, axis=1)[:, :2]).all()


def test_knockout_brackets_by_hand():
    # 5 candidates, pick 2: round 1 plays (0,1) and (2,3) -> 3 left (winners + the bye), then (w01, w23).
    calls = []

    def prefers(a, b):
        calls.append((a.tolist(), b.tolist()))
        return a > b  # the larger index wins

    assert knockout(1, 5, prefers, 2).tolist() == [[3, 4]]
    assert calls == [([[0, 2]], [[1, 3]]), ([[1]], [[3]])]
    assert pick_by_score(np.array([[0.1, 0.9, 0.5, 0.9]]), 2).tolist() == [[1, 3]]


def test_the_yes_no_rule_is_sana_15s_by_hand():
    # Pairs: yes/no, no/yes, yes/yes (a surer), yes/yes (b surer), no/no (a less sure "no"), no/no (b), a tie.
    a = Answers(np.array([1, 0, 1, 1, 0, 0, 1], bool), np.log([.6, .1, .9, .6, .2, .1, .7]),
                np.log([.3, .8, .05, .3, .5, .9, .2]))
    b = Answers(np.array([0, 1, 1, 1, 0, 0, 1], bool), np.log([.4, .5, .8, .7, .3, .4, .7]),
                np.log([.5, .4, .1, .2, .6, .5, .2]))
    assert answer_prefers(a, b).tolist() == [True, False, True, False, True, False, True]
    # The "yes" wins even when the "no" holds the higher p(yes) (another token was its most likely answer).
    assert answer_prefers(Answers(np.array([True]), np.log([.3]), np.log([.2])),
                          Answers(np.array([False]), np.log([.45]), np.log([.1]))).tolist() == [True]


def reference_answers(path: Path, images: torch.Tensor, prompts: list[str]) -> list[tuple[bool, float, float]]:
    """Each (image, prompt) alone through transformers' own greedy generate: (answer is yes, log p(yes), log p(no))."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from framework.evaluation.judge import QUESTION

    proc, model = AutoProcessor.from_pretrained(path), AutoModelForImageTextToText.from_pretrained(path).eval()
    yes, no = proc.tokenizer.convert_tokens_to_ids(["yes", "no"])
    out = []
    for img, prompt in zip(images, prompts):
        pixels = ((img + 1) * 127.5).round().to(torch.uint8).repeat(3, 1, 1).permute(1, 2, 0).numpy()
        turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION.format(prompt=prompt)}]}]
        text = proc.apply_chat_template(turn, add_generation_prompt=True)
        inputs = proc(images=[Image.fromarray(pixels)], text=[text], return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(**inputs, max_new_tokens=1, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
        logp = torch.log_softmax(gen.scores[0][0].float(), -1)
        out.append((proc.tokenizer.decode(gen.sequences[0, -1]) == "yes", float(logp[yes]), float(logp[no])))
    return out


def test_vlm_judge_reads_a_local_vlm_and_its_tournament_follows_the_rule_by_hand(tmp_path, monkeypatch):
    from framework.evaluation.judge import VLMJudge

    prompts, n = ["a handwritten 3", "the digit seven", "a 7 to the right of a 1"], 5
    path = make_tiny_vlm(tmp_path / "vlm", prompts)
    cands = torch.rand(3, n, 1, 8, 8, generator=torch.Generator().manual_seed(3)) * 2 - 1
    cands = ((cands + 1) * 127.5).round() / 127.5 - 1  # on the uint8 grid, as the judge sees them
    ref = reference_answers(path, cands.flatten(0, 1), [q for q in prompts for _ in range(n)])
    yes, no = (np.array([f(a, b) for _, a, b in ref]) for f in (lambda a, b: a > b, lambda a, b: b > a))
    answered = np.array([y for y, _, _ in ref])
    assert answered.any() and (~answered & no).any() and (~answered & yes).any()  # yes, no, and neither occur

    judge = get_judge("vlm", str(path))
    asked = []
    monkeypatch.setattr(VLMJudge, "ask", lambda self, px, q, ask=VLMJudge.ask: asked.append(len(px)) or ask(self, px, q))
    got = judge.answers(cands.flatten(0, 1), [q for q in prompts for _ in range(n)])
    assert got.yes.tolist() == [y for y, _, _ in ref]
    np.testing.assert_allclose(got.logp_yes, [a for _, a, _ in ref], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got.logp_no, [b for _, _, b in ref], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(judge.score(cands[0], [prompts[0]] * n), got.logp_yes[:n])

    def hand_wins(i, j, k):  # the paper's rule on the reference answers of candidates j and k of prompt i
        (ya, pya, pna), (yb, pyb, pnb) = ref[i * n + j], ref[i * n + k]
        if ya != yb:
            return ya
        return pya >= pyb if ya else pna <= pnb

    for i in range(3):  # the bracket of 5: (0,1), (2,3), 4 waits; then the two winners; then the bye
        w01 = 0 if hand_wins(i, 0, 1) else 1
        w23 = 2 if hand_wins(i, 2, 3) else 3
        w = w01 if hand_wins(i, w01, w23) else w23
        best = w if hand_wins(i, w, 4) else 4
        fresh = VLMJudge(str(path))
        asked.clear()
        kept = select(cands[i : i + 1], prompts[i : i + 1], fresh, "tournament", 1)
        assert torch.equal(kept[0, 0], cands[i, best])
        assert sum(asked) == n  # every candidate asked once: winners are not asked again

    with pytest.raises(ValueError, match="judge=vlm needs judge_path"):
        get_judge("vlm", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="does not load as a transformers image-text-to-text model"):
        get_judge("vlm", str(make_tiny_clip(tmp_path / "clip")))


def test_digit_vlm_judge_answers_as_the_classifier_reads():
    held, labels = real_digit_images("heldout")
    judge = get_judge("digits_vlm")
    right = judge.answers(held[:60], [f"a handwritten {d}" for d in labels[:60]])
    wrong = judge.answers(held[:60], [f"a handwritten {(d + 1) % 10}" for d in labels[:60]])
    assert right.yes.mean() >= 0.9 and wrong.yes.mean() <= 0.1
    assert (right.logp_yes > wrong.logp_yes).mean() >= 0.9
    np.testing.assert_allclose(np.exp(right.logp_yes) + np.exp(right.logp_no), 1.0, rtol=1e-9)
    pair = torch.cat([held[:30], held[30:60]], dim=-1)
    caps = [pair_captions(int(a), int(b))[1] for a, b in zip(labels[:30], labels[30:60])]
    both = judge.answers(pair, caps)
    left, right_half = (judge.answers(h, [f"a {d}" for d in ds]) for h, ds in
                        ((held[:30], labels[:30]), (held[30:60], labels[30:60])))
    assert both.yes.tolist() == (left.yes & right_half.yes).tolist()  # yes only when both halves read right
    np.testing.assert_allclose(both.logp_yes, left.logp_yes + right_half.logp_yes, rtol=1e-9)


def tiny_pipeline(digits_shards: Path, sample_width: int | None = None):
    from framework.models.backbones import ModelConfig, build_denoiser
    from framework.models.objectives import Objective, ObjectiveConfig
    from framework.inference.pipeline import Pipeline

    from framework.data.datamodule import read_dataset_info

    info = read_dataset_info(str(digits_shards))
    torch.manual_seed(0)
    model = build_denoiser(ModelConfig(in_channels=1, sample_size=8, sample_width=sample_width, text_dim=384,
                                       num_layers=2, num_heads=2, head_dim=16, learned_sigma=False))
    return Pipeline(model.eval(), Objective(ObjectiveConfig()), info.empty_text_embeds, info.summary())


def test_best_of_one_is_plain_sampling_and_candidates_do_not_depend_on_n(digits_shards):
    pipe = tiny_pipeline(digits_shards)
    prompts = ["a handwritten 3", "the digit seven", "a scribbled 5"]
    plain = pipe.generate(prompts, SamplingPlan(steps=3, seed=7))
    one = pipe.generate(prompts, SamplingPlan(steps=3, seed=7, candidates=1))
    kept = select(one.view(3, 1, *one.shape[1:]), prompts, None, "score", 1).flatten(0, 1)
    assert torch.equal(kept, plain)  # bit for bit

    # Candidate j of prompt i is the same draw whatever N is (one image per forward: no batch effects).
    four = pipe.generate(prompts, SamplingPlan(steps=3, seed=7, candidates=4), batch_size=1).view(3, 4, 1, 8, 8)
    two = pipe.generate(prompts, SamplingPlan(steps=3, seed=7, candidates=2), batch_size=1).view(3, 2, 1, 8, 8)
    single = pipe.generate(prompts, SamplingPlan(steps=3, seed=7), batch_size=1)
    assert torch.equal(four[:, :2], two) and torch.equal(four[:, 0], single)
    assert not torch.equal(four[:, 0], four[:, 1])

    wide = tiny_pipeline(digits_shards, sample_width=16).generate(prompts[:1], SamplingPlan(steps=2))
    assert wide.shape == (1, 1, 8, 16)


def test_digit_judges_prefer_the_requested_digit():
    held, labels = real_digit_images("heldout")
    digits = get_judge("digits")
    right = digits.score(held[:50], [f"a handwritten {d}" for d in labels[:50]])
    wrong = digits.score(held[:50], [f"a handwritten {(d + 1) % 10}" for d in labels[:50]])
    assert (right > 0).mean() >= 0.9 and (wrong < 0).mean() >= 0.9
    pair = torch.cat([held[:20], held[20:40]], dim=-1)
    caps = [pair_captions(int(a), int(b))[1] for a, b in zip(labels[:20], labels[20:40])]
    assert (get_judge("pairs").score(pair, caps) > 0).mean() >= 0.85
    with pytest.raises(ValueError, match="judge=pairs cannot read"):
        get_judge("pairs").score(pair[:1], ["two digits"])
    with pytest.raises(ValueError, match="judge=clip needs judge_path"):
        get_judge("clip")
    with pytest.raises(ValueError, match="judge='nope' is unknown"):
        get_judge("nope")


def test_clip_judge_scores_each_image_against_its_own_prompt(tmp_path):
    from transformers import CLIPModel, CLIPProcessor

    path = make_tiny_clip(tmp_path / "clip")
    images = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1
    prompts = ["a handwritten 3", "a 7 to the right of a 1", "nine"]
    scores = get_judge("clip", str(path)).score(images, prompts)

    model, proc = CLIPModel.from_pretrained(path).eval(), CLIPProcessor.from_pretrained(path)
    pixels = ((images + 1) * 127.5).round().to(torch.uint8).repeat(1, 3, 1, 1)
    with torch.no_grad():
        img = model.get_image_features(**proc(images=list(pixels), return_tensors="pt"))
        txt = model.get_text_features(**proc(text=prompts, return_tensors="pt", padding=True))
    ref = 100 * torch.nn.functional.cosine_similarity(img, txt, dim=-1)
    assert scores.shape == (3,) and np.allclose(scores, ref.numpy(), atol=1e-3)


def test_eval_settings_reach_the_generation():
    """eval.guidance, eval.sampler, eval.cache_schedule, eval.batch_size and the size keys (eval.height / width /
    aspect / num_frames) reach the plan and the generate call; the pipeline is a recorder here."""
    from types import SimpleNamespace

    from framework.evaluation.prompts import PromptSet
    from framework.evaluation.scoring import generate_candidates
    from framework.evaluation.settings import EvalSettings

    class Recorder:
        model = SimpleNamespace(cfg=SimpleNamespace(num_classes=None))

        def __init__(self) -> None:
            self.calls = []

        def latent_size(self, height, width, aspect, num_frames):
            self.calls.append(("size", height, width, aspect, num_frames))
            return (4, 6)

        def generate(self, prompts, plan, labels, ranks=None, batch_size=64, progress=False):
            self.calls.append(("generate", plan.guidance, plan.sampler, plan.cache_schedule, plan.size, plan.candidates,
                               batch_size))
            return torch.zeros(len(prompts) * plan.candidates, 3, 4, 6)

    pipe = Recorder()
    ps = PromptSet("digits", ["a", "b"], [0, 1], np.zeros(2, dtype=bool), None)
    settings = EvalSettings(guidance=2.5, sampler="ddim", batch_size=3, height=32, width=48, aspect="3:2",
                            num_frames=9, cache_schedule="uniform:2")
    images, _ = generate_candidates(pipe, ps, settings, 2)
    assert images.shape == (2, 2, 3, 4, 6)
    assert pipe.calls == [("size", 32, 48, "3:2", 9), ("generate", 2.5, "ddim", "uniform:2", (4, 6), 2, 3)]


def test_eval_pick_judge_and_judge_path_reach_the_selection(monkeypatch):
    """eval.pick images per prompt are kept (the judge's best) and scored; eval.judge / eval.judge_path name the
    judge that is loaded. Generation and scoring are recorders here: only the choice between them is run."""
    from types import SimpleNamespace

    import framework.evaluation.evaluate as evaluate_mod
    import framework.evaluation.judge as judge_mod
    from framework.evaluation.settings import EvalSettings

    seen = {}

    def candidates(pipe, ps, settings, n, ranks=None, progress=False):
        value = torch.arange(n, dtype=torch.float32).view(1, n, 1, 1, 1) / n  # candidate j has quality j / n
        return value.expand(len(ps.prompts), n, 1, 8, 8).clone(), 1.0

    def judge(name, path):
        seen["judge"] = (name, path)
        return Oracle()

    def score(ps, kept, pick):
        seen["kept"], seen["pick"] = kept, pick
        return {}

    monkeypatch.setattr(evaluate_mod, "generate_candidates", candidates)
    monkeypatch.setattr(evaluate_mod, "score_images", score)
    monkeypatch.setattr(judge_mod, "get_judge", judge)
    pipe = SimpleNamespace(info={"source": {"name": "digits"}, "num_classes": 10})
    settings = EvalSettings(seeds=1, phrasings=1, best_of=3, pick=2, judge="pairs", judge_path="/judges/p.pt")
    evaluate_mod.evaluate(pipe, settings, None)
    assert seen["judge"] == ("pairs", "/judges/p.pt") and seen["pick"] == 2
    kept = seen["kept"][:, 0, 0, 0].view(-1, 2)  # (P, pick): the two best candidates of each prompt, best first
    assert kept.shape[0] > 0 and (kept == torch.tensor([2 / 3, 1 / 3])).all()
