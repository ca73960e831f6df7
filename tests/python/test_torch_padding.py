"""A PyTorch module's padding_idx in checkpoints (format 1.5): ``ec.save``
records it (``config.padding_idx``), every served lookup of the table leaves
the padding id out of its bags as ``torch.nn.EmbeddingBag`` does (Python
serving, the served collections, and the C API in test_c_api.py and
tests/cpp/c_api_test.cc), per-id lookups give its row as ``torch.nn.Embedding``
does, and ``ec.load`` takes such a checkpoint only into a table of the same
padding_idx."""
import copy
import json
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import embedcore as ec  # noqa: E402
import embedcore.adapters.torch as et  # noqa: E402
from embedcore.distributed import reshard  # noqa: E402
from test_checkpoint_forge import read_manifest, write_manifest  # noqa: E402
from torch_helpers import bags, uniform_weights  # noqa: E402

ROWS, DIM = 40, 6


def _served(tmp_path, module, name="ckpt"):
    ec.save(tmp_path / name, module)
    return ec.serving.open(tmp_path / name).tables[module._table.name]


def _np(t):
    return t.detach().numpy()


@pytest.mark.parametrize("mode,weighted", [("sum", False), ("sum", True), ("mean", False)])  # PyTorch's weights: sum
@pytest.mark.parametrize("pad", [0, 7, -1])
def test_served_bags_leave_the_padding_id_out_as_torch(tmp_path, rng, mode, pad, weighted):
    W = uniform_weights(rng, ROWS, DIM)  # the padding row is not zero: from_pretrained keeps it
    bag = et.EmbeddingBag.from_pretrained(W, mode=mode, padding_idx=pad, include_last_offset=True, name="emb")
    ref = torch.nn.EmbeddingBag.from_pretrained(W, mode=mode, padding_idx=pad, include_last_offset=True)
    ids, offsets, w = bags(rng, ROWS, 24, weighted=weighted, pad=pad % ROWS)
    ids[offsets[3]:offsets[4]] = pad % ROWS  # a bag of padding ids only: zeros, as PyTorch
    assert (ids == pad % ROWS).any()
    want = _np(ref(ids, offsets, w))
    got = _np(bag(ids, offsets, w))
    served = _served(tmp_path, bag)
    assert served.padding_idx == pad % ROWS
    out = served.lookup(ids.numpy(), offsets.numpy(), None if w is None else w.numpy())
    np.testing.assert_array_equal(out, got)  # the module's bits: the same kernel over the same ids
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    assert not out[3].any()
    # The manifest records it, normalized as the module holds it.
    assert read_manifest(tmp_path / "ckpt")["tables"][0]["config"]["padding_idx"] == pad % ROWS


def test_sqrtn_and_weighted_mean_leave_padding_out_of_the_denominators(tmp_path, rng):
    W = uniform_weights(rng, ROWS, DIM)
    ids, offsets, w = bags(rng, ROWS, 30, weighted=True, pad=3)
    keep = ids.numpy() != 3
    plain = et.EmbeddingBag.from_pretrained(W, mode="sum", include_last_offset=True, name="plain")
    ckpt = tmp_path / "c"
    for mode in ("sqrtn", "mean"):
        bag = et.EmbeddingBag.from_pretrained(W, mode=mode, padding_idx=3, include_last_offset=True, name="emb")
        ec.save(ckpt, bag)
        served = ec.serving.open(ckpt).tables["emb"]
        ec.save(tmp_path / "plain", plain)
        unpadded = ec.serving.open(tmp_path / "plain").tables["plain"]
        # The reference: the same bags without the padding ids, in a table without padding_idx.
        kept_offsets = np.concatenate([[0], np.cumsum([keep[a:b].sum() for a, b in zip(offsets[:-1], offsets[1:])])])
        kept = (ids.numpy()[keep], kept_offsets, w.numpy()[keep])
        np.testing.assert_array_equal(served.lookup(ids.numpy(), offsets.numpy(), w.numpy()),
                                      unpadded.lookup(*kept, combiner=mode))
        np.testing.assert_array_equal(served.lookup(ids.numpy(), offsets.numpy()),
                                      unpadded.lookup(kept[0], kept[1], combiner=mode))
        if mode == "sqrtn":
            np.testing.assert_array_equal(served.lookup(ids.numpy(), offsets.numpy()), _np(bag(ids, offsets)))


