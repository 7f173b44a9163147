"""The HTML report in a real browser: headless Chromium loads report.html, every image decodes and no
script error occurs. In CI Chromium is installed (.ci/run) and this must run; elsewhere, without it,
the test skips saying so."""
import os
import shutil
import subprocess

import pytest

from reports.report import build

PROBE = """<script>
window.__errors = [];
window.addEventListener('error', e => window.__errors.push(String(e.message || e.type)), true);
window.addEventListener('load', () => {
  const imgs = Array.from(document.images);
  const bad = imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.alt);
  const out = document.createElement('pre');
  out.id = 'dsv41-probe';
  out.textContent = JSON.stringify({images: imgs.length, broken: bad, errors: window.__errors});
  document.body.appendChild(out);
});
</script>"""


def chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


def test_the_report_renders_in_headless_chromium(shipped, tuned, tmp_path):
    exe = chromium()
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install Chromium (.ci/run) to check the HTML report in a browser")
        pytest.skip("no Chromium on this machine (Debian package `chromium`): the HTML report is not checked in a browser")
    build([str(shipped), str(tuned)], tmp_path, trials=100)
    page = (tmp_path / "report.html").read_text()
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("<head>", "<head>" + PROBE, 1))
    r = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000",
                        "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120)
    dom = r.stdout
    assert 'id="dsv41-probe"' in dom, r.stderr[-2000:]
    import html
    import json
    import re
    found = json.loads(html.unescape(re.search(r'<pre id="dsv41-probe">(.*?)</pre>', dom, re.S).group(1)))
    assert found["images"] == page.count("data:image/png;base64,") >= 4
    assert found["broken"] == [] and found["errors"] == []
