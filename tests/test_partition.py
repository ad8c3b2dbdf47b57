"""Partitioning a data set into clusters for Decentralized Diffusion Models: k-means, PCA, the three methods,
the files a partition is kept in, and its picture."""

import json
import pickle
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from conftest import tiny_unet_config, write_config
from PIL import Image

from islands.cli import main
from islands.data.gmm import GMMSource
from islands.data.sources import _ArraySource
from islands.ddm.partition import Partition, kmeans, partition, pca, save_cluster_picture

MEANS = [[0.0, 0.0], [20.0, 0.0], [0.0, 20.0], [20.0, 20.0]]
WEIGHTS = [0.4, 0.3, 0.2, 0.1]


@pytest.fixture(scope="module")
def blobs():
    """2002 points (not a multiple of 3 or 4) from four far-apart, unequal Gaussian blobs."""
    return GMMSource(MEANS, std=1.0, weights=WEIGHTS, size=2002, seed=0)


@pytest.fixture(scope="module")
def blob_partition(blobs):
    return partition(blobs, 4, fine=64, balanced=False)


@pytest.fixture
def tiny_images():
    """24 random 1x8x8 images in 3 classes of 8."""
    g = torch.Generator().manual_seed(0)
    return _ArraySource(torch.randint(0, 256, (24, 1, 8, 8), generator=g, dtype=torch.uint8),
                        torch.arange(24) % 3, 3)


def contingency(a, b):
    a, b = np.asarray(a), np.asarray(b)
    table = np.zeros((a.max() + 1, b.max() + 1), dtype=np.int64)
    np.add.at(table, (a, b), 1)
    return table


def assert_same_clusters(found, truth):
    """The two labelings agree up to renaming: the contingency table is a (scaled) permutation matrix."""
    table = contingency(found, truth)
    assert table.shape[0] == table.shape[1]
    assert ((table > 0).sum(0) == 1).all() and ((table > 0).sum(1) == 1).all(), table


def labels_of(source):
    return source.get(np.arange(len(source)))[1].numpy()


# --- k-means --------------------------------------------------------------------------------------------------------

def test_kmeans_recovers_separated_blobs_and_is_deterministic(blobs):
    x, truth = blobs.get(np.arange(len(blobs)))
    centroids, assignment = kmeans(x, 4, seed=0)
    assert assignment.dtype == torch.int64 and assignment.shape == (len(blobs),) and centroids.shape == (4, 2)
    assert_same_clusters(assignment, truth)
    for c in range(4):  # each centroid is its blob's mean
        blob = int(torch.mode(truth[assignment == c]).values)
        assert torch.allclose(centroids[c], x[truth == blob].mean(0), atol=1e-4)
    again = kmeans(x, 4, seed=0)
    assert torch.equal(again[0], centroids) and torch.equal(again[1], assignment)
    assert_same_clusters(kmeans(x, 4, seed=1)[1], truth)


def test_balanced_kmeans_evens_sizes_where_plain_kmeans_keeps_the_blobs(blobs):
    x, truth = blobs.get(np.arange(len(blobs)))
    true_sizes = sorted(np.bincount(truth.numpy()).tolist())
    _, plain = kmeans(x, 4, seed=0, balanced=False)
    assert sorted(np.bincount(plain.numpy()).tolist()) == true_sizes  # 200..800: far from equal
    for k in (3, 4):
        _, even = kmeans(x, k, seed=0, weights=torch.ones(len(x)), balanced=True)
        sizes = np.bincount(even.numpy(), minlength=k)
        assert sizes.sum() == len(x) and sizes.max() - sizes.min() <= 1, sizes


def test_kmeans_weights_move_the_means_and_no_cluster_is_left_empty():
    x = torch.tensor([[0.0], [1.0], [100.0]])
    centroids, assignment = kmeans(x, 2, seed=0, weights=torch.tensor([3.0, 1.0, 1.0]))
    assert sorted(centroids[:, 0].tolist()) == pytest.approx([0.25, 100.0])
    assert assignment[0] == assignment[1] != assignment[2]
    # two distinct points, three clusters: one seed repeats, its cluster empties and must be re-seeded
    duplicates = torch.tensor([[0.0]] * 5 + [[1.0]])
    _, assignment = kmeans(duplicates, 3, seed=0)
    assert torch.bincount(assignment, minlength=3).min() >= 1
    with pytest.raises(ValueError, match="k=4"):
        kmeans(x, 4, seed=0)


