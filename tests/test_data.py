import io
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from distill.data import ImageFolderDataModule, WebDatasetDataModule
from distill.worlds.digits.data import DIGIT_WORDS, DigitsDataModule, caption_for


def test_digits_split_shapes_and_range():
    dm = DigitsDataModule(resolution=16, batch_size=32)
    dm.setup()
    assert len(dm.train_set) + len(dm.heldout_set) == 1797
    assert len(dm.heldout_set) == 360  # round(0.2 * 1797), fixed by the stratified split
    batch = next(iter(dm.train_dataloader()))
    assert batch["pixel_values"].shape == (32, 1, 16, 16)
    assert batch["pixel_values"].min() >= -1.0 and batch["pixel_values"].max() <= 1.0
    assert batch["caption"][0] == f"a handwritten digit {DIGIT_WORDS[int(batch['label'][0])]}"


def test_digits_split_is_fixed_stratified_and_disjoint():
    a, b = DigitsDataModule(), DigitsDataModule()
    a.setup()
    b.setup()
    assert torch.equal(a.heldout_set.images, b.heldout_set.images)
    counts = torch.bincount(a.heldout_set.labels, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37  # ~36 per class
    train = {tuple(x.flatten().tolist()) for x in a.train_set.images[:200]}
    assert not any(tuple(x.flatten().tolist()) in train for x in a.heldout_set.images[:50])


def test_digits_native_resolution_is_the_sklearn_data():
    from sklearn.datasets import load_digits

    dm = DigitsDataModule(resolution=8)
    dm.setup()
    raw = torch.tensor(load_digits().images, dtype=torch.float32)
    # Every held-out image maps back exactly to an sklearn image via x = img / 16 * 2 - 1.
    first = dm.heldout_set.images[0, 0]
    matches = ((raw / 8.0 - 1.0) - first).abs().flatten(1).amax(1) < 1e-6
    assert matches.sum() >= 1


def test_caption_words():
    assert caption_for(7) == "a handwritten digit seven"
    with pytest.raises(ValueError, match="resolution=4"):
        DigitsDataModule(resolution=4)


def _png_bytes(value: int, size=(12, 10), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((size[1], size[0], 3), value, dtype=np.uint8)).convert(mode).save(buf, format="PNG")
    return buf.getvalue()


def test_image_folder_with_captions_and_broken_file(tmp_path):
    for i in range(5):
        (tmp_path / f"img{i}.png").write_bytes(_png_bytes(50 * i))
        if i % 2 == 0:
            (tmp_path / f"img{i}.txt").write_text(f"caption {i}\n")
    (tmp_path / "broken.png").write_bytes(b"not an image")
    dm = ImageFolderDataModule(root=str(tmp_path), resolution=8, channels=3, batch_size=2, heldout_fraction=0.2)
    dm.setup()
    assert dm.num_skipped == 1
    assert len(dm.train_set) == 4 and len(dm.heldout_set) == 1
    items = [dm.train_set[i] for i in range(4)] + [dm.heldout_set[0]]
    by_value = {round(float((it["pixel_values"][0, 0, 0] + 1) * 127.5)): it for it in items}
    assert sorted(by_value) == [0, 50, 100, 150, 200]
    assert by_value[100]["caption"] == "caption 2" and by_value[50]["caption"] == ""
    assert by_value[200]["pixel_values"].shape == (3, 8, 8)

    strict = ImageFolderDataModule(root=str(tmp_path), resolution=8, skip_unreadable=False)
    with pytest.raises(ValueError, match="broken.png"):
        strict.setup()


def test_image_folder_errors_name_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.root"):
        ImageFolderDataModule(root=str(tmp_path / "missing")).setup()
    with pytest.raises(ValueError, match="no readable image"):
        ImageFolderDataModule(root=str(tmp_path)).setup()


def _write_shard(path, start, n):
    with tarfile.open(path, "w") as tar:
        for i in range(start, start + n):
            for ext, data in (("png", _png_bytes(i * 10, mode="L")), ("txt", f"sample {i}".encode()), ("cls", str(i % 3).encode())):
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_webdataset_shards_stream_every_sample(tmp_path):
    _write_shard(tmp_path / "shard-000.tar", 0, 6)
    _write_shard(tmp_path / "shard-001.tar", 6, 6)
    dm = WebDatasetDataModule(urls=str(tmp_path / "shard-{000..001}.tar"), resolution=8, channels=1, batch_size=4, shuffle_buffer=8)
    batches = list(dm.train_dataloader())
    captions = sorted(c for b in batches for c in b["caption"])
    assert captions == sorted(f"sample {i}" for i in range(12))
    assert batches[0]["pixel_values"].shape == (4, 1, 8, 8)
    first = next(iter(dm.val_dataloader()))
    assert first["caption"][0] == "sample 0" and first["label"][:3].tolist() == [0, 1, 2]
    with pytest.raises(FileNotFoundError, match="matches no shard"):
        WebDatasetDataModule(urls=str(tmp_path / "nothing-*.tar"))