def test_per_id_and_sequence_lookups_give_the_padding_row_as_nn_embedding(tmp_path, rng):
    W = uniform_weights(rng, ROWS, DIM)
    emb = et.Embedding.from_pretrained(W, padding_idx=5, name="emb")
    ids = torch.tensor([[5, 1, 5], [2, 5, 9]])
    want = _np(torch.nn.Embedding.from_pretrained(W, padding_idx=5)(ids))
    np.testing.assert_array_equal(_np(emb(ids)), want)
    served = _served(tmp_path, emb)
    flat = ids.reshape(-1).numpy()
    offsets = np.array([0, 3, 6])
    np.testing.assert_array_equal(served.lookup(flat, offsets, combiner=None), want.reshape(-1, DIM))
    np.testing.assert_array_equal(served.lookup(flat, offsets, combiner=None, max_sequence_length=3), want)
    # Pooled, the padding id is out of the bag (an Embedding's table pools with "mean" by default).
    np.testing.assert_allclose(served.lookup(flat, offsets, combiner="sum"),
                               np.stack([W[1].numpy(), (W[2] + W[9]).numpy()]), rtol=1e-6)


def test_sparse_sequence_lookups_give_the_padding_row_at_any_positions(tmp_path, rng):
    """A sparse sequence lookup sums the ids that share a position with a
    pooled sum; served, that sum left the padding id out, so at positions
    with gaps or repeats its row came out zeros (or missing from the sum)."""
    W = uniform_weights(rng, ROWS, DIM)
    emb = et.Embedding.from_pretrained(W, padding_idx=5, name="emb")
    served = _served(tmp_path, emb)
    ids = np.array([5, 1, 5, 5, 9, 5])
    indices = np.array([[0, 0], [0, 2], [0, 2], [1, 1], [1, 1], [1, 3]])  # gaps, and two ids at a position twice
    for weights in (None, rng.standard_normal(6).astype(np.float32)):
        x = ec.Sparse(indices, ids, np.array([2, 4]))
        wx = None if weights is None else ec.Sparse(indices, weights, np.array([2, 4]))
        got = served.lookup(x, weights=wx, combiner=None)
        np.testing.assert_array_equal(got, emb.table.lookup(x, weights=wx, combiner=None))
        w = np.ones(6, np.float32) if weights is None else weights
        want = np.zeros((2, 4, DIM), np.float32)
        for (b, p), i, wk in zip(indices, ids, w):
            want[b, p] += wk * W[i].numpy()
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert np.any(got[0, 0] != 0)  # the padding row, alone at its position


def test_a_table_without_padding_idx_is_served_as_before(tmp_path, rng):
    W = uniform_weights(rng, ROWS, DIM)
    bag = et.EmbeddingBag.from_pretrained(W, mode="sum", include_last_offset=True, name="emb")
    served = _served(tmp_path, bag)
    assert served.padding_idx is None
    assert "padding_idx" not in read_manifest(tmp_path / "ckpt")["tables"][0]["config"]
    ids, offsets, _ = bags(rng, ROWS, 16, pad=0)
    np.testing.assert_array_equal(served.lookup(ids.numpy(), offsets.numpy()), _np(bag(ids, offsets)))


def test_served_collection_and_features_leave_padding_out(tmp_path, rng):
    """The served collections (one op per table, and the KJT's one engine
    call, lookup_windows_into) and feature lookups go through the served
    table's lookup."""
    W = uniform_weights(rng, ROWS, DIM)
    bag = et.EmbeddingBag.from_pretrained(W, mode="mean", padding_idx=2, include_last_offset=True, name="emb")
    ec.save(tmp_path / "c", bag)
    cfg = et.EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name="emb", feature_names=["f"],
                                pooling="mean")
    served = et.ServedEmbeddingBagCollection(tmp_path / "c", [cfg])
    ids, offsets, _ = bags(rng, ROWS, 12, pad=2)
    want = _np(bag(ids, offsets))
    np.testing.assert_array_equal(_np(served({"f": (ids, offsets)})["f"]), want)
    kjt_mod = pytest.importorskip("torchrec.sparse.jagged_tensor")
    kjt = kjt_mod.KeyedJaggedTensor(keys=["f"], values=ids, offsets=offsets)
    np.testing.assert_array_equal(_np(served(kjt).values()), want)
    # Feature lookups of a served Embedding's checkpoint (its table given a padding_idx as a module gives it).
    table = ec.TableConfig("emb", ROWS, DIM, combiner="sum")
    e = ec.Embedding({"a": ec.FeatureConfig(table, name="a"), "s": ec.FeatureConfig(table, 3, name="s")})
    e.embedding_tables[table].assign(W.numpy(), 0)
    e.embedding_tables[table]._padding_idx = 2
    ec.save(tmp_path / "e", e)
    srv = ec.serving.open(tmp_path / "e")
    out = srv({"a": ec.Ragged(ids.numpy(), offsets.numpy()), "s": ec.Ragged(ids.numpy(), offsets.numpy())})
    ref = torch.nn.EmbeddingBag.from_pretrained(W, mode="sum", padding_idx=2, include_last_offset=True)
    np.testing.assert_allclose(out["a"], _np(ref(ids, offsets)), rtol=1e-6, atol=1e-6)
    assert (ids[:offsets[-1]] == 2).any()
    seq = srv.tables["emb"].lookup(ids.numpy(), offsets.numpy(), combiner=None, max_sequence_length=3)
    np.testing.assert_array_equal(out["s"], seq)  # padding rows as stored, as nn.Embedding


