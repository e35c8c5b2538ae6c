"""Training data: synthetic tasks by sample id, round sampling, and the CIFAR-10 and npz readers."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from edgeswarm.data import open_dataset
from edgeswarm.data.base import round_sample_ids
from edgeswarm.data.files import CIFAR10_MEAN, CIFAR10_STD
from edgeswarm.errors import ConfigError, DataError
from edgeswarm.models.zoo import build_model, example_input, example_target
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.values.specs import DatasetSpec

LENET = ModelSpec(name="lenet5", config={"in_channels": 1, "image_size": 16, "width": 0.5})
MLP = ModelSpec(name="mlp", config={"in_channels": 1, "image_size": 8, "hidden": 64, "num_classes": 10})
MOBILENET = ModelSpec(name="mobilenetv2", config={"width": 0.1})
BERT = ModelSpec(name="bert-small", config={"vocab_size": 64, "seq_len": 12, "layers": 1, "hidden": 16,
                                            "heads": 2, "num_classes": 3})
GPT2 = ModelSpec(name="gpt2", config={"vocab_size": 50, "seq_len": 10, "n_layer": 1, "n_embd": 16, "n_head": 2})
CIFAR_CNN = ModelSpec(name="lenet5", config={"in_channels": 3, "image_size": 32, "width": 0.5})

SYNTHETIC = [("teacher", LENET), ("teacher", MOBILENET), ("tokens", BERT), ("tokens", GPT2)]


# --- spec validation ---------------------------------------------------------------------------------------


def test_spec_requires_a_path_for_file_kinds_and_refuses_one_for_synthetic_kinds() -> None:
    with pytest.raises(ValidationError, match="'cifar10' needs path.*data_batch_1.*nothing is downloaded"):
        DatasetSpec(kind="cifar10")
    with pytest.raises(ValidationError, match="'npz' needs path.*train.npz"):
        DatasetSpec(kind="npz")
    with pytest.raises(ValidationError, match="'teacher' generates its data and takes no path"):
        DatasetSpec(kind="teacher", path="/data")
    with pytest.raises(ValidationError, match="noise applies to the synthetic kinds only"):
        DatasetSpec(kind="npz", path="/data", noise=0.1)
    with pytest.raises(ValidationError):
        DatasetSpec(kind="teacher", shuffle=True)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        DatasetSpec(kind="teacher", noise=1.5)
    spec = DatasetSpec(kind="cifar10", path="/data")
    with pytest.raises(ValidationError):
        spec.seed = 3  # type: ignore[misc]


# --- synthetic data by sample id ---------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "model"), SYNTHETIC)
def test_two_independently_opened_data_sets_give_identical_samples(kind: str, model: ModelSpec) -> None:
    spec = DatasetSpec(kind=kind, size=64, test_size=16, seed=5, noise=0.1)
    first, second = open_dataset(spec, model), open_dataset(spec, model)
    ids = [7, 0, 63, 7]
    assert torch.equal(first.inputs(ids), second.inputs(ids))
    assert torch.equal(first.labels(ids), second.labels(ids))
    assert torch.equal(first.inputs([1, 2], "test"), second.inputs([1, 2], "test"))
    # The same id in the other split, or under another seed, is a different sample.
    assert not torch.equal(first.inputs([1]), first.inputs([1], "test"))
    other = open_dataset(DatasetSpec(kind=kind, size=64, seed=6), model)
    assert not torch.equal(first.inputs(ids), other.inputs(ids))


@pytest.mark.parametrize(("kind", "model"), SYNTHETIC)
def test_a_sample_does_not_depend_on_the_other_ids_asked_for(kind: str, model: ModelSpec) -> None:
    data = open_dataset(DatasetSpec(kind=kind, size=32, noise=0.2), model)
    assert torch.equal(data.inputs([3, 1]), data.inputs([1, 3]).flip(0))
    assert torch.equal(data.labels([3, 1]), data.labels([1, 3]).flip(0))
    whole_x, whole_y = data.batch(np.arange(32))
    assert torch.equal(whole_x[[5, 9]], data.inputs(np.array([5, 9])))
    assert torch.equal(whole_y[[5, 9]], data.labels([5, 9]))
    # Nor on the size of the set: a larger set extends a smaller one.
    larger = open_dataset(DatasetSpec(kind=kind, size=512, noise=0.2), model)
    assert torch.equal(larger.batch(range(32))[1], whole_y)


@pytest.mark.parametrize(("kind", "model"), SYNTHETIC)
def test_samples_fit_the_model_they_were_opened_for(kind: str, model: ModelSpec) -> None:
    data = open_dataset(DatasetSpec(kind=kind, size=8), model)
    x, y = data.batch([0, 1, 2])
    assert x.shape == example_input(model, 3).shape and x.dtype == example_input(model, 3).dtype
    assert y.shape == example_target(model, 3).shape and y.dtype == torch.int64
    assert tuple(x.shape[1:]) == data.input_shape and x.dtype == data.input_dtype
    assert tuple(y.shape[1:]) == data.label_shape
    assert int(y.min()) >= 0 and int(y.max()) < data.num_classes
    net = build_model(model).eval()
    with torch.no_grad():
        out = net(x)
    loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    assert torch.isfinite(loss)
    empty = data.inputs([])
    assert empty.shape == (0, *data.input_shape) and empty.dtype == data.input_dtype


def test_teacher_images_are_standard_normal_pixels_with_balanced_classes() -> None:
    grey = {"in_channels": 1, "image_size": 8}
    cases = [(MLP, seed) for seed in range(4)] + [(MOBILENET, 2)] + [
        (ModelSpec(name="mlp", config={**grey, "num_classes": classes}), 1) for classes in (2, 3, 100)]
    for model, seed in cases:
        data = open_dataset(DatasetSpec(kind="teacher", size=4000, seed=seed), model)
        x, y = data.batch(np.arange(4000))
        counts = np.bincount(y.numpy(), minlength=data.num_classes)
        assert counts.min() >= 4000 / (3 * data.num_classes), (model, seed, counts)
        assert abs(float(x.mean())) < 0.02 and abs(float(x.std()) - 1.0) < 0.02


def test_teacher_labels_are_learnable_by_a_small_student() -> None:
    torch.manual_seed(0)
    data = open_dataset(DatasetSpec(kind="teacher", size=2048, test_size=512, seed=1), MLP)
    x, y = data.batch(np.arange(data.train_size))
    x_test, y_test = data.batch(np.arange(data.test_size), "test")
    student = build_model(MLP)
    opt = torch.optim.Adam(student.parameters(), lr=2e-3)
    for step in range(300):
        ids = round_sample_ids(step, 64, data.train_size, seed=1)
        loss = torch.nn.functional.cross_entropy(student(x[ids]), y[ids])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        accuracy = float((student(x_test).argmax(1) == y_test).float().mean())
    # Chance is 10%; the student reaches about 80%.
    assert accuracy > 0.5, accuracy


def test_a_grid_1_teacher_labels_by_channel_means_only() -> None:
    """With teacher_grid 1 a label depends on each channel's mean alone: moving pixels around inside a channel
    (here: flipping the image) keeps it, while the default quadrant teacher's labels change."""
    flips = {}
    for grid in (1, None):
        data = open_dataset(DatasetSpec(kind="teacher", size=512, seed=3, teacher_grid=grid), MOBILENET)
        x, y = data.batch(np.arange(512))
        flipped = data._labels_of(x.flip(-1).numpy(), np.arange(512), "train")  # noqa: SLF001 - teacher on other images
        flips[grid] = float((torch.as_tensor(flipped) == y).float().mean())
    assert flips[1] == 1.0 and flips[None] < 0.9, flips
    with pytest.raises(ValidationError, match="teacher_grid applies to kind 'teacher' only"):
        DatasetSpec(kind="tokens", teacher_grid=1)
    with pytest.raises(DataError, match="teacher_grid 2 does not tile images of side 7"):
        open_dataset(DatasetSpec(kind="teacher", teacher_grid=2), ModelSpec(name="mlp", config={"image_size": 7}))


