"""jobs/ngram.py: the count models that set the LM's floor, against counts and probabilities written out
here with Python dictionaries."""
import collections
import math
import os
import sys

import numpy as np
import pytest

from tests.launch import ROOT

sys.path.insert(0, os.path.join(ROOT, "jobs"))
import ngram  # noqa: E402


def _text(n, seed):
    rng = np.random.default_rng(seed)
    # a skewed alphabet so that the orders differ
    return rng.choice(np.frombuffer(b"abcdeab  \n", dtype=np.uint8), size=n).astype(np.uint8)


def test_counts_match_a_dictionary():
    t = _text(2000, 0)
    c1, c2, c3 = ngram.counts(t)
    tri = collections.Counter(zip(t[:-2], t[1:-1], t[2:]))
    for (a, b, c), n in list(tri.items())[:20]:
        assert c3[a, b, c] == n
    assert c1.sum() == len(t) and c2.sum() == len(t) - 1 and c3.sum() == len(t) - 2


def test_interpolated_loss_by_hand():
    train, val = _text(5000, 1), _text(170, 2)
    x, y = val[:160].reshape(10, 16), val[1:161].reshape(10, 16)
    lam = np.array([0.1, 0.2, 0.3, 0.4])
    uni = collections.Counter(train.tolist())
    bi = collections.Counter(zip(train[:-1].tolist(), train[1:].tolist()))
    tri = collections.Counter(zip(train[:-2].tolist(), train[1:-1].tolist(), train[2:].tolist()))
    nll = []
    for w in range(10):
        for t in range(16):
            b, target = int(x[w, t]), int(y[w, t])
            p1 = uni[target] / len(train)
            nb = sum(v for (i, _), v in bi.items() if i == b)
            p2 = bi[(b, target)] / nb if nb else 0.0
            if t == 0:             # one byte of context: the trigram's share backs off to the bigram
                p3 = p2
            else:
                a = int(x[w, t - 1])
                na = sum(v for (i, j, _), v in tri.items() if (i, j) == (a, b))
                p3 = tri[(a, b, target)] / na if na else 0.0
            nll.append(-math.log(lam[0] / 256 + lam[1] * p1 + lam[2] * p2 + lam[3] * p3))
    assert ngram.loss(ngram.counts(train), lam, x, y) == pytest.approx(np.mean(nll), rel=1e-12)


def test_fitted_weights():
    t = _text(20000, 3)
    for order in (1, 2, 3):
        lam = ngram.fit_lambdas(t, order)
        assert lam.sum() == pytest.approx(1.0) and (lam[order + 1:] == 0).all() and lam[0] > 0
    # EM beats equal weights on the held-out part it was fitted on
    cut = int(len(t) * 0.9)
    held = t[cut:]
    x, y = held[:-1][: len(held) // 65 * 64].reshape(-1, 64), held[1:][: len(held) // 65 * 64].reshape(-1, 64)
    c = ngram.counts(t[:cut])
    assert ngram.loss(c, ngram.fit_lambdas(t, 3), x, y) <= ngram.loss(c, [0.25] * 4, x, y)


def test_a_periodic_text_is_predictable():
    t = np.frombuffer(b"abc" * 400, dtype=np.uint8)
    x, y = t[:96].reshape(4, 24), t[1:97].reshape(4, 24)
    c = ngram.counts(t)
    assert ngram.loss(c, [0, 0, 0, 1], x, y) == pytest.approx(0.0, abs=1e-12)
    assert ngram.loss(c, [1, 0, 0, 0], x, y) == pytest.approx(math.log(256))
    base = ngram.baselines(t, x, y)
    assert base["trigram"] < base["unigram"] and base["bigram"] < 0.1
