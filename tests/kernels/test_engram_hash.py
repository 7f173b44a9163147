import numpy as np
import pytest

from kernels.engram_hash import engram_rows, engram_rows_reference, slot_ranges, slot_seeds


def _is_prime(n):
    return n > 1 and all(n % f for f in range(2, int(n ** 0.5) + 1))


def test_slot_ranges_are_distinct_primes_inside_the_table():
    primes, offsets = slot_ranges(384006168, 24)
    assert len(set(primes.tolist())) == 24 and all(_is_prime(int(p)) for p in primes[:3])
    assert offsets[-1] + primes[-1] <= 384006168 and (np.diff(offsets) == primes[:-1]).all()
    with pytest.raises(ValueError, match="cannot hold"):
        slot_ranges(10, 24)


@pytest.mark.parametrize("seed,T,start,max_ngram,heads", [(0, 50, 0, 4, 2), (1, 7, 3, 4, 8), (2, 1, 0, 3, 1), (3, 300, 299, 4, 8)])
def test_matches_python_reference(seed, T, start, max_ngram, heads):
    rng = np.random.default_rng(seed)
    S = (max_ngram - 1) * heads
    primes, offsets = slot_ranges(rng.integers(5000, 100000), S)
    seeds = slot_seeds(int(rng.integers(0, 40)), S)
    pad = 999
    cids = rng.integers(0, pad, T)
    rows = engram_rows(cids, start, pad, max_ngram, heads, primes, offsets, seeds)
    assert np.array_equal(rows, engram_rows_reference(cids, start, pad, max_ngram, heads, primes, offsets, seeds))
    assert rows.shape == (T - start, S)
    assert ((rows >= offsets) & (rows < offsets + primes)).all()


def test_rows_depend_only_on_the_ngram():
    S = 6
    primes, offsets = slot_ranges(4000, S)
    seeds = slot_seeds(1, S)
    a = np.array([5, 6, 7, 8, 9, 10])
    b = np.array([1, 2, 7, 8, 9, 10])           # same last 4 tokens at the end
    ra = engram_rows(a, 5, 50, 4, 2, primes, offsets, seeds)
    rb = engram_rows(b, 5, 50, 4, 2, primes, offsets, seeds)
    assert np.array_equal(ra, rb)
    c = np.array([1, 2, 7, 8, 9, 11])           # a different last token changes every order
    rc = engram_rows(c, 5, 50, 4, 2, primes, offsets, seeds)
    assert (rc != ra).all()


@pytest.mark.parametrize("start", [0, 1, 3, 4, 40])
def test_a_sequence_cut_where_the_ngrams_reach_gives_the_same_rows(start):
    """The runtime hashes only the tokens from start - (max_ngram - 1) (runtime/model/transformer.py
    _engram_row_ids), not the whole sequence: the rows of positions start.. are the same."""
    S, n = 6, 4
    primes, offsets = slot_ranges(4000, S)
    seeds = slot_seeds(2, S)
    cids = np.random.default_rng(start).integers(0, 50, 48)
    lo = max(0, start - (n - 1))
    whole = engram_rows(cids, start, 50, n, 2, primes, offsets, seeds)
    assert np.array_equal(engram_rows(cids[lo:], start - lo, 50, n, 2, primes, offsets, seeds), whole)