def test_label_noise_replaces_about_that_share_of_labels() -> None:
    clean = open_dataset(DatasetSpec(kind="teacher", size=2000, seed=4), MLP).labels(range(2000))
    noisy = open_dataset(DatasetSpec(kind="teacher", size=2000, seed=4, noise=0.3), MLP).labels(range(2000))
    changed = float((clean != noisy).float().mean())
    # A replaced label keeps its class by chance one time in ten.
    assert 0.3 * 0.9 - 0.05 < changed < 0.3 * 0.9 + 0.05


def test_token_classes_are_balanced_and_learnable_from_token_counts() -> None:
    data = open_dataset(DatasetSpec(kind="tokens", size=3000, test_size=500), BERT)
    x, y = data.batch(np.arange(3000))
    assert int(x.min()) >= 0 and int(x.max()) < 64
    counts = np.bincount(y.numpy(), minlength=3)
    assert counts.min() >= 3000 / 9, counts
    # The label reads only which tokens occur, so a bag-of-words linear classifier learns it.
    torch.manual_seed(0)

    def bag(tokens: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(tokens, 64).sum(1).float()

    linear = torch.nn.Linear(64, 3)
    opt = torch.optim.Adam(linear.parameters(), lr=0.05)
    for _ in range(200):
        loss = torch.nn.functional.cross_entropy(linear(bag(x)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    x_test, y_test = data.batch(np.arange(500), "test")
    with torch.no_grad():
        accuracy = float((linear(bag(x_test)).argmax(1) == y_test).float().mean())
    assert accuracy > 2 / 3, accuracy


def test_next_token_targets_continue_the_inputs_and_follow_one_rule() -> None:
    data = open_dataset(DatasetSpec(kind="tokens", size=200), GPT2)
    x, y = data.batch(np.arange(200))
    assert data.num_classes == 50 and data.label_shape == (10,)
    assert torch.equal(y[:, :-1], x[:, 1:])
    # Find the affine rule from the data alone: the most common successor of each token is its image.
    pairs = torch.stack([x.reshape(-1), y.reshape(-1)], 1).tolist()
    successor: dict[int, dict[int, int]] = {}
    for a, b in pairs:
        successor.setdefault(a, {}).setdefault(b, 0)
        successor[a][b] += 1
    follows = sum(max(c.values()) for c in successor.values()) / len(pairs)
    assert 0.8 < follows < 0.95  # restarts with probability 1/8


def test_ids_outside_the_split_and_bad_splits_are_refused() -> None:
    data = open_dataset(DatasetSpec(kind="teacher", size=10, test_size=4), LENET)
    with pytest.raises(DataError, match="sample id 10 is outside the train split.*0..9"):
        data.inputs([0, 10])
    with pytest.raises(DataError, match="sample id 4 is outside the test split"):
        data.labels([4], "test")
    with pytest.raises(DataError, match="sample id -1"):
        data.labels([-1])
    with pytest.raises(DataError, match="integers"):
        data.inputs([0.5])
    with pytest.raises(DataError, match="unknown split 'valid'"):
        data.inputs([0], "valid")  # type: ignore[arg-type]


def test_synthetic_kinds_must_match_the_models_input_kind() -> None:
    with pytest.raises(ConfigError, match="'tokens' gives sequences of int64 token ids.*'lenet5' takes 1x16x16"):
        open_dataset(DatasetSpec(kind="tokens"), LENET)
    with pytest.raises(ConfigError, match="'teacher' gives float images.*'bert-small' takes sequences of 12"):
        open_dataset(DatasetSpec(kind="teacher"), BERT)


# --- round sampling ----------------------------------------------------------------------------------------


def test_rounds_visit_every_id_once_per_epoch_in_a_new_order_each_epoch() -> None:
    walk = np.concatenate([round_sample_ids(r, 30, 100, seed=3) for r in range(10)])  # 3 epochs, straddling
    epochs = walk.reshape(3, 100)
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(100))
    assert not np.array_equal(epochs[0], epochs[1])
    assert np.array_equal(round_sample_ids(4, 30, 100, seed=3), walk[120:150])
    assert walk.dtype == np.int64
    assert not np.array_equal(round_sample_ids(0, 30, 100, seed=4), walk[:30])
    # A global batch larger than the data set spans several epochs.
    big = round_sample_ids(1, 250, 100, seed=3)
    assert np.array_equal(big[:50], walk[250:300])
    assert sorted(big[50:150].tolist()) == list(range(100))


def test_round_sampling_refuses_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="global_batch must be an integer >= 1"):
        round_sample_ids(0, 0, 100, seed=0)
    with pytest.raises(ConfigError, match="round_index"):
        round_sample_ids(-1, 8, 100, seed=0)
    with pytest.raises(ConfigError, match="train_size"):
        round_sample_ids(0, 8, 0, seed=0)


# --- CIFAR-10 ----------------------------------------------------------------------------------------------


def _write_cifar(root: Path, per_batch: int = 3, test: int = 4, protocol: int = 2) -> dict[str, tuple]:
    """The official python layout: five training batches and a test batch, pickled dicts with bytes keys."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    written: dict[str, tuple] = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        n = test if name == "test_batch" else per_batch
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, n).tolist()
        doc = {b"batch_label": name.encode(), b"labels": labels, b"data": data,
               b"filenames": [f"img_{i}.png".encode() for i in range(n)]}
        (root / name).write_bytes(pickle.dumps(doc, protocol=protocol))
        written[name] = (data, labels)
    return written


def _expected_cifar(data: np.ndarray) -> np.ndarray:
    pixels = data.reshape(-1, 3, 32, 32).astype(np.float32) / 255.0
    mean = np.array(CIFAR10_MEAN, dtype=np.float32).reshape(1, 3, 1, 1)
    std = np.array(CIFAR10_STD, dtype=np.float32).reshape(1, 3, 1, 1)
    return (pixels - mean) / std


@pytest.mark.parametrize("protocol", [2, 4])
def test_cifar10_batches_read_back_normalised_with_their_labels(tmp_path: Path, protocol: int) -> None:
    written = _write_cifar(tmp_path / "cifar-10-batches-py", protocol=protocol)
    # The parent of the extracted folder works too.
    data = open_dataset(DatasetSpec(kind="cifar10", path=str(tmp_path)), CIFAR_CNN)
    assert (data.train_size, data.test_size, data.input_shape, data.num_classes) == (15, 4, (3, 32, 32), 10)
    train = np.concatenate([written[f"data_batch_{i}"][0] for i in range(1, 6)])
    train_labels = sum((written[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    x, y = data.batch([4, 0, 14])
    np.testing.assert_allclose(x.numpy(), _expected_cifar(train[[4, 0, 14]]), rtol=1e-6, atol=1e-6)
    assert y.tolist() == [train_labels[4], train_labels[0], train_labels[14]]
    assert data.labels(range(4), "test").tolist() == written["test_batch"][1]
    assert x.dtype == torch.float32
    subset = open_dataset(DatasetSpec(kind="cifar10", path=str(tmp_path), size=5, test_size=2), CIFAR_CNN)
    assert (subset.train_size, subset.test_size) == (5, 2)
    with pytest.raises(DataError, match="size asks for 16 samples.*only 15"):
        open_dataset(DatasetSpec(kind="cifar10", path=str(tmp_path), size=16), CIFAR_CNN)


def test_cifar10_written_by_numpy_1_reads_back(tmp_path: Path) -> None:
    written = _write_cifar(tmp_path)
    for name in written:
        blob = (tmp_path / name).read_bytes()
        # The official files name numpy 1's module; protocol 2 spells globals as text lines, so rename in place.
        (tmp_path / name).write_bytes(blob.replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n"))
    assert b"numpy.core.multiarray" in (tmp_path / "test_batch").read_bytes()
    data = open_dataset(DatasetSpec(kind="cifar10", path=str(tmp_path)), CIFAR_CNN)
    assert data.labels(range(4), "test").tolist() == written["test_batch"][1]


def test_a_pickle_naming_other_code_is_refused_unread(tmp_path: Path) -> None:
    _write_cifar(tmp_path)
    marker = tmp_path / "ran"
    # Protocol 0 by hand: call os.system with a command that would leave a marker file.
    (tmp_path / "data_batch_3").write_bytes(b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    with pytest.raises(DataError, match=r"refusing to unpickle os\.system"):
        open_dataset(DatasetSpec(kind="cifar10", path=str(tmp_path)), CIFAR_CNN)
    assert not marker.exists()
    (tmp_path / "data_batch_3").write_bytes(pickle.dumps({b"data": [1, 2], b"labels": [0]}, protocol=2))
    with pytest.raises(DataError, match="'data' should be a uint8 array of shape"):
        open_dataset(DatasetSpec(kind="cifar10", path=str(tmp_path)), CIFAR_CNN)
    (tmp_path / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(DataError, match="not a readable CIFAR-10 python batch"):
        open_dataset(DatasetSpec(kind="cifar10", path=str(tmp_path)), CIFAR_CNN)


def test_cifar10_says_what_it_expects_when_files_are_missing_or_the_model_does_not_fit(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist.*data_batch_1.*nothing is downloaded"):
        open_dataset(DatasetSpec(kind="cifar10", path=str(tmp_path / "nowhere")), CIFAR_CNN)
    _write_cifar(tmp_path)
    (tmp_path / "test_batch").unlink()
    with pytest.raises(DataError, match="lacks test_batch.*nothing is downloaded"):
        open_dataset(DatasetSpec(kind="cifar10", path=str(tmp_path)), CIFAR_CNN)
    with pytest.raises(ConfigError, match="gives 3x32x32 float images.*'mlp' takes 1x28x28"):
        open_dataset(DatasetSpec(kind="cifar10", path=str(tmp_path)), ModelSpec(name="mlp"))


# --- npz ---------------------------------------------------------------------------------------------------


def test_npz_round_trip_for_image_and_token_models(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    images = tmp_path / "images"
    images.mkdir()
    arrays = {}
    for split, n in (("train", 12), ("test", 5)):
        arrays[split] = (rng.standard_normal((n, 1, 8, 8)), rng.integers(0, 10, n))
        np.savez(images / f"{split}.npz", x=arrays[split][0], y=arrays[split][1])
    data = open_dataset(DatasetSpec(kind="npz", path=str(images)), MLP)
    assert (data.train_size, data.test_size) == (12, 5)
    x, y = data.batch([11, 2], "train")
    assert x.dtype == torch.float32
    np.testing.assert_array_equal(x.numpy(), arrays["train"][0][[11, 2]].astype(np.float32))
    assert y.tolist() == arrays["train"][1][[11, 2]].tolist()

    tokens = tmp_path / "tokens"
    tokens.mkdir()
    seqs = rng.integers(0, 50, (6, 11), dtype=np.int32)
    for split in ("train", "test"):
        np.savez(tokens / f"{split}.npz", x=seqs[:, :-1], y=seqs[:, 1:])
    lm = open_dataset(DatasetSpec(kind="npz", path=str(tokens)), GPT2)
    assert lm.inputs([3]).dtype == torch.int64
    assert lm.labels([3], "test").tolist() == [seqs[3, 1:].tolist()]


def test_npz_that_does_not_fit_the_model_is_refused_with_both_shapes(tmp_path: Path) -> None:
    np.savez(tmp_path / "train.npz", x=np.zeros((4, 1, 9, 9), np.float32), y=np.zeros(4, np.int64))
    np.savez(tmp_path / "test.npz", x=np.zeros((2, 1, 8, 8), np.float32), y=np.zeros(2, np.int64))
    spec = DatasetSpec(kind="npz", path=str(tmp_path))
    with pytest.raises(ConfigError, match=r"x of shape \(4, 1, 9, 9\).*'mlp' takes 1x8x8.*\(N, 1, 8, 8\)"):
        open_dataset(spec, MLP)
    np.savez(tmp_path / "train.npz", x=np.zeros((4, 1, 8, 8), np.float32), y=np.array([0, 1, 2, 10]))
    with pytest.raises(ConfigError, match="labels from 0 to 10.*0..9"):
        open_dataset(spec, MLP)
    np.savez(tmp_path / "train.npz", x=np.zeros((4, 1, 8, 8), np.float32), y=np.zeros((4, 2), np.int64))
    with pytest.raises(ConfigError, match=r"y of shape \(4, 2\)"):
        open_dataset(spec, MLP)
    np.savez(tmp_path / "train.npz", x=np.array([None] * 4, dtype=object), y=np.zeros(4, np.int64))
    with pytest.raises(DataError, match="not a readable .npz"):
        open_dataset(spec, MLP)
    (tmp_path / "test.npz").unlink()
    with pytest.raises(DataError, match="lacks .*test.npz.*nothing is downloaded"):
        open_dataset(spec, MLP)
