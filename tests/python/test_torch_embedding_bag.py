"""embedcore.adapters.torch.EmbeddingBag / Embedding against torch.nn.EmbeddingBag /
nn.Embedding on the same weights and inputs: every calling form, outputs,
gradients (to per_sample_weights and to the weight), and bad inputs."""
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import embedcore as ec  # noqa: E402
import embedcore.adapters.torch as et  # noqa: E402
from torch_helpers import bags, engine_optimizer, max_diff, torch_optimizer, uniform_weights  # noqa: E402

ROWS, DIM = 40, 6


def _pair(rng, mode="sum", **kw):
    w = uniform_weights(rng, ROWS, DIM)
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode=mode, **kw)
    ours = et.EmbeddingBag.from_pretrained(w, freeze=False, mode=mode, **kw)
    return ref, ours


# ------------------------------------------------------------------ packaging
def test_import_embedcore_does_not_import_torch():
    code = ("import sys, embedcore, embedcore.adapters\n"
            "assert 'torch' not in sys.modules, 'import embedcore imported torch'\n"
            "import embedcore.adapters.torch as et\n"
            "assert 'torch' in sys.modules\n"
            "print(sorted(et.__all__))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "EmbeddingBagCollection" in r.stdout


def test_exports():
    assert set(et.__all__) == {"Embedding", "EmbeddingBag", "EmbeddingBagCollection", "EmbeddingBagConfig",
                               "EmbeddingCollection", "EmbeddingConfig", "FusedOptimizer", "ServedEmbeddingBagCollection",
                               "ServedEmbeddingCollection", "ShardedEmbeddingBagCollection",
                               "ShardedEmbeddingCollection", "convert_state_dict", "distributed", "tables_of"}
    assert all(hasattr(et, n) for n in et.__all__)


# ------------------------------------------------------------------ forward
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("include_last_offset", [False, True])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_forward_matches_torch(rng, mode, include_last_offset, id_dtype, padding_idx):
    ref, ours = _pair(rng, mode, include_last_offset=include_last_offset, padding_idx=padding_idx)
    for _ in range(3):
        ids, offsets, w = bags(rng, ROWS, 9, id_dtype=id_dtype, weighted=mode == "sum", pad=padding_idx)
        if not include_last_offset:
            offsets = offsets[:-1]
        offsets = offsets.to(id_dtype)
        with torch.no_grad():
            assert max_diff(ours(ids, offsets), ref(ids, offsets)) <= 1e-6
            if w is not None:
                assert max_diff(ours(ids, offsets, w), ref(ids, offsets, w)) <= 1e-6


def test_include_last_offset_ignores_trailing_ids(rng):
    ref, ours = _pair(rng, "sum", include_last_offset=True)
    ids = torch.tensor([1, 2, 3, 4, 5])
    offsets = torch.tensor([0, 2, 3])  # ids 3 and 4 belong to no bag, as in PyTorch
    assert max_diff(ours(ids, offsets), ref(ids, offsets)) <= 1e-6


@pytest.mark.parametrize("offsets_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("mean", False), ("sum", True)])
@pytest.mark.parametrize("fused", [False, True])
def test_include_last_offset_trailing_ids_train(rng, offsets_dtype, mode, weighted, fused):
    """Ids after the last offset belong to no bag, in the backward too (was,
    with int64 offsets: every backward raised, unfused "allocated size does
    not match required size", fused "offsets must end at the number of ids"). The
    reference is nn.EmbeddingBag with torch.optim on the ids that are in
    bags: on CPU its own backward gives the trailing ids' rows (and
    per_sample_weights) gradients from uninitialised memory."""
    w = uniform_weights(rng, ROWS, DIM)
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode=mode, include_last_offset=True)
    ours = et.EmbeddingBag.from_pretrained(w, freeze=False, mode=mode, include_last_offset=True,
                                           optimizer=engine_optimizer("adagrad", 0.3) if fused else None)
    opt = torch_optimizer("adagrad", [ref.weight], 0.3)
    ids = torch.tensor([1, 2, 3, 2, 7, 9, 30, 31])
    offsets = torch.tensor([0, 2, 2, 5], dtype=offsets_dtype)  # ids 9, 30, 31 are in no bag
    psw = torch.tensor([0.5, 1.5, 2.0, 0.25, 1.0, 3.0, 4.0, 5.0]) if weighted else None
    g = torch.from_numpy(rng.standard_normal((3, DIM)).astype(np.float32))
    for _ in range(2):
        p1 = psw[:5].clone().requires_grad_() if weighted else None
        p2 = psw.clone().requires_grad_() if weighted else None
        expected = ref(ids[:5], offsets.long(), p1)
        out = ours(ids, offsets, p2)
        assert max_diff(out, expected) <= 1e-6
        opt.zero_grad()
        (expected * g).sum().backward()
        (out * g).sum().backward()
        opt.step()
        if weighted:
            assert max_diff(p2.grad[:5], p1.grad) <= 1e-5
            assert torch.equal(p2.grad[5:], torch.zeros(3))
        if fused:
            assert max_diff(ours.weight, ref.weight) <= 1e-5
        else:
            assert max_diff(ours.weight.grad, ref.weight.grad) <= 1e-6
            with torch.no_grad():
                ours.weight.copy_(ref.weight)
            ours.weight.grad = None
    if fused:
        assert ours.table.step == 2


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_2d_input(rng, mode):
    ref, ours = _pair(rng, mode, padding_idx=0)
    x = torch.from_numpy(rng.integers(0, ROWS, size=(7, 4)))
    x[0] = 0  # a bag made only of padding: zeros, as PyTorch
    assert max_diff(ours(x), ref(x)) <= 1e-6
    if mode == "sum":
        w = torch.rand(7, 4)
        assert max_diff(ours(x, per_sample_weights=w), ref(x, per_sample_weights=w)) <= 1e-6
    empty = torch.zeros((3, 0), dtype=torch.int64)  # (nn.EmbeddingBag raises here)
    assert ours(empty).shape == (3, DIM) and float(ours(empty).detach().abs().max()) == 0


def test_empty_batch_and_empty_bags(rng):
    ref, ours = _pair(rng, "mean")
    ids, offsets = torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64)
    assert ours(ids, offsets).shape == (0, DIM)
    ids, offsets = torch.tensor([5, 6]), torch.tensor([0, 0, 0, 2])
    assert max_diff(ours(ids, offsets), ref(ids, offsets)) <= 1e-6