def test_load_round_trip_and_refusals(tmp_path, rng):
    W = uniform_weights(rng, ROWS, DIM)
    bag = et.EmbeddingBag.from_pretrained(W, mode="mean", padding_idx=4, include_last_offset=True, name="emb",
                                          freeze=False)
    ec.save(tmp_path / "c", bag)
    same = et.EmbeddingBag(ROWS, DIM, mode="mean", padding_idx=4, include_last_offset=True, name="emb")
    ec.load(tmp_path / "c", into=same)
    np.testing.assert_array_equal(_np(same.weight), W.numpy())
    # Saved again (also from a copy or a pickle of the module), it keeps its padding_idx.
    for i, m in enumerate((same, copy.deepcopy(same), pickle.loads(pickle.dumps(same)))):
        ec.save(tmp_path / f"again{i}", m)
        assert ec.serving.open(tmp_path / f"again{i}").tables["emb"].padding_idx == 4
    # Into a table of another padding_idx, or of none (a plain Table pools every id): refused, nothing changes.
    for target in (et.EmbeddingBag(ROWS, DIM, mode="mean", padding_idx=5, name="emb"),
                   et.EmbeddingBag(ROWS, DIM, mode="mean", name="emb"),
                   ec.Table(name="emb", rows=ROWS, dim=DIM)):
        table = target if isinstance(target, ec.Table) else target._table
        before = table.to_numpy().copy()
        with pytest.raises(ec.CheckpointError, match="table 'emb' was saved with padding_idx 4.*padding_idx (5|none)"):
            ec.load(tmp_path / "c", into=target)
        np.testing.assert_array_equal(table.to_numpy(), before)
    # A checkpoint that records none (every one before format 1.5) loads into a module with one, as before.
    ec.save(tmp_path / "plain", et.EmbeddingBag.from_pretrained(W, mode="mean", name="emb"))
    ec.load(tmp_path / "plain", into=et.EmbeddingBag(ROWS, DIM, mode="mean", padding_idx=4, name="emb"))
    # A reshard (into two row-wise shard files) keeps it; so does a dump that keeps the table beside another.
    reshard(tmp_path / "c", tmp_path / "resharded", 2, plan="row_wise")
    resharded = ec.serving.open(tmp_path / "resharded").tables["emb"]
    assert resharded.padding_idx == 4
    ids, offsets, _ = bags(rng, ROWS, 10, pad=4)
    np.testing.assert_array_equal(resharded.lookup(ids.numpy(), offsets.numpy()), _np(bag(ids, offsets)))
    ec.Saver().dump_to_file(ec.Table(name="other", rows=3, dim=2), tmp_path / "c")
    assert ec.serving.open(tmp_path / "c").tables["emb"].padding_idx == 4
    # A padding_idx set on the module after it was made is the one saved (the forward reads the attribute too).
    bag.padding_idx = 6
    ec.save(tmp_path / "later", et.tables_of(bag))
    assert ec.serving.open(tmp_path / "later").tables["emb"].padding_idx == 6


@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_a_sharded_load_refuses_a_padding_idx_as_the_unsharded_load(tmp_path, rng, sharding):
    """A sharded Embedding's tables have no padding_idx: loading a
    checkpoint of an EmbeddingBag(padding_idx=4) into it is refused on
    every rank, naming the padding_idx (a rank without a shard of the table
    by a RankFailedError naming the holder's CheckpointError), and no shard
    changes, as the unsharded load refuses it."""
    import embedcore.distributed as ed

    W = uniform_weights(rng, ROWS, DIM)
    ec.save(tmp_path / "c", et.EmbeddingBag.from_pretrained(W, mode="sum", padding_idx=4, name="emb"))
    config = {"f": ec.FeatureConfig(ec.TableConfig("emb", ROWS, DIM, combiner="sum"))}
    with pytest.raises(ec.CheckpointError, match="table 'emb' was saved with padding_idx 4.*padding_idx none"):
        ec.load(tmp_path / "c", into=ec.Embedding(config))

    def fn(world):
        emb = ec.Embedding(config, world=world, sharding=sharding)
        shards = [t for pieces in emb.local_shards.values() for _, t in pieces]
        before = [t.to_numpy().copy() for t in shards]
        try:
            ec.load(tmp_path / "c", into=emb)
            error = None
        except Exception as e:  # noqa: BLE001
            error = e
        return error, bool(shards), all(np.array_equal(t.to_numpy(), b) for t, b in zip(shards, before))

    results = ed.run_local(2, fn)
    assert [holds for _, holds, _ in results] == ([True, True] if sharding == "row_wise" else [True, False])
    for rank, (error, holds, unchanged) in enumerate(results):
        # A rank that holds a shard finds the mismatch itself; the other hears of it from that rank.
        assert isinstance(error, ec.CheckpointError if holds else ed.RankFailedError), (rank, repr(error))
        assert "table 'emb' was saved with padding_idx 4" in str(error) and "padding_idx none" in str(error), error
        assert unchanged, rank