def test_pca_of_data_in_a_3d_subspace_keeps_distances():
    g = torch.Generator().manual_seed(0)
    basis, _ = torch.linalg.qr(torch.randn(20, 3, dtype=torch.float64, generator=g))
    latent = torch.randn(300, 3, dtype=torch.float64, generator=g) * torch.tensor([5.0, 2.0, 0.5], dtype=torch.float64)
    x = (latent @ basis.T + 3.0).float()  # off the origin: pca must centre
    projected = pca(x, 3)
    assert projected.shape == (300, 3) and projected.dtype == torch.float32
    before, after = torch.cdist(x.double(), x.double()), torch.cdist(projected.double(), projected.double())
    assert ((after - before).abs() <= 1e-4 * before.max()).all()
    assert torch.equal(pca(x, 3), projected)
    assert projected.var(0)[0] > projected.var(0)[1] > projected.var(0)[2]  # leading axis first
    with pytest.raises(ValueError, match="pca"):
        pca(x, 21)


def test_pca_signs_each_axis_by_its_largest_entry():
    g = torch.Generator().manual_seed(1)
    t = torch.randn(50, dtype=torch.float64, generator=g)
    for _ in range(8):  # data along a line: the axis is +-v, and the convention picks the sign
        v = torch.nn.functional.normalize(torch.randn(6, dtype=torch.float64, generator=g), dim=0)
        x = (t[:, None] * v + 1.0).float()
        expected = (t - t.mean()) * torch.sign(v[v.abs().argmax()])
        assert torch.allclose(pca(x, 1)[:, 0].double(), expected, atol=1e-5)


# --- partition ------------------------------------------------------------------------------------------------------

def test_two_stage_kmeans_partition_finds_the_components(blobs, blob_partition):
    truth = labels_of(blobs)
    p = blob_partition
    assert_same_clusters(p.cluster, truth)
    assert sorted(p.sizes) == sorted(np.bincount(truth).tolist()) and sum(p.sizes) == len(blobs)
    assert (p.k, p.method, p.features_name, p.balanced) == (4, "kmeans", "pixels", False)
    assert p.fine_centroids.shape == (64, 2) and p.coarse_centroids.shape == (4, 2)
    assert p.cluster.dtype == np.int64 and p.fine_assignment.shape == (len(blobs),)
    # each example sits in the coarse cluster nearest to its fine centroid's
    nearest = ((p.fine_centroids[:, None] - p.coarse_centroids[None]) ** 2).sum(-1).argmin(1)
    assert np.array_equal(p.cluster, nearest[p.fine_assignment])
    # what each class holds of each cluster, for oracle routing of conditional samples
    assert np.array_equal(np.array(p.sizes_by_class), contingency(truth, p.cluster))
    unlabelled = _ArraySource(blobs.get(np.arange(len(blobs)))[0], None, 0)
    assert partition(unlabelled, 4, fine=64, balanced=False).sizes_by_class is None


def test_balanced_two_stage_partition_evens_out_the_clusters(blobs):
    p = partition(blobs, 4, fine=64, balanced=True)
    heaviest_fine = np.bincount(p.fine_assignment).max()  # fine clusters move whole, so this is the slack
    assert all(abs(size - len(blobs) / 4) <= heaviest_fine for size in p.sizes), p.sizes


def test_random_partition_is_even_seeded_and_blind_to_labels(blobs):
    p = partition(blobs, 3, method="random", seed=5)
    assert max(p.sizes) - min(p.sizes) <= 1 and sum(p.sizes) == len(blobs)
    assert np.array_equal(partition(blobs, 3, method="random", seed=5).cluster, p.cluster)
    assert not np.array_equal(partition(blobs, 3, method="random", seed=6).cluster, p.cluster)
    truth = labels_of(blobs)
    overall = np.bincount(truth) / len(truth)
    for c in range(3):
        share = np.bincount(truth[p.cluster == c], minlength=4) / p.sizes[c]
        assert np.abs(share - overall).max() < 0.07, (c, share, overall)


def test_label_partition_deals_whole_classes(blobs):
    truth = labels_of(blobs)
    for k in (2, 3, 4):
        p = partition(blobs, k, method="label")
        for c in range(4):
            assert len(np.unique(p.cluster[truth == c])) == 1  # a class is never split
        assert sorted(np.unique(p.cluster).tolist()) == list(range(k))  # no cluster left empty
    # classes of 1, 5, 2 and 6 examples: only {0, 3} against {1, 2} splits them evenly
    labels = torch.tensor([0] + [1] * 5 + [2] * 2 + [3] * 6)
    uneven = _ArraySource(torch.zeros(14, 2), labels, 4)
    p = partition(uneven, 2, method="label")
    assert p.sizes == [7, 7] and p.cluster[0] == p.cluster[-1] != p.cluster[1] == p.cluster[6]