def test_sqrtn_matches_numpy(rng):
    w = uniform_weights(rng, ROWS, DIM)
    ours = et.EmbeddingBag.from_pretrained(w, mode="sqrtn", include_last_offset=True, padding_idx=2)
    ids, offsets, _ = bags(rng, ROWS, 11, pad=2)
    want = np.zeros((11, DIM))
    for b in range(11):
        bag = [i for i in ids[offsets[b]:offsets[b + 1]].tolist() if i != 2]
        if bag:
            want[b] = w.numpy()[bag].astype(np.float64).sum(0) / np.sqrt(len(bag))
    np.testing.assert_allclose(ours(ids, offsets).numpy(), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_tables(rng, dtype):
    w = uniform_weights(rng, ROWS, DIM)
    ours = et.EmbeddingBag.from_pretrained(w.to(dtype), freeze=False, mode="sum", optimizer=ec.optimizers.SGD(0.5))
    assert ours.weight.dtype == dtype and ours.table.dtype == str(dtype).split(".")[1]
    assert ours.weight.data_ptr() == ours.table.values().__array_interface__["data"][0]
    out = ours(torch.tensor([1, 2]), torch.tensor([0]))
    assert out.dtype == dtype
    assert max_diff(out, w.to(dtype)[[1, 2]].float().sum(0, keepdim=True)) <= 2e-2
    out.float().sum().backward()  # fused update in the table's dtype
    want = (w.to(dtype)[1].float() - 0.5).to(dtype)
    assert max_diff(ours.weight[1], want) == 0


# ------------------------------------------------------------------ gradients
@pytest.mark.parametrize("padding_idx", [None, 4])
@pytest.mark.parametrize("fused", [False, True])
def test_per_sample_weights_grad(rng, padding_idx, fused):
    w = uniform_weights(rng, ROWS, DIM)
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode="sum", padding_idx=padding_idx)
    ours = et.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum", padding_idx=padding_idx,
                                           optimizer=ec.optimizers.SGD(0.5) if fused else None)
    ids, offsets, psw = bags(rng, ROWS, 10, weighted=True, pad=padding_idx)
    g = torch.randn(10, DIM)
    p1, p2 = psw.clone().requires_grad_(), psw.clone().requires_grad_()
    (ref(ids, offsets[:-1], p1) * g).sum().backward()
    (ours(ids, offsets[:-1], p2) * g).sum().backward()
    assert max_diff(p2.grad, p1.grad) <= 1e-6  # (fused: computed before the update)
    x = torch.from_numpy(rng.integers(0, ROWS, size=(5, 3)))
    q1, q2 = torch.rand(5, 3, requires_grad=True), None
    q2 = q1.detach().clone().requires_grad_()
    ref2 = torch.nn.EmbeddingBag.from_pretrained(ours.weight.detach().clone(), mode="sum", padding_idx=padding_idx)
    ref2(x, per_sample_weights=q1).sum().backward()
    ours(x, per_sample_weights=q2).sum().backward()
    assert max_diff(q2.grad, q1.grad) <= 1e-6


