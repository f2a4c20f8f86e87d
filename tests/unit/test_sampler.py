"""jobs/sampler.py: the lm's global batch is the same at any number of ranks, split without overlap,
and the ranks' loss weights make the mean of their gradients the global batch's gradient."""
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

from sampler import GlobalBatch  # noqa: E402

TEXT = torch.arange(5000, dtype=torch.int64) % 251   # windows identified by their first byte's offset
SEQ, PER_RANK, START = 8, 3, 4                      # global batch of 12 windows


def _sampler(rank, nranks, seed=0):
    return GlobalBatch(TEXT, seq=SEQ, per_rank=PER_RANK, start_ranks=START, seed=seed, rank=rank, nranks=nranks)


def _windows(step, nranks, seed=0):
    """Every rank's windows of ``step`` as ``(rank, tuple of bytes)`` pairs."""
    out = []
    for r in range(nranks):
        x, y, _ = _sampler(r, nranks, seed).batch(step)
        assert x.shape == y.shape == (x.shape[0], SEQ) and torch.equal(x[:, 1:], y[:, :-1])
        out += [(r, tuple(w.tolist()) + (int(t[-1]),)) for w, t in zip(x, y)]
    return out


@pytest.mark.parametrize("step", [0, 7])
def test_the_union_over_ranks_is_the_same_batch_at_one_to_five_ranks(step):
    want = sorted(w for _, w in _windows(step, 1))
    assert len(want) == PER_RANK * START
    assert all((w[i + 1] - w[i]) % 251 == 1 for w in want for i in range(SEQ))   # windows of the text
    for p in range(2, 6):
        got = _windows(step, p)
        assert sorted(w for _, w in got) == want, p   # the same multiset: nothing lost, nothing twice
        positions = [i for r in range(p) for i in _sampler(r, p).indices()]
        assert sorted(positions) == list(range(PER_RANK * START)), p   # disjoint, and every window
    assert _windows(step, 3) != _windows(step + 1, 3)   # another step, another batch


def test_the_batch_depends_on_the_seed_and_not_on_earlier_draws():
    a = _sampler(1, 3)
    first = a.batch(5)[0]
    a.batch(6)
    assert torch.equal(a.batch(5)[0], first)
    assert not torch.equal(_sampler(1, 3, seed=1).batch(5)[0], first)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 7, 12, 13])
def test_weights_make_the_mean_over_ranks_the_global_mean(p):
    """sum_r weight_r * mean_r / P == mean over the global batch, for per-window values, at any P
    (a rank with no windows, P > N, has weight 0)."""
    n = PER_RANK * START
    values = torch.arange(n, dtype=torch.float64) ** 2   # any per-window loss
    total = 0.0
    for r in range(p):
        s = _sampler(r, p)
        idx = list(s.indices())
        w = s.weight()
        assert w == pytest.approx(len(idx) * p / n)
        if idx:
            total += w * float(values[idx].mean()) / p
        else:
            assert w == 0 and s.batch(0)[0].shape == (0, SEQ)
    assert total == pytest.approx(float(values.mean()), rel=1e-12)


def test_gradients_average_to_the_global_batch_gradient():
    """A linear model's per-rank weighted-loss gradients, averaged over the ranks, equal the
    gradient of the mean loss over the global batch (P=5: unequal shares, weights other than 1)."""
    torch.manual_seed(0)
    emb = torch.randn(251, 1, dtype=torch.float64)

    def loss(x, y, grad_of):
        return ((grad_of[x].squeeze(-1) - y.double()) ** 2).mean()

    p = 5
    grads = []
    for r in range(p):
        x, y, w = _sampler(r, p).batch(2)
        e = emb.clone().requires_grad_(True)
        (loss(x, y, e) * w).backward()
        grads.append(e.grad)
    x, y, _ = _sampler(0, 1).batch(2)
    e = emb.clone().requires_grad_(True)
    loss(x, y, e).backward()
    assert torch.allclose(sum(grads) / p, e.grad, rtol=1e-12, atol=1e-14)


def test_rebind_moves_to_another_rank_and_size():
    s = _sampler(3, 4)
    s.rebind(1, 3)
    assert torch.equal(s.batch(4)[0], _sampler(1, 3).batch(4)[0]) and s.weight() == _sampler(1, 3).weight()
    for bad in [(3, 3), (-1, 2), (0, 0)]:
        with pytest.raises(ValueError):
            s.rebind(*bad)
    assert (s.rank, s.nranks) == (1, 3)   # a refused rebind changes nothing