def test_bad_requests_name_the_key(blobs, tiny_images):
    unlabelled = _ArraySource(tiny_images.data, None, 0)
    for call, key in [(lambda: partition(tiny_images, 25), "ddm.k: 25 clusters for 24 examples"),
                      (lambda: partition(tiny_images, 0), "ddm.k"),
                      (lambda: partition(tiny_images, 2, method="dino"), "ddm.partition.method"),
                      (lambda: partition(unlabelled, 2, method="label"), "ddm.partition.method: 'label' needs"),
                      (lambda: partition(tiny_images, 4, method="label"), "ddm.k: 4 clusters for 3 classes"),
                      (lambda: partition(tiny_images, 4, fine=3), "ddm.partition.fine")]:
        with pytest.raises(ValueError, match=key):
            call()


# --- on disk ---------------------------------------------------------------------------------------------------------

class Payload:
    """Unpickling this creates a file: proof that a pickle was run."""

    def __init__(self, mark):
        self.mark = mark

    def __reduce__(self):
        return (Path.touch, (Path(self.mark),))


def test_save_load_round_trip_is_exact_and_members_agree(tmp_path, blobs, blob_partition):
    for p in (blob_partition, partition(blobs, 3, method="random")):
        directory = p.save(tmp_path / p.method)
        assert sorted(f.name for f in directory.iterdir()) == ["assignments.npz", "partition.json"]  # no temp files
        back = Partition.load(directory)
        for name, value in vars(p).items():
            if isinstance(value, np.ndarray):
                loaded = getattr(back, name)
                assert loaded.dtype == value.dtype and loaded.shape == value.shape and np.array_equal(loaded, value)
            else:
                assert getattr(back, name) == value, name
        members = [back.members(c) for c in range(back.k)]
        assert np.array_equal(np.sort(np.concatenate(members)), np.arange(len(blobs)))
        for c, m in enumerate(members):
            assert (np.diff(m) > 0).all() and (back.cluster[m] == c).all() and len(m) == back.sizes[c]


