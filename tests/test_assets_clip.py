"""The digits CLIP: its tokenizer, its training command, the shipped asset and the CLIP score."""

import csv

import pytest
import torch
import torch.nn.functional as F
from transformers import CLIPModel, CLIPTextModel, CLIPTokenizer

from distill.metrics.clip_score import clip_score
from distill.worlds.digits import asset_path
from distill.worlds.digits.clip import (
    CAPTION_TEMPLATES,
    build_tokenizer,
    caption_words,
    fill_template,
)
from distill.worlds.digits.data import DIGIT_WORDS, caption_for, load_digit_images, split_indices
from distill.worlds.digits.metrics import clip_zeroshot_accuracy
from distill.worlds.digits.trainers.clip import contrastive_loss, positive_pairs
from tests.conftest import run_train


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(model_max_length=16)


@pytest.fixture(scope="module")
def heldout():
    """The 360 held-out digits at 32x32 (the data module's fixed split)."""
    images, labels = load_digit_images(32)
    _, idx = split_indices(labels, 0.2, 0)
    return images[idx], labels[idx]


@pytest.fixture(scope="module")
def shipped():
    path = asset_path("clip")
    return CLIPModel.from_pretrained(path).eval(), CLIPTokenizer.from_pretrained(path)


# ---------------------------------------------------------------- tokenizer


def test_every_caption_word_is_one_token(tokenizer):
    words = caption_words()
    assert {"handwritten", "digit", "seven", "7", "number"} <= set(words)
    for word in words:
        assert len(tokenizer(word, add_special_tokens=False).input_ids) == 1, word
    # CLIP's layout: 2 x 256 byte symbols, one token per merge, <|startoftext|>, <|endoftext|> last.
    assert tokenizer.convert_ids_to_tokens([len(tokenizer) - 2, len(tokenizer) - 1]) == ["<|startoftext|>", "<|endoftext|>"]
    assert tokenizer.pad_token == tokenizer.eos_token == "<|endoftext|>"


def test_captions_round_trip(tokenizer):
    captions = [fill_template(t, label) for t in CAPTION_TEMPLATES for label in range(10)]
    batch = tokenizer(captions, padding="max_length", truncation=True, return_tensors="pt")
    assert batch.input_ids.shape == (len(captions), 16)
    assert tokenizer.batch_decode(batch.input_ids, skip_special_tokens=True) == captions
    ids = tokenizer(caption_for(7)).input_ids
    assert tokenizer.convert_ids_to_tokens(ids) == ["<|startoftext|>", "a</w>", "handwritten</w>", "digit</w>", "seven</w>", "<|endoftext|>"]


def test_unknown_words_fall_back_to_bytes(tokenizer):
    ids = tokenizer("zebra café", add_special_tokens=False).input_ids
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert tokenizer.unk_token_id not in ids and len(ids) > 2
    assert tokens[-2:] == ["Ã", "©</w>"]  # é is two UTF-8 bytes, each a byte-level symbol
    assert tokenizer.decode(ids) == "zebra café"


