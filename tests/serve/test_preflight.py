"""dsv41-serve's checks before anything loads, and the text/template pieces, without a server."""
import argparse
import subprocess
import sys

import pytest
from tokenizers import Tokenizer

from runtime.budget import DoesNotFit
from runtime.cli.serve import preflight
from runtime.serve.chat import ChatTemplate
from runtime.serve.text import TextStream


def _args(profile, checkpoint=None, force=False):
    return argparse.Namespace(profile=str(profile), checkpoint=None if checkpoint is None else str(checkpoint), force=force)


def test_the_shipped_profile_is_refused_here_naming_what_differs(tiny_dir, shipped):
    with pytest.raises(ValueError) as e:
        preflight(_args(shipped, tiny_dir))
    msg = str(e.value)
    assert "cpu_model" in msg and "ram_gib" in msg and "model geometry" in msg and "--force" in msg
    warned = []
    ck, plan, _, _ = preflight(_args(shipped, tiny_dir, force=True), warn=warned.append)
    assert any("cpu_model" in w for w in warned) and plan.geometry_hash == ck.footprint().geometry_hash


def test_the_cli_exits_2_with_the_reason(tiny_dir, shipped):
    r = subprocess.run([sys.executable, "-m", "runtime.cli.serve", "--profile", str(shipped), "--checkpoint", str(tiny_dir)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "made for another host or model" in r.stderr


def test_no_checkpoint_says_how_to_give_one(tiny_dir, tmp_path, monkeypatch, host_profile):
    monkeypatch.delenv("DSV41_CHECKPOINT", raising=False)
    prof = host_profile(tiny_dir, tmp_path / "p.json")
    with pytest.raises(ValueError, match="--checkpoint DIR or \\$DSV41_CHECKPOINT"):
        preflight(_args(prof))
    monkeypatch.setenv("DSV41_CHECKPOINT", str(tiny_dir))
    ck, *_ = preflight(_args(prof))
    assert ck.root == tiny_dir


def test_a_plan_that_does_not_fit_is_refused(tiny_dir, tmp_path, host_profile):
    prof = host_profile(tiny_dir, tmp_path / "p.json", vram_budget_gib=0.0)
    with pytest.raises(DoesNotFit, match="vram_budget_gib"):
        preflight(_args(prof, tiny_dir))


def test_text_stream_holds_partial_characters_and_finds_stops_across_tokens(tiny_dir):
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    text = "héllo wörld, the end. more"
    ids = tok.encode(text).ids
    ts = TextStream(tok)
    out = "".join(ts.push(i) for i in ids) + ts.flush()
    assert out == text and "\ufffd" not in out
    ts = TextStream(tok, stop=["end."])
    out = "".join(ts.push(i) for i in ids)
    assert ts.stopped and out == "héllo wörld, the " and ts.flush() == ""


def test_chat_template_renders_roles_and_refuses_unknown_ones(tmp_path):
    t = ChatTemplate()
    s = t.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert s == "<|system|>\nS\n<|user|>\nU\n<|assistant|>\n"
    with pytest.raises(ValueError, match="role"):
        t.render([{"role": "wizard", "content": "x"}])
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}>>")
    assert ChatTemplate(f).render([{"role": "user", "content": "hi"}]) == "[user] hi >>"
    f.write_text("{% for m in messages %")
    with pytest.raises(ValueError, match="t.jinja"):
        ChatTemplate(f)