def test_frozen_weight_still_gives_per_sample_weights_grad(rng):
    ref, ours = _pair(rng, "sum")
    ours.weight.requires_grad_(False)
    before = ours.weight.detach().clone()
    ids, offsets, psw = bags(rng, ROWS, 6, weighted=True)
    p1, p2 = psw.clone().requires_grad_(), psw.clone().requires_grad_()
    ref(ids, offsets[:-1], p1).sum().backward()
    ours(ids, offsets[:-1], p2).sum().backward()
    assert max_diff(p2.grad, p1.grad) <= 1e-6
    assert ours.weight.grad is None and torch.equal(ours.weight, before)


@pytest.mark.parametrize("fused", [False, True])
def test_per_sample_weights_grad_refuses_rows_changed_since_forward(rng, fused):
    """The weights' gradient reads the rows in backward. Unfused, an in-place
    change of the weight between forward and backward raises as in PyTorch;
    fused, so does an update of the table by another lookup's backward
    (was: a gradient from the updated rows, silently)."""
    w = uniform_weights(rng, ROWS, DIM)
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode="sum")
    ours = et.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum",
                                           optimizer=ec.optimizers.SGD(0.5) if fused else None)
    ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 2])
    p = torch.ones(3, requires_grad=True)
    if fused:
        out = ours(ids, offsets, p).sum() + 2 * ours(ids, offsets, torch.ones(3, requires_grad=True)).sum()
        with pytest.raises(RuntimeError, match="was updated .* after this lookup and before its backward"):
            out.backward()
    else:
        for m in (ref, ours):
            out = m(ids, offsets, p)
            with torch.no_grad():
                m.weight.add_(1.0)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.sum().backward()
    # Lookups whose weights need no gradient are not concerned.
    out = ours(ids, offsets).sum() + ours(ids, offsets).sum()
    out.backward()


@pytest.mark.parametrize("mode", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("padding_idx", [1, None])
def test_weight_grad_matches_torch(rng, mode, sparse, strided, padding_idx):
    """`strided`: offsets given as a view of every other element (a column of
    a 2-D tensor): the backward reads them as the forward does."""
    w = uniform_weights(rng, ROWS, DIM)
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode="sum" if mode == "sqrtn" else mode,
                                                sparse=sparse, padding_idx=padding_idx, include_last_offset=True)
    ours = et.EmbeddingBag.from_pretrained(w, freeze=False, mode=mode, sparse=sparse, padding_idx=padding_idx,
                                           include_last_offset=True)
    ids, offsets, _ = bags(rng, ROWS, 12, pad=padding_idx)
    if strided:
        offsets = torch.stack([offsets, offsets], 1)[:, 0]
        assert not offsets.is_contiguous()
    g = torch.randn(12, DIM)
    if mode == "sqrtn":  # sqrtn's gradient is the sum's, scaled per bag by 1 / sqrt(non-padding ids)
        n = torch.tensor([max(1, sum(1 for i in ids[offsets[b]:offsets[b + 1]].tolist() if i != padding_idx))
                          for b in range(12)], dtype=torch.float32)
        (ref(ids, offsets) * g / n.sqrt()[:, None]).sum().backward()
    else:
        (ref(ids, offsets) * g).sum().backward()
    (ours(ids, offsets) * g).sum().backward()
    assert ours.weight.grad.is_sparse == sparse
    assert max_diff(ours.weight.grad, ref.weight.grad) <= 1e-6
    if sparse:  # one row per occurrence, like nn.EmbeddingBag(sparse=True)
        assert ours.weight.grad._nnz() == ref.weight.grad._nnz()