@pytest.mark.parametrize("bad", [ROWS, -1, 1.5, "0", True])
def test_a_malformed_padding_idx_is_refused(tmp_path, rng, bad):
    bag = et.EmbeddingBag.from_pretrained(uniform_weights(rng, ROWS, DIM), padding_idx=0, name="emb")
    ec.save(tmp_path / "c", bag)
    m = read_manifest(tmp_path / "c")
    m["tables"][0]["config"]["padding_idx"] = bad
    write_manifest(tmp_path / "c", m)
    with pytest.raises(ec.CheckpointError, match=r"tables\[0\]\.config\.padding_idx"):
        ec.serving.open(tmp_path / "c")
    with pytest.raises(ec.CheckpointError, match=r"tables\[0\]\.config\.padding_idx"):
        ec.load(tmp_path / "c", into=bag)
    m["tables"][0]["config"]["padding_idx"] = None  # null: none, as absent
    write_manifest(tmp_path / "c", m)
    assert ec.serving.open(tmp_path / "c").tables["emb"].padding_idx is None
    assert json.loads(json.dumps(m))["format_version"] == list(ec.FORMAT_VERSION)


def test_a_negative_padding_idx_set_after_construction_is_the_last_row(tmp_path, rng):
    # nn.EmbeddingBag's forward takes padding_idx=-1 set later as the last row; so do the module and its checkpoint.
    W = uniform_weights(rng, ROWS, DIM)
    ref = torch.nn.EmbeddingBag.from_pretrained(W.clone(), mode="sum")
    ours = et.EmbeddingBag.from_pretrained(W, mode="sum")
    ref.padding_idx = ours.padding_idx = -1
    ids = torch.tensor([ROWS - 1, 1, ROWS - 1, 2])
    offsets = torch.tensor([0, 2])
    np.testing.assert_allclose(_np(ours(ids, offsets)), _np(ref(ids, offsets)), rtol=1e-6)
    served = _served(tmp_path, ours)
    assert served.padding_idx == ROWS - 1
    np.testing.assert_array_equal(served.lookup(ids.numpy(), np.array([0, 2, 4])), _np(ours(ids, offsets)))


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("offsets_dtype", [torch.int64, torch.int32])
def test_a_call_without_the_padding_id_takes_the_engine_s_direct_path(monkeypatch, mode, offsets_dtype):
    """A module with padding_idx whose call holds no padding id (or int32
    offsets) goes straight to the engine, forward and fused backward (it
    took the general path, 2-3x the time of a small call), with
    nn.EmbeddingBag's results; a call holding it takes the general path."""
    from embedcore.adapters.torch import _ops

    w = torch.from_numpy(np.random.default_rng(3).standard_normal((10, 4)).astype(np.float32))
    ours = et.EmbeddingBag.from_pretrained(w.clone(), mode=mode, padding_idx=0, freeze=False,
                                           optimizer=ec.optimizers.SGD(0.5))
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), mode=mode, padding_idx=0, freeze=False)
    real_parts = _ops._parts
    for ids, general in ((torch.tensor([1, 2, 3, 4, 5]), False), (torch.tensor([1, 0, 3, 4, 0]), True)):
        offsets = torch.tensor([0, 2, 2], dtype=offsets_dtype)
        used = []
        monkeypatch.setattr(_ops, "_parts", lambda *a: used.append(1) or real_parts(*a))
        out = ours(ids, offsets)
        out.sum().backward()
        assert bool(used) == general
        want = ref(ids, offsets)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
        ref.zero_grad()
        want.sum().backward()
        with torch.no_grad():
            ref.weight -= 0.5 * ref.weight.grad
        torch.testing.assert_close(ours.weight, ref.weight, rtol=0, atol=1e-6)
