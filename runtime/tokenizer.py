"""A real tokenizer built locally, the local text corpus, and the Engram compressed vocabulary.

The corpus is natural English gathered on this machine with no download: the docstrings of a fixed
list of Python standard-library modules and their public members, in a fixed order. It is the text
behind every synthetic checkpoint's tokenizer (a byte-level BPE trained with Hugging Face
`tokenizers` to the config's vocab size) and behind the workload generator's prompts, so n-gram
reuse, Engram row-cache hit rates and expert popularity behave as on real text.

The compressed vocabulary follows the Engram description: decode each token, NFKC-normalize, strip
accents, lowercase, collapse whitespace and trim; tokens with the same normalized form share one
compressed id (" The", "the" and "THE" collapse to one).
"""
from __future__ import annotations

import importlib
import inspect
import re
import unicodedata
import warnings
from functools import lru_cache

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS_MODULES = (
    "abc argparse array ast asyncio base64 bisect builtins calendar cmath codecs collections "
    "concurrent.futures configparser contextlib copy csv dataclasses datetime decimal difflib dis "
    "doctest email enum filecmp fnmatch fractions ftplib functools getopt gettext glob gzip hashlib "
    "heapq hmac html http.client http.server imaplib importlib inspect io ipaddress itertools json "
    "logging lzma mailbox math mimetypes multiprocessing netrc numbers operator optparse os pathlib "
    "pdb pickle pkgutil platform plistlib poplib pprint profile pydoc queue quopri random re "
    "sched secrets selectors shelve shlex shutil signal smtplib socket socketserver sqlite3 ssl "
    "stat statistics string struct subprocess sysconfig tarfile tempfile textwrap threading "
    "timeit tkinter token tokenize trace traceback types typing unittest urllib.parse "
    "urllib.request uuid warnings wave weakref xml.dom.minidom xml.etree.ElementTree zipfile zoneinfo"
).split()


@lru_cache(maxsize=1)
def corpus() -> tuple[str, ...]:
    """Paragraphs of natural text, deterministic for a given Python version."""
    paras, seen = [], set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for modname in CORPUS_MODULES:
            try:
                mod = importlib.import_module(modname)
            except Exception:  # a module this Python lacks (tkinter on slim builds): skip it
                continue
            docs = [inspect.getdoc(mod)]
            for name in sorted(getattr(mod, "__all__", None) or dir(mod)):
                if name.startswith("_"):
                    continue
                obj = getattr(mod, name, None)
                if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj):
                    docs.append(inspect.getdoc(obj))
            for doc in docs:
                for p in re.split(r"\n\s*\n", doc or ""):
                    p = " ".join(p.split())
                    if len(p) >= 40 and p not in seen:
                        seen.add(p)
                        paras.append(p)
    return tuple(paras)


# DeepSeek's conversation markers (as in the V3 tokenizer): special tokens, so text can never produce them
SPECIAL = {"bos": "<｜begin▁of▁sentence｜>", "eos": "<｜end▁of▁sentence｜>", "user": "<｜User｜>", "assistant": "<｜Assistant｜>"}


def special_ids(tok: Tokenizer) -> dict:
    """{bos, eos, user, assistant} -> token id (None where the tokenizer lacks it; a tokenizer made
    before the markers has `<eos>` as its end of sentence)."""
    out = {k: tok.token_to_id(v) for k, v in SPECIAL.items()}
    if out["eos"] is None:
        out["eos"] = tok.token_to_id("<eos>")
    return out


def without_specials(tok: Tokenizer) -> Tokenizer:
    """The same tokenizer with no added tokens: marker strings inside user text encode as plain text."""
    import json
    d = json.loads(tok.to_str())
    d["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(d))


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE trained on the local corpus to exactly `vocab_size` tokens (deterministic), the
    conversation markers (SPECIAL) its first ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=list(SPECIAL.values()))
    tok.train_from_iterator(corpus(), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"the local corpus yields only {tok.get_vocab_size()} BPE tokens, the config asks for {vocab_size}")
    return tok


def normalize(text: str) -> str:
    t = unicodedata.normalize("NFKC", text)
    t = "".join(ch for ch in unicodedata.normalize("NFD", t) if unicodedata.category(ch) != "Mn")
    return " ".join(t.lower().split())


def compressed_vocab(tok: Tokenizer) -> np.ndarray:
    """int32 [V]: token id -> compressed id (ids assigned in order of first appearance by token id)."""
    ids, out = {}, np.empty(tok.get_vocab_size(), dtype=np.int32)
    for t in range(tok.get_vocab_size()):
        key = normalize(tok.decode([t], skip_special_tokens=False))
        out[t] = ids.setdefault(key, len(ids))
    return out