def test_embedding_matches_nn_embedding(rng):
    w = uniform_weights(rng, ROWS, DIM)
    ref = torch.nn.Embedding.from_pretrained(w.clone(), freeze=False, padding_idx=3, sparse=True)
    ours = et.Embedding.from_pretrained(w, freeze=False, padding_idx=3, sparse=True)
    x = torch.from_numpy(rng.integers(0, ROWS, size=(4, 5)))
    x[0, :2] = 3
    g = torch.randn(4, 5, DIM)
    a, b = ref(x), ours(x)
    assert b.shape == (4, 5, DIM) and max_diff(a, b) == 0
    (a * g).sum().backward()
    (b * g).sum().backward()
    assert max_diff(ours.weight.grad, ref.weight.grad) <= 1e-6
    assert ours(torch.tensor(7)).shape == (DIM,)


@pytest.mark.parametrize("padding_idx", [-1, -2, -ROWS])
def test_negative_padding_idx_as_torch(rng, padding_idx):
    """A negative padding_idx counts from the end and is held normalized, as
    torch.nn.EmbeddingBag / nn.Embedding hold it: .padding_idx and the repr's
    padding_idx are torch's, built or from_pretrained; the padding row starts
    at zero and a bag leaves it out."""
    import re

    def repr_pad(m):
        return re.search(r"padding_idx=(-?\d+)", repr(m)).group(1)

    for ours, ref in ((et.EmbeddingBag(ROWS, DIM, mode="sum", padding_idx=padding_idx),
                       torch.nn.EmbeddingBag(ROWS, DIM, mode="sum", padding_idx=padding_idx)),
                      (et.Embedding(ROWS, DIM, padding_idx=padding_idx),
                       torch.nn.Embedding(ROWS, DIM, padding_idx=padding_idx))):
        assert ours.padding_idx == ref.padding_idx == padding_idx % ROWS, type(ours)
        assert repr_pad(ours) == repr_pad(ref), (repr(ours), repr(ref))
        assert not ours.weight[ref.padding_idx].any() and not ref.weight[ref.padding_idx].any()
    ref, ours = _pair(rng, padding_idx=padding_idx)
    assert ours.padding_idx == ref.padding_idx and repr_pad(ours) == repr_pad(ref)
    ids, offsets = torch.tensor([ROWS + padding_idx, 1, ROWS + padding_idx, 2]), torch.tensor([0, 2])
    with torch.no_grad():
        assert max_diff(ours(ids, offsets), ref(ids, offsets)) <= 1e-6


def test_default_init_follows_torch_seed():
    torch.manual_seed(5)
    a = et.EmbeddingBag(1000, 16, padding_idx=0)
    torch.manual_seed(5)
    b = et.EmbeddingBag(1000, 16, padding_idx=0)
    c = et.EmbeddingBag(1000, 16)
    assert torch.equal(a.weight, b.weight) and not torch.equal(a.weight, c.weight)
    assert float(a.weight[0].abs().max()) == 0.0
    assert abs(float(c.weight.mean())) < 0.05 and abs(float(c.weight.std()) - 1.0) < 0.05  # N(0, 1), as torch


