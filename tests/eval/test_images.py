"""Image sets for Vision Mamba: the digits split, ImageFolder directories, top-1 accuracy."""
import pytest
import torch

from quamba.errors import QuambaError
from quamba.eval.images import evaluate_images, load_image_set, normalize
from quamba.models.mamba import randomize_
from quamba.models.vision import VisionMamba, VisionMambaConfig


def test_digits_splits_are_fixed_and_disjoint():
    train, test = load_image_set("digits", "train"), load_image_set("digits", "test")
    assert train.images.shape == (1437, 1, 8, 8) and test.images.shape == (360, 1, 8, 8)
    assert 0 <= float(train.images.min()) and float(train.images.max()) <= 1
    assert torch.equal(load_image_set("digits", "test").images, test.images)
    flat_train = {tuple(row.tolist()) for row in train.images.flatten(1)}
    overlap = sum(tuple(row.tolist()) in flat_train for row in test.images.flatten(1))
    assert overlap < 5  # a few digits are drawn identically, nothing more
    assert sorted(set(test.labels.tolist())) == list(range(10))


def test_image_folder_is_read_resized_and_labelled_by_sorted_class(tmp_path):
    from PIL import Image
    for name, shade in (("cat", 40), ("ant", 200)):
        (tmp_path / name).mkdir()
        for i in range(2):
            Image.new("RGB", (10 + i, 10), (shade, shade, shade)).save(tmp_path / name / f"{i}.png")
    (tmp_path / "ant" / "notes.txt").write_text("not an image")
    image_set = load_image_set(str(tmp_path), img_size=6, channels=3)
    assert image_set.classes == ["ant", "cat"] and image_set.labels.tolist() == [0, 0, 1, 1]
    assert image_set.images.shape == (4, 3, 6, 6)
    assert abs(float(image_set.images[0].mean()) - 200 / 255) < 0.02
    grey = load_image_set(str(tmp_path), channels=1)
    assert grey.images.shape[1] == 1


def test_accuracy_counts_each_image(tmp_path):
    config = VisionMambaConfig(img_size=8, patch_size=2, stride=2, channels=1, d_model=24, n_layer=1,
                               num_classes=10, image_mean=(0.5,), image_std=(0.5,))
    model = randomize_(VisionMamba(config).eval(), seed=0)
    test = load_image_set("digits", "test")
    result = evaluate_images(model, test, batch_size=50)
    with torch.no_grad():
        expected = (model(normalize(test.images, config)).argmax(-1) == test.labels).float()
    assert result["num_images"] == 360 and result["correct"] == expected.long().tolist()
    assert result["top1"] == pytest.approx(expected.mean().item())
    assert result["top1_stderr"] == pytest.approx((result["top1"] * (1 - result["top1"]) / 360) ** 0.5)


def test_bad_sources_are_clear_errors(tmp_path):
    with pytest.raises(QuambaError, match="unknown image set"):
        load_image_set("imagenet")
    with pytest.raises(QuambaError, match="splits train and test"):
        load_image_set("digits", "validation")
    with pytest.raises(QuambaError, match="holds no PNG or JPEG"):
        load_image_set(str(tmp_path))
    with pytest.raises(QuambaError, match="has 3 channels, the model takes 2"):
        load_image_set(str(_rgb_folder(tmp_path)), channels=2)


def _rgb_folder(root):
    from PIL import Image
    (root / "a").mkdir()
    Image.new("RGB", (4, 4)).save(root / "a" / "x.png")
    return root
