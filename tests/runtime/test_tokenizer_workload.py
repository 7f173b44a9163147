from collections import Counter

import numpy as np
import pytest

from runtime.tokenizer import build_tokenizer, compressed_vocab, corpus, normalize
from runtime.workload import Workload, make_prompt, make_prompts


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(512)


def test_tokenizer_is_deterministic_and_exact_size(tok):
    again = build_tokenizer(512)
    assert tok.get_vocab_size() == 512
    assert tok.to_str() == again.to_str()


def test_normalize_collapses_case_space_accents():
    assert normalize(" The") == normalize("the") == normalize("THE") == "the"
    assert normalize("Café\u00a0 au\tlait") == "cafe au lait"
    assert normalize("ﬁle") == "file"   # NFKC ligature


def test_compressed_vocab_is_a_many_to_one_map(tok):
    m = compressed_vocab(tok)
    assert m.shape == (512,) and m.min() == 0
    size = int(m.max()) + 1
    assert 0 < size < 512 and len(np.unique(m)) == size
    vocab = tok.get_vocab()
    # a word with and without its leading space (byte-level 'Ġ') shares one compressed id
    pairs = [(w, "Ġ" + w) for w in vocab if "Ġ" + w in vocab and w.isalpha()]
    assert pairs and all(m[vocab[a]] == m[vocab[b]] for a, b in pairs)


def test_prompts_exact_length_deterministic_and_fresh(tok):
    a = make_prompt(tok, 300, seed=1)
    assert len(a) == 300 and a == make_prompt(tok, 300, seed=1)
    assert a != make_prompt(tok, 300, seed=2)
    long = make_prompt(tok, 200_000, seed=3)           # longer than the corpus: wraps elsewhere
    assert len(long) == 200_000
    ps = make_prompts(tok, 50, 4, seed=0)
    assert len({tuple(p) for p in ps}) == 4


def test_prompts_are_natural_text_with_ngram_reuse(tok):
    ids = make_prompt(tok, 4000, seed=0)
    text = tok.decode(ids)
    assert sum(c.isalpha() for c in text) > 0.6 * len(text)
    bigrams = Counter(zip(ids, ids[1:]))
    # Zipf-like reuse: the most common bigrams repeat far more than a uniform draw would
    rnd = np.random.default_rng(0).integers(0, 512, 4000)
    assert bigrams.most_common(1)[0][1] > 5 * Counter(zip(rnd, rnd[1:])).most_common(1)[0][1]
    assert len(bigrams) < 0.8 * (len(ids) - 1)


def test_corpus_is_substantial():
    paras = corpus()
    assert len(paras) > 1000 and sum(map(len, paras)) > 200_000


def test_workload_validation():
    with pytest.raises(ValueError):
        Workload(prompt_tokens=0)
    with pytest.raises(ValueError):
        make_prompt(None, 0)