# ------------------------------------------------------------------ bad inputs
def _errors(m):
    ids = torch.tensor([1, 2, 3, 4])
    return [
        (IndexError, lambda: m(torch.tensor([1, ROWS]), torch.tensor([0]))),
        (IndexError, lambda: m(torch.tensor([1, -1]), torch.tensor([0]))),
        (ValueError, lambda: m(ids, torch.tensor([1, 2]))),
        (ValueError, lambda: m(ids, torch.tensor([0, 5]))),
        (ValueError, lambda: m(ids, torch.tensor([0, 3, 1]))),
        (TypeError, lambda: m(ids.float(), torch.tensor([0, 2]))),
        (TypeError, lambda: m(ids, torch.tensor([0.0, 2.0]))),
        (TypeError, lambda: m(ids, torch.tensor([0, 2]), torch.ones(4, dtype=torch.float64))),
        (ValueError, lambda: m(ids, torch.tensor([0, 2]), torch.ones(3))),
        (ValueError, lambda: m(ids.view(2, 2), torch.tensor([0, 2]))),
        (ValueError, lambda: m(ids)),
        (ValueError, lambda: m(ids.view(1, 2, 2))),
        (ValueError, lambda: m(ids, torch.tensor([[0, 2]]))),
        (TypeError, lambda: m([1, 2], torch.tensor([0]))),
        (NotImplementedError, lambda: m(torch.tensor([1, 2], device="meta"), torch.tensor([0]))),
        # Sparse and nested tensors, by name (they failed inside torch: "can't convert Sparse layout", "view()").
        (TypeError, lambda: m(ids.to_sparse(), torch.tensor([0, 2]))),
        (TypeError, lambda: m(ids, torch.tensor([0, 2]).to_sparse())),
        (TypeError, lambda: m(ids, torch.tensor([0, 2]), torch.ones(4).to_sparse())),
        (TypeError, lambda: m(torch.nested.nested_tensor([ids[:3], ids[3:]], layout=torch.jagged))),
    ]


@pytest.mark.parametrize("fused", [False, True])
def test_bad_inputs_raise_and_change_nothing(rng, fused):
    m = et.EmbeddingBag.from_pretrained(uniform_weights(rng, ROWS, DIM), freeze=False, mode="sum",
                                        optimizer=ec.optimizers.Adam(0.1) if fused else None)
    before = m.weight.detach().clone()
    for i, (exc, call) in enumerate(_errors(m)):
        with pytest.raises(exc):
            call()
    assert torch.equal(m.weight, before) and m.table.step == 0
    with pytest.raises(IndexError, match=f"id {ROWS} at position 1"):
        m(torch.tensor([1, ROWS]), torch.tensor([0]))


def test_bad_id_position_is_in_the_given_ids():
    """The position named is the id's in the caller's tensor, also when
    padding ids before it are left out of the lookup."""
    bag = et.EmbeddingBag(ROWS, DIM, mode="sum", padding_idx=0)
    with pytest.raises(IndexError, match=f"id {ROWS} at position 2 of ids"):
        bag(torch.tensor([0, 0, ROWS, 1]), torch.tensor([0, 3]))
    emb = et.Embedding(ROWS, DIM, padding_idx=1)
    with pytest.raises(IndexError, match="id -3 at position 3 of ids"):
        emb(torch.tensor([[1, 2], [1, -3]]))


def test_offsets_past_the_end_name_the_offset():
    """Without include_last_offset an offset past the ids is named as such
    (was: a decrease against the implicit end, offsets[2] that was not given)."""
    m = et.EmbeddingBag(ROWS, DIM, mode="sum")
    with pytest.raises(ValueError, match=r"offsets\[1\] = 7 is greater than the number of ids \(5\)"):
        m(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 7]))
    m = et.EmbeddingBag(ROWS, DIM, mode="sum", include_last_offset=True)
    with pytest.raises(ValueError, match=r"offsets\[-1\] = 7 is greater than the number of ids \(5\)"):
        m(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 7]))


@pytest.mark.parametrize("include_last_offset", [False, True])
def test_common_call_takes_the_direct_path(rng, monkeypatch, include_last_offset):
    """nn.EmbeddingBag's usual call (1-D int64 ids with offsets, with or
    without the last one) goes to the engine as it is, forward and fused
    backward, without the general path's per-segment work (its Python
    overhead is a tenth of a 2-thread Zipf lookup): same output and step."""
    w = uniform_weights(rng, ROWS, DIM)
    ids = torch.from_numpy(rng.integers(0, ROWS, 30))
    offsets = torch.tensor([0, 4, 4, 17, 30] if include_last_offset else [0, 4, 4, 17])
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode="mean",
                                                include_last_offset=include_last_offset)
    ours = et.EmbeddingBag.from_pretrained(w, freeze=False, mode="mean", include_last_offset=include_last_offset,
                                           optimizer=ec.optimizers.SGD(0.5))
    general = et._ops._parts

    def refuse(*args, **kw):
        raise AssertionError("the general path ran")

    monkeypatch.setattr(et._ops, "_parts", refuse)
    out = ours(ids, offsets)
    expected = ref(ids, offsets)
    assert max_diff(out, expected) <= 1e-6
    out.sum().backward()
    expected.sum().backward()
    with torch.no_grad():
        stepped = w - 0.5 * ref.weight.grad
    assert max_diff(ours.weight, stepped) <= 1e-6
    # A bad offset still gets the general path's message.
    monkeypatch.setattr(et._ops, "_parts", general)
    with pytest.raises(ValueError, match=r"offsets\[(1|-1)\] = 31 is greater than the number of ids \(30\)"):
        ours(ids, torch.tensor([0, 31, 31, 31, 31][:len(offsets)]))
    assert max_diff(ours.weight, stepped) <= 1e-6