def test_corrupt_or_pickled_files_are_refused_by_name_without_running_anything(tmp_path, blob_partition):
    directory = blob_partition.save(tmp_path / "p")
    arrays, meta = directory / "assignments.npz", directory / "partition.json"
    good = arrays.read_bytes()
    mark = tmp_path / "pwned"
    for bad in (good[: len(good) // 2], b"not an archive", pickle.dumps({"cluster": Payload(mark)})):
        arrays.write_bytes(bad)
        with pytest.raises(ValueError, match="assignments.npz"):
            Partition.load(directory)
    with open(arrays, "wb") as f:  # a well-formed archive whose member is a pickled object array
        np.savez(f, cluster=np.array([Payload(mark)], dtype=object), fine_centroids=np.zeros((0, 2)),
                 coarse_centroids=np.zeros((0, 2)), fine_assignment=np.zeros(0, np.int64))
    with pytest.raises(ValueError, match="assignments.npz"):
        Partition.load(directory)
    assert not mark.exists()
    arrays.write_bytes(good)
    meta.write_text(meta.read_text()[:-5])
    with pytest.raises(ValueError, match="partition.json"):
        Partition.load(directory)
    blob_partition.save(directory)
    tampered = json.loads(meta.read_text())
    tampered["sizes"] = tampered["sizes"][::-1]
    meta.write_text(json.dumps(tampered))
    with pytest.raises(ValueError, match="does not match"):
        Partition.load(directory)
    blob_partition.save(directory)
    tampered = json.loads(meta.read_text())
    tampered["sizes_by_class"][0][0] += 1
    meta.write_text(json.dumps(tampered))
    with pytest.raises(ValueError, match="partition.json: sizes_by_class does not add up"):
        Partition.load(directory)
    meta.unlink()
    with pytest.raises(ValueError, match="partition.json"):
        Partition.load(directory)


def test_check_refuses_other_data(blobs, blob_partition):
    blob_partition.check(blobs)
    other = GMMSource(MEANS, std=1.0, weights=WEIGHTS, size=2002, seed=1)
    with pytest.raises(ValueError, match="partition was made for other data"):
        blob_partition.check(other)


# --- pictures --------------------------------------------------------------------------------------------------------

def test_picture_of_image_clusters_has_a_row_per_cluster(tmp_path, tiny_images):
    p = partition(tiny_images, 3, method="label")
    path = save_cluster_picture(p, tiny_images, tmp_path / "clusters.png", per_cluster=10)  # 8 per cluster
    with Image.open(path) as image:
        assert image.format == "PNG"
        image.verify()
    picture = np.asarray(Image.open(path))
    pad, cell, scale = 2, 10, 8  # 8x8 images with 2-pixel borders, enlarged 8x to be legible
    assert picture.shape == ((3 * cell + pad) * scale, (10 * cell + pad) * scale)
    for c in range(3):
        top = (pad + c * cell) * scale
        first = tiny_images.data[p.members(c)[0], 0].numpy()
        assert np.array_equal(picture[top:top + 8 * scale:scale, pad * scale:(pad + 8) * scale:scale], first)
        left = (pad + 9 * cell) * scale  # the tenth cell: the cluster has only 8 examples
        assert (picture[top:top + 8 * scale, left:left + 8 * scale] == 255).all()


def test_picture_of_vector_clusters_is_a_scatter_coloured_by_cluster(tmp_path, blobs, blob_partition):
    path = save_cluster_picture(blob_partition, blobs, tmp_path / "clusters.png")
    with Image.open(path) as image:
        assert image.format == "PNG"
        image.verify()
    picture = np.asarray(Image.open(path).convert("RGB")).astype(int)
    tab10 = (np.array(matplotlib.colormaps["tab10"].colors[:5]) * 255).round().astype(int)
    present = [(np.abs(picture - colour).sum(-1) == 0).sum() for colour in tab10]
    assert min(present[:4]) > 50 and present[4] == 0  # four clusters, four colours


def tiny_ensemble_config(tmp_path, data) -> str:
    """Two experts of the tiny U-Net on a random split of `data`, in tmp_path/ens."""
    return write_config(tmp_path / "c.yaml", tiny_unet_config(tmp_path / "ens", data, train={"images": 16},
                                                             ddm={"k": 2, "partition": {"method": "random"}}))


def test_an_expert_refuses_data_other_than_its_partition_was_made_of(tmp_path, image_npz, capsys):
    """The same number of examples is not the same data: an expert would train on another cluster's images."""
    config = tiny_ensemble_config(tmp_path, image_npz)
    assert main(["partition", config, "--quiet"]) == 0
    with np.load(image_npz) as data:
        x, y = data["x"], data["y"]
    np.savez(image_npz, x=255 - x, y=y)  # other images, as many
    capsys.readouterr()
    assert main(["train", config, "expert=0", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == (f"islands: partition {tmp_path / 'ens' / 'partition'} was made of other data than {image_npz} (the "
                   "same 64 examples in number, not in content); use the data it was made of or partition again\n")
    assert not (tmp_path / "ens" / "experts" / "0" / "checkpoints").exists()
    np.savez(image_npz, x=x, y=y)  # the data it was made of, written anew: hashed again, and it is the same
    assert main(["train", config, "expert=0", "--quiet"]) == 0


def test_a_partition_that_records_no_data_fingerprint_is_checked_by_length_with_one_warning(tmp_path, image_npz,
                                                                                            capsys):
    config = tiny_ensemble_config(tmp_path, image_npz)
    assert main(["partition", config, "--quiet"]) == 0
    meta = tmp_path / "ens" / "partition" / "partition.json"
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "data_sha256"}))
    capsys.readouterr()
    assert main(["train", config, "expert=1", "--quiet"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warned == [f"islands: warning: partition {tmp_path / 'ens' / 'partition'} records no fingerprint of its "
                      f"data: {image_npz} is checked by its length only; partition again to have it checked"]


def test_data_beyond_the_sample_is_clustered_in_one_streaming_pass(blobs, monkeypatch):
    """With more examples than `sample`, the fine centroids are fitted on the sample alone and every example goes,
    in chunks, to its nearest one (checked against all distances at once); the four blobs still come out whole."""
    from islands.ddm import partition as module

    fitted = []
    real_kmeans = module.kmeans
    monkeypatch.setattr(module, "kmeans", lambda x, *a, **kw: fitted.append(len(x)) or real_kmeans(x, *a, **kw))
    made = partition(blobs, 4, "kmeans", pca_dim=None, fine=16, balanced=False, seed=0, sample=300)
    assert fitted[0] == 300  # the fine stage saw the sample only
    nearest = torch.cdist(blobs.x.double(), torch.from_numpy(made.fine_centroids).double()).argmin(1).numpy()
    assert np.array_equal(made.fine_assignment, nearest)
    for fine in range(len(made.fine_centroids)):  # an example's cluster is its fine centroid's
        assert len(np.unique(made.cluster[made.fine_assignment == fine])) == 1
    for component in range(4):  # each blob lies in one cluster
        assert len(np.unique(made.cluster[blobs.y.numpy() == component])) == 1