def test_tokenizer_save_load_round_trip(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = CLIPTokenizer.from_pretrained(tmp_path)
    assert loaded.model_max_length == 16 and len(loaded) == len(tokenizer)
    text = ["a handwritten digit three", "a zebra"]
    assert loaded(text).input_ids == tokenizer(text).input_ids


# ---------------------------------------------------------------- contrastive loss


def test_contrastive_loss_targets_all_positives():
    labels = torch.tensor([3, 3, 5])
    positives = positive_pairs(labels, ["the number three", "3", "five"])
    assert positives.tolist() == [[True, True, False], [True, True, False], [False, False, True]]
    emb = F.normalize(torch.randn(3, 8), dim=-1)
    logits = 10.0 * emb @ emb.T
    targets = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    expected = -(targets * logits.log_softmax(1)).sum(1).mean()  # symmetric logits: both directions agree
    torch.testing.assert_close(contrastive_loss(emb, emb, torch.tensor(10.0), positives), expected)


# ---------------------------------------------------------------- training command


def test_training_command_lowers_loss_and_exports(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(
        "+exp=asset_clip", "trainer.max_steps=60", "trainer.val_check_interval=30", "trainer.log_every_n_steps=10",
        "checkpoint.every_n_train_steps=60", "callbacks.progress=null", f"hydra.run.dir={run_dir}",
        # A 0.35M-parameter model gains nothing from a second thread, and one keeps it fast on a shared machine.
        env={"OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(run_dir / "csv" / "metrics.csv")))
    train = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(train) == 6 and train[-1] < train[0] - 0.5, train
    accuracy = [float(r["val/zeroshot_acc"]) for r in rows if r.get("val/zeroshot_acc")]
    assert len(accuracy) == 2 and accuracy[-1] > 0.3, accuracy  # chance is 0.1

    export = run_dir / "export"
    model, tokenizer = CLIPModel.from_pretrained(export), CLIPTokenizer.from_pretrained(export)
    text_encoder = CLIPTextModel.from_pretrained(export)
    tokens = tokenizer([caption_for(4)], padding="max_length", return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(text_encoder(**tokens).last_hidden_state, model.text_model(**tokens).last_hidden_state)
    # vocab.json + merges.txt give the same tokenizer through the plain constructor (transformers 4 and 5).
    plain = CLIPTokenizer(str(export / "vocab.json"), str(export / "merges.txt"))
    assert plain("a handwritten digit four zebra").input_ids == tokenizer("a handwritten digit four zebra").input_ids


# ---------------------------------------------------------------- shipped asset and CLIP score


def test_shipped_asset_zero_shot_accuracy(shipped, heldout):
    model, tokenizer = shipped
    assert model.config.text_config.max_position_embeddings == tokenizer.model_max_length == 16
    assert CLIPTextModel.from_pretrained(asset_path("clip")).config.hidden_size == model.config.text_config.hidden_size
    images, labels = heldout
    assert len(labels) == 360
    assert clip_zeroshot_accuracy(model, tokenizer, images, labels) >= 0.90


def test_shipped_asset_image_processor_matches_data_range(heldout):
    from PIL import Image
    from transformers import CLIPImageProcessor

    processor = CLIPImageProcessor.from_pretrained(asset_path("clip"))
    grey = Image.fromarray((torch.linspace(0, 255, 32 * 32).reshape(32, 32)).round().to(torch.uint8).numpy(), mode="L")
    pixels = processor(images=[grey], return_tensors="pt").pixel_values
    assert pixels.shape == (1, 1, 32, 32)
    assert pixels.min().item() == pytest.approx(-1.0) and pixels.max().item() == pytest.approx(1.0)


def test_clip_score_prefers_matching_captions(shipped, heldout):
    model, tokenizer = shipped
    images, labels = heldout
    matching = clip_score(model, tokenizer, images, [caption_for(int(y)) for y in labels])
    mismatched = clip_score(model, tokenizer, images, [caption_for((int(y) + 1) % 10) for y in labels])
    assert matching.shape == (360,) and (matching >= 0).all() and (matching <= 100).all()
    assert matching.mean() > mismatched.mean() + 20.0
    assert (matching > mismatched).float().mean() > 0.9


def test_clip_score_is_clipped_cosine(shipped, heldout):
    model, tokenizer = shipped
    images = heldout[0][:12]
    captions = [f"the number {DIGIT_WORDS[i % 10]}" for i in range(12)]
    with torch.no_grad():
        image_embeds = model.visual_projection(model.vision_model(pixel_values=images).pooler_output)
        tokens = tokenizer(captions, padding="max_length", return_tensors="pt")
        text_embeds = model.text_projection(model.text_model(**tokens).pooler_output)
    cos = F.cosine_similarity(image_embeds, text_embeds, dim=-1)
    torch.testing.assert_close(clip_score(model, tokenizer, images, captions), 100 * cos.clamp(min=0), atol=1e-4, rtol=1e-4)
    # A 16x16 generator is scored after bilinear upscaling to the model's 32x32.
    small = F.interpolate(images, size=(16, 16), mode="bilinear", align_corners=False)
    upscaled = F.interpolate(small, size=(32, 32), mode="bilinear", align_corners=False)
    torch.testing.assert_close(clip_score(model, tokenizer, small, captions), clip_score(model, tokenizer, upscaled, captions))