def test_bad_configurations():
    with pytest.raises(NotImplementedError):
        et.EmbeddingBag(10, 4, mode="max")
    with pytest.raises(ValueError):
        et.EmbeddingBag(10, 4, mode="median")
    with pytest.raises(NotImplementedError):
        et.EmbeddingBag(10, 4, max_norm=1.0)
    with pytest.raises(NotImplementedError):
        et.EmbeddingBag(10, 4, scale_grad_by_freq=True)
    with pytest.raises(ValueError):
        et.EmbeddingBag(10, 4, padding_idx=10)
    with pytest.raises(TypeError, match="padding_idx must be an int, got 2.7"):
        et.EmbeddingBag(10, 4, padding_idx=2.7)
    with pytest.raises(ValueError):
        et.EmbeddingBag(0, 4)
    with pytest.raises(TypeError):
        et.EmbeddingBag(10, 4, optimizer=torch.optim.SGD)
    with pytest.raises(TypeError):
        et.EmbeddingBag(10, 4, dtype=torch.float64)
    with pytest.raises(NotImplementedError):
        et.EmbeddingBag(10, 4, device="meta")
    # PyTorch's default device, as nn.EmbeddingBag takes it (TorchRec's idiom of building under meta; was
    # RuntimeError "Tensor.item() cannot be called on meta tensors")
    with torch.device("meta"), pytest.raises(NotImplementedError, match="default device \\(meta"):
        et.EmbeddingBag(10, 4)
    with torch.device("meta"), pytest.raises(NotImplementedError, match="default device \\(meta"):
        et.EmbeddingBagCollection([et.EmbeddingBagConfig(10, 4, name="t", feature_names=["f"])])
    m = et.EmbeddingBag(10, 4, mode="mean")
    with pytest.raises(NotImplementedError, match="per_sample_weights"):
        m(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(2))
    m = et.EmbeddingBag(10, 4, include_last_offset=True)
    with pytest.raises(ValueError, match="include_last_offset"):
        m(torch.tensor([1, 2]), torch.tensor([], dtype=torch.int64))
    with pytest.raises(ValueError):
        et.EmbeddingBag(10, 4, _weight=torch.zeros(3, 4))


@pytest.mark.parametrize("cls", [et.EmbeddingBag, et.Embedding])
def test_initial_weights_a_table_cannot_hold_are_refused(cls):
    """from_pretrained, _weight= and an init_fn (a collection config's)
    refuse values that are not finite or beyond the storage dtype, as
    load_state_dict and Table.assign do (were stored as inf / NaN, returned
    by lookups, and refused only at a later ec.save)."""
    w = torch.zeros(6, 4)
    w[2, 1] = 1e5
    with pytest.raises(ValueError, match=r"the initial weight .*\[2, 1\] = 100000.0 is beyond the range of the "
                                         r"table's storage dtype float16"):
        cls.from_pretrained(w, dtype=torch.float16)
    cls.from_pretrained(w)  # float32 holds it
    w[3, 0] = float("nan")
    with pytest.raises(ValueError, match=r"the initial weight .*\[3, 0\] = nan is not finite"):
        cls(6, 4, _weight=w)
    with pytest.raises(ValueError, match=r"the weight its init_fn .* wrote\[0, 0\] = inf is not finite"):
        et.EmbeddingBagCollection([et.EmbeddingBagConfig(num_embeddings=6, embedding_dim=4, name="t",
                                                         feature_names=["f"],
                                                         init_fn=lambda t: t.fill_(float("inf")))])


