"""The digits world's CLIP: a caption tokenizer built from the caption vocabulary and a small ``CLIPModel``.

Both are the standard transformers objects, so the trained model is saved with ``save_pretrained``
and loaded with ``CLIPModel`` / ``CLIPTextModel`` / ``CLIPTokenizer.from_pretrained`` like any hub CLIP;
its text tower is the frozen text encoder of the digits teacher, as CLIP's is in Stable Diffusion.

Pixel input: ``pixel_values`` (N, 1, 32, 32) in [-1, 1], i.e. the data module's images as they are.
``build_image_processor`` gives the ``CLIPImageProcessor`` that maps 8-bit grey images to exactly
that range (rescale by 1/255, then mean 0.5 and std 0.5).
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

from tokenizers import pre_tokenizers
from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

from distill.students import STUDENTS
from distill.worlds.digits.data import DIGIT_WORDS

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
END_OF_WORD = "</w>"

# Caption templates per digit; ``{word}`` is "seven", ``{numeral}`` is "7". The first is the teacher's
# caption (``distill.worlds.digits.data.caption_for``).
CAPTION_TEMPLATES: tuple[str, ...] = (
    "a handwritten digit {word}",
    "the number {word}",
    "a drawing of the digit {numeral}",
    "{numeral}",
    "the digit {word}",
    "a handwritten {numeral}",
    "an image of the number {word}",
    "a picture of a {word}",
    "{word}",
    "a written number {numeral}",
)


def fill_template(template: str, label: int) -> str:
    return template.format(word=DIGIT_WORDS[label], numeral=str(label))


def caption_words(templates: tuple[str, ...] = CAPTION_TEMPLATES) -> Counter:
    """Word frequencies over every template filled with every digit (the tokenizer's corpus)."""
    return Counter(word for t in templates for label in range(10) for word in fill_template(t, label).split())


def learn_merges(words: Counter) -> list[tuple[str, str]]:
    """Byte-pair merges (Sennrich et al. 2016) learned until every word of ``words`` is one symbol.

    Symbols follow CLIP: a word's last character carries ``</w>``. Ties between equally frequent
    pairs go to the lexicographically smallest, so the vocabulary is the same on every machine.
    """
    split = {tuple(w[:-1]) + (w[-1] + END_OF_WORD,): n for w, n in words.items()}
    merges = []
    while any(len(symbols) > 1 for symbols in split):
        pairs = Counter()
        for symbols, n in split.items():
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += n
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        split = {_merge(symbols, best): n for symbols, n in split.items()}
    return merges


def _merge(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(symbols):
        if symbols[i:i + 2] == pair:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)


def tokenizer_vocab(merges: list[tuple[str, str]]) -> dict[str, int]:
    """CLIP's layout: 256 byte symbols, the same with ``</w>``, one token per merge, then the specials.

    The byte symbols keep any text encodable (unknown words fall back to bytes).
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + [c + END_OF_WORD for c in alphabet] + [a + b for a, b in merges] + [BOS, EOS]
    return {token: i for i, token in enumerate(tokens)}


def build_tokenizer(model_max_length: int = 16) -> CLIPTokenizer:
    """A ``CLIPTokenizer`` whose BPE makes every caption word one token; pad is ``<|endoftext|>`` as in SD.

    The vocabulary is written as CLIP's vocab.json + merges.txt and read through the standard
    ``CLIPTokenizer(vocab_file, merges_file)``, which works the same in transformers 4 and 5.
    """
    merges = learn_merges(caption_words())
    with tempfile.TemporaryDirectory() as tmp:
        vocab_file, merges_file = Path(tmp) / "vocab.json", Path(tmp) / "merges.txt"
        write_vocab_files(tokenizer_vocab(merges), merges, Path(tmp))
        return CLIPTokenizer(str(vocab_file), str(merges_file), model_max_length=model_max_length, pad_token=EOS)


def write_vocab_files(vocab: dict[str, int], merges: list[tuple[str, str]], out_dir: Path) -> None:
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    lines = "".join(f"{a} {b}\n" for a, b in merges)
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + lines, encoding="utf-8")


def save_clip(model: CLIPModel, tokenizer: CLIPTokenizer, out_dir: str | Path) -> Path:
    """One folder that ``CLIPModel``, ``CLIPTextModel``, ``CLIPTokenizer`` and ``CLIPImageProcessor`` load.

    transformers 5 saves the tokenizer as tokenizer.json only; vocab.json + merges.txt are added so
    that the slow tokenizer of transformers 4 (and Stable Diffusion's tokenizer layout) load it too.
    """
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    bpe = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    # tokenizers < 0.20 stores a merge as "a b", newer versions as ["a", "b"]
    merges = [tuple(m.split(" ") if isinstance(m, str) else m) for m in bpe["merges"]]
    write_vocab_files(bpe["vocab"], merges, out_dir)
    build_image_processor(model.config.vision_config.image_size).save_pretrained(out_dir)
    return out_dir


def build_image_processor(image_size: int = 32):
    """A ``CLIPImageProcessor``: grey 8-bit images -> (N, 1, S, S) in [-1, 1], the vision tower's range."""
    # Imported here: without torchvision, transformers 5 warns when the class is first looked up.
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(
        do_resize=True, size={"shortest_edge": image_size}, resample=2,  # bilinear, as the data module upscales
        do_center_crop=True, crop_size={"height": image_size, "width": image_size},
        image_mean=[0.5], image_std=[0.5], do_convert_rgb=False,
    )


def build_clip(
    model_max_length: int = 16,
    projection_dim: int = 64,
    text_hidden_size: int = 64,
    text_layers: int = 3,
    text_heads: int = 4,
    image_size: int = 32,
    patch_size: int = 8,
    num_channels: int = 1,
    vision_hidden_size: int = 64,
    vision_layers: int = 3,
    vision_heads: int = 4,
    mlp_ratio: int = 4,
) -> tuple[CLIPModel, CLIPTokenizer]:
    """A randomly initialised ``CLIPModel`` sized for the digits, and the tokenizer its embeddings index."""
    tokenizer = build_tokenizer(model_max_length)
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(tokenizer), max_position_embeddings=model_max_length, hidden_size=text_hidden_size,
            intermediate_size=mlp_ratio * text_hidden_size, num_hidden_layers=text_layers,
            num_attention_heads=text_heads, projection_dim=projection_dim,
            # The pooled text state is taken at the first <|endoftext|> (pad is the same token).
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            image_size=image_size, patch_size=patch_size, num_channels=num_channels,
            hidden_size=vision_hidden_size, intermediate_size=mlp_ratio * vision_hidden_size,
            num_hidden_layers=vision_layers, num_attention_heads=vision_heads, projection_dim=projection_dim,
        ),
        projection_dim=projection_dim,
    )
    return CLIPModel(config), tokenizer


@STUDENTS.register("clip", kwargs_of=build_clip)
def build_clip_model(gradient_checkpointing: bool = False, **sizes) -> CLIPModel:
    """The ``student`` group's entry: the network alone (the method builds the matching tokenizer).

    ``gradient_checkpointing`` recomputes each encoder layer in the backward pass (non-reentrant); transformers
    skips it in eval mode and without gradients, so validation is unaffected."""
    model = build_clip(**sizes)[0]
    if gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # newer transformers, where the old name is deprecated
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model
