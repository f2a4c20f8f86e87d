"""Count-based byte n-gram models: the floor a language model's target must be below.

A byte-level transformer whose validation loss is above an interpolated trigram table of the same
training text has learnt less than counting does; a time-to-target comparison at such a target
measures the warm-up, not training. ``baselines`` gives the unigram, bigram and interpolated trigram
losses (nats per byte) on exactly the predictions a ``models.TextData`` validation set scores.

    python jobs/ngram.py          # the three losses on the e2e LM's split (512 windows of 64)
"""
import numpy as np

V = 256


def counts(text):
    """``(c1, c2, c3)``: unigram (256,), bigram (256, 256) and trigram (256, 256, 256) counts of ``text``
    (a uint8 array), float64."""
    t = np.asarray(text, dtype=np.int64)
    c1 = np.bincount(t, minlength=V).astype(np.float64)
    c2 = np.bincount(t[:-1] * V + t[1:], minlength=V * V).astype(np.float64).reshape(V, V)
    c3 = np.bincount((t[:-2] * V + t[1:-1]) * V + t[2:], minlength=V ** 3).astype(np.float64).reshape(V, V, V)
    return c1, c2, c3


def _orders(c, a, b, y):
    """Per prediction: the uniform, unigram, bigram and trigram probabilities of ``y`` after ``(a, b)``
    (an order whose context was never seen gives 0; interpolation weights fill in)."""
    c1, c2, c3 = c
    p0 = np.full(y.shape, 1.0 / V)
    p1 = c1[y] / c1.sum()
    n2 = c2.sum(axis=1)[b]
    p2 = np.divide(c2[b, y], n2, out=np.zeros(y.shape), where=n2 > 0)
    n3 = c3[a, b].sum(axis=-1) if a.size else np.zeros(0)
    p3 = np.divide(c3[a, b, y], n3, out=np.zeros(y.shape), where=n3 > 0)
    return np.stack([p0, p1, p2, p3])


def _contexts(x, y):
    """``(a, b, y, has_a)`` flattened: the two bytes before each target of windows ``x`` -> ``y`` (the
    first prediction of a window has one byte of context, ``has_a`` False)."""
    x, y = np.asarray(x, dtype=np.int64), np.asarray(y, dtype=np.int64)
    a = np.concatenate([x[:, :1], x[:, :-1]], axis=1)        # placeholder for t = 0, masked out
    has_a = np.ones_like(x, dtype=bool)
    has_a[:, 0] = False
    return a.ravel(), x.ravel(), y.ravel(), has_a.ravel()


def _probabilities(c, x, y):
    """(4, n): each order's probability of every target; where a window gives one byte of context the
    trigram row holds the bigram's (the model backs off)."""
    a, b, yy, has_a = _contexts(x, y)
    p = _orders(c, a, b, yy)
    p[3] = np.where(has_a, p[3], p[2])
    return p


def loss(c, lambdas, x, y):
    """Mean negative log-likelihood (nats per byte) of targets ``y`` given windows ``x`` under the
    interpolated model ``sum_i lambdas[i] * p_i`` (uniform, unigram, bigram, trigram)."""
    return float(-np.mean(np.log(np.asarray(lambdas, dtype=np.float64) @ _probabilities(c, x, y))))


def _windows(text, n=64):
    m = (len(text) - 1) // (n + 1) * (n + 1)
    starts = range(0, m, n + 1)
    return (np.stack([text[i:i + n] for i in starts]), np.stack([text[i + 1:i + n + 1] for i in starts]))


def fit_lambdas(text, order, holdout=0.1, iterations=50):
    """Interpolation weights for an ``order``-gram (1..3) that maximise the likelihood of the last
    ``holdout`` of ``text`` under counts of the rest (EM, "deleted interpolation"); the weights of
    orders above ``order`` are 0. The uniform keeps a share, so no byte has probability 0."""
    text = np.asarray(text)
    cut = int(len(text) * (1 - holdout))
    p = _probabilities(counts(text[:cut]), *_windows(text[cut:]))[:order + 1]
    lam = np.full(order + 1, 1.0 / (order + 1))
    for _ in range(iterations):
        post = lam[:, None] * p
        post /= post.sum(axis=0)
        lam = post.mean(axis=1)
    return np.concatenate([lam, np.zeros(3 - order)])


def baselines(train, x, y):
    """``{"unigram": ..., "bigram": ..., "trigram": ...}``: validation losses (nats per byte) on windows
    ``x`` -> ``y`` of count models of ``train``, interpolation weights fitted on train's last tenth."""
    c = counts(train)
    return {name: loss(c, fit_lambdas(train, order), x, y)
            for order, name in ((1, "unigram"), (2, "bigram"), (3, "trigram"))}


if __name__ == "__main__":
    import models

    tr, va = models.stdlib_corpus()
    d = models.TextData(tr, va, seq=64, val_windows=512, val_seq=64)
    print({k: round(v, 4) for k, v in baselines(tr, d.val_x.numpy(), d.val_y.numpy()).items()},
          f"on {d.val_y.numel():,} predictions")