@pytest.mark.parametrize("cls", [et.EmbeddingBag, et.Embedding])
def test_from_pretrained_takes_float_tensors_as_torch(cls):
    """A float64 tensor (any NumPy array's default) needs dtype= (no table
    holds float64; the message said only which dtypes are allowed), and an
    integer tensor needs it too, as PyTorch refuses one that trains (it
    became a float32 table; a frozen torch Embedding keeps integer weights,
    which no table holds)."""
    w = np.random.default_rng(0).standard_normal((6, 3))
    with pytest.raises(TypeError, match=rf"{cls.__name__}.from_pretrained: embeddings are torch.float64, .* pass "
                                        r"dtype=torch.float32"):
        cls.from_pretrained(torch.from_numpy(w))
    with pytest.raises(RuntimeError):
        getattr(torch.nn, cls.__name__).from_pretrained(torch.arange(18).reshape(6, 3), freeze=False)
    with pytest.raises(TypeError, match="embeddings must be a floating-point tensor, got torch.int64"):
        cls.from_pretrained(torch.arange(18).reshape(6, 3))
    with pytest.raises(TypeError, match=rf"{cls.__name__}.from_pretrained: embeddings is a torch.sparse_coo tensor"):
        cls.from_pretrained(torch.from_numpy(w).float().to_sparse())
    m = cls.from_pretrained(torch.from_numpy(w), dtype=torch.float32)
    assert m.weight.dtype == torch.float32
    np.testing.assert_array_equal(m.weight.detach().numpy(), w.astype(np.float32))
    m = cls.from_pretrained(torch.arange(18).reshape(6, 3), dtype=torch.float32)  # converted when dtype= says so
    np.testing.assert_array_equal(m.weight.detach().numpy(), np.arange(18, dtype=np.float32).reshape(6, 3))


def test_lazily_negated_per_sample_weights_are_read_with_their_sign():
    """Per-id weights that PyTorch holds lazily negated (``z.conj().imag``:
    float32 with the negative bit, whose ``numpy()`` it refuses) give
    nn.EmbeddingBag's outputs, in a module and a collection's dict feature
    (were PyTorch's RuntimeError from inside the adapter)."""
    z = torch.complex(torch.zeros(4), torch.tensor([-0.5, -2.0, 1.0, -3.0]))
    psw = z.conj().imag
    assert psw.is_neg() and psw.dtype == torch.float32
    ids, offsets = torch.tensor([1, 2, 3, 9]), torch.tensor([0, 2])
    ref = torch.nn.EmbeddingBag(10, 3, mode="sum")
    want = ref(ids, offsets, per_sample_weights=psw.resolve_neg()).detach()
    m = et.EmbeddingBag(10, 3, mode="sum", optimizer=ec.optimizers.SGD(0.1))
    with torch.no_grad():
        m.weight.copy_(ref.weight)
    assert max_diff(m(ids, offsets, per_sample_weights=psw), want) <= 1e-6
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(num_embeddings=10, embedding_dim=3, name="t",
                                                           feature_names=["f"])])
    with torch.no_grad():
        ebc.embedding_bags["t"].weight.copy_(ref.weight)
    assert max_diff(ebc({"f": (ids, torch.tensor([0, 2, 4]), psw)})["f"], want) <= 1e-6


def test_a_parametrized_or_pruned_weight_is_refused_naming_it():
    """torch.nn.utils.parametrize / prune take the weight out of the
    module's parameters: every lookup raises NotImplementedError saying so
    (was KeyError: 'weight')."""
    import torch.nn.utils.parametrize as parametrize
    import torch.nn.utils.prune as prune

    class Twice(torch.nn.Module):
        def forward(self, x):
            return x * 2

    m = et.EmbeddingBag(10, 4)
    parametrize.register_parametrization(m, "weight", Twice())
    with pytest.raises(NotImplementedError, match="parametrization"):
        m(torch.tensor([1, 2]), torch.tensor([0]))
    e = et.Embedding(10, 4)
    prune.l1_unstructured(e, "weight", amount=0.5)
    with pytest.raises(NotImplementedError, match="parametrization"):
        e(torch.tensor([1, 2]))
