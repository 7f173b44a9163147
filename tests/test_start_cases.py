"""tests/conftest.py `start_cases`: a module's subprocess cases started two at a time, only those the
session selected, a skip inside a case carried to the test that awaits it."""
import threading
from types import SimpleNamespace

import pytest


def test_only_the_selected_cases_start_and_a_skip_reaches_the_test(start_cases):
    mod = object()

    def item(case, fixtures=("runs",), module=mod):
        return SimpleNamespace(module=module, fixturenames=list(fixtures), callspec=SimpleNamespace(id=case))
    request = SimpleNamespace(module=mod, fixturename="runs", session=SimpleNamespace(
        items=[item("a"), item("b"), item("c", fixtures=("other",)), item("d", module=object())]))
    ran, threads = [], set()

    def job(case):
        ran.append(case)
        threads.add(threading.get_ident())
        return case * 2

    def skipper():
        pytest.skip("this CPU cannot run it")
    jobs = {"a": (job, "a"), "b": (skipper,), "c": (job, "c"), "d": (job, "d")}
    with start_cases(request, jobs) as runs:
        assert set(runs) == {"a", "b"}                     # c: another fixture's test; d: another module's
        assert runs["a"].result() == "aa"
        with pytest.raises(pytest.skip.Exception, match="cannot run it"):
            runs["b"].result()
    assert ran == ["a"] and threading.get_ident() not in threads
