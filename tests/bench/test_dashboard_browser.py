"""The dashboard that scripts/dashboard.sh publishes from the committed results/asv works offline: headless
chromium (selenium, chromium-driver), with every host but 127.0.0.1 unresolvable, opens one benchmark's graph
from a local server and draws it with points for several commits and several variants, and the page requests
nothing from another host. Skips only when chromium, chromedriver or selenium cannot be found (CI installs them:
.ci/run), or in a tree without the committed results and git history that asv publishes from (an sdist).

ATTNBENCH_DASHBOARD_SCREENSHOT=docs/img/dashboard.png keeps the screenshot (the one the docs show)."""
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote_plus, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
# flash.FlashAnchor.track_latency_ms on the H200: the flash anchors over the 12 kernel commits scripts/asv_backfill.py
# timed there (f8010f6 to c54116c; results/asv/nvidia-h200), ours and SDPA FLASH at each, GPU time. The graph drawn is
# the D 128 forward, where the Gluon kernel's two warpgroups (7145b00) show as a step
BENCHMARK = "flash.FlashAnchor.track_latency_ms"
MACHINE = "nvidia-h200"
CASE, MODE = "B2 H16 N8192 D128 bf16", "fwd"
MIN_COMMITS = 12  # the dashboard issue's bar: a kernel's evolution over at least 12 commits per GPU
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1400,1000",
                  # offline: no name resolves but the local server's
                  "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1")

pytestmark = pytest.mark.skipif(not (ROOT / "results" / "asv" / MACHINE).is_dir() or not (ROOT / ".git").exists(),
                                reason="needs the committed results/asv and the git history asv publishes from")


def find(names, variable):
    for name in ((os.environ.get(variable),) if os.environ.get(variable) else ()) + names:
        path = shutil.which(name)
        if path:
            return path
    return None


def snapshot(folder: Path):
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """scripts/dashboard.sh into a temporary folder; results/asv is left as it was."""
    before = snapshot(ROOT / "results" / "asv")
    out = tmp_path_factory.mktemp("dashboard") / "html"
    env = dict(os.environ, PYTHON=sys.executable)
    if not shutil.which("npm", path=env.get("PATH")) and not (ROOT / "dashboard/node_modules/.package-lock.json").is_file():
        pytest.skip("npm is needed once to install dashboard/node_modules (cd dashboard && npm ci)")
    start = time.perf_counter()
    run = subprocess.run(["bash", str(ROOT / "scripts" / "dashboard.sh"), str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    print(f"dashboard published in {time.perf_counter() - start:.1f} s")
    assert "is self-contained" in run.stdout, run.stdout
    assert snapshot(ROOT / "results" / "asv") == before, "publishing changed results/asv"
    return out


@pytest.fixture(scope="module")
def server(published):
    handler = partial(Quiet, directory=str(published))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


class Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium = find(("chromium", "chromium-browser"), "CHROMIUM")
    chromedriver = find(("chromedriver",), "CHROMEDRIVER")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    missing = [name for name, found in (("chromium", chromium), ("chromedriver", chromedriver),
                                        ("selenium", webdriver)) if not found]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not found (apt-get install chromium chromium-driver; pip install "
                    "selenium; or set CHROMIUM / CHROMEDRIVER)")
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must not look for drivers on the network
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def expected_series(published: Path):
    """Per variant, the commits at which the published graph data has a number for CASE and MODE."""
    index = json.loads((published / "index.json").read_text())
    bench = index["benchmarks"][BENCHMARK]
    names, values = bench["param_names"], bench["params"]
    (graph,) = published.glob(f"graphs/branch-main/machine-{MACHINE}/*/{BENCHMARK}.json")
    points = json.loads(graph.read_text())  # [[revision, [value per parameter combination]], ...]
    expected = {}
    case_i, mode_i = values[names.index("case")].index(repr(CASE)), values[names.index("mode")].index(repr(MODE))
    sizes = [len(v) for v in values]
    for variant_i, variant in enumerate(values[names.index("variant")]):
        at = {"case": case_i, "variant": variant_i, "mode": mode_i}
        flat = 0
        for name, size in zip(names, sizes):  # row-major over the parameter lists, as asv stores them
            flat = flat * size + at[name]
        commits = {revision for revision, row in points if row[flat] is not None}
        if commits:
            expected[variant.strip("'")] = commits
    return expected


PLOTTED = """
var plot = window.jQuery && jQuery('#main-graph').data('plot');
if (!plot) { return null; }
return plot.getData().map(function (s) {
    return {label: s.label, points: s.data.filter(function (p) { return p[1] !== null; }).map(function (p) { return p[0]; })};
});
"""


def test_dashboard_graph_renders_offline(browser, published, server, tmp_path):  # browser first: a skip publishes nothing
    expected = expected_series(published)
    assert len(expected) > 1 and sum(len(c) > 1 for c in expected.values()) > 1, expected  # the data can show it
    assert max(len(c) for c in expected.values()) >= MIN_COMMITS, {v: len(c) for v, c in expected.items()}
    url = (f"{server}/index.html#{BENCHMARK}?machine={MACHINE}"
           f"&p-case={quote_plus(repr(CASE))}&p-mode={quote_plus(repr(MODE))}")
    browser.get(url)
    deadline, series = time.monotonic() + 60, None
    while time.monotonic() < deadline:
        series = browser.execute_script(PLOTTED)
        if series and sum(bool(s["points"]) for s in series) >= len(expected):
            break
        time.sleep(0.25)
    time.sleep(0.5)  # let flot finish drawing for the screenshot
    shot = tmp_path / "dashboard.png"
    browser.save_screenshot(str(shot))
    if os.environ.get("ATTNBENCH_DASHBOARD_SCREENSHOT"):
        shutil.copy(shot, os.environ["ATTNBENCH_DASHBOARD_SCREENSHOT"])
    page = browser.page_source
    assert "continental origin of swallow" not in page and "error.html" not in browser.current_url
    assert series, f"no graph drawn at {url}; browser log: {browser.get_log('browser')}"
    plotted = {s["label"]: set(s["points"]) for s in series if s["points"]}
    # one line per variant that has numbers, each labelled with its variant, at the commits the data holds
    assert len(plotted) == len(expected), (plotted, expected)
    for variant, commits in expected.items():
        (label,) = [label for label in plotted if label.endswith(f"variant-{variant}")]
        assert len(plotted[label]) == len(commits), (variant, plotted[label], commits)
    assert len(set().union(*plotted.values())) >= MIN_COMMITS, f"points for fewer than {MIN_COMMITS} commits"
    assert sum(len(x) > 1 for x in plotted.values()) > 1, "fewer than two variants with several commits"
    legend = browser.execute_script("return jQuery('#main-graph .legend').text()")
    assert all(variant in legend for variant in expected), legend
    # offline: every request the page made went to the local server
    requests = []
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            requests.append(message["params"]["request"]["url"])
    hosts = {urlsplit(u).netloc for u in requests if urlsplit(u).scheme in ("http", "https")}
    assert hosts == {urlsplit(server).netloc}, sorted(u for u in requests if urlsplit(server).netloc not in u)
    assert any("/vendor/jquery/" in u for u in requests) and any(f"/{BENCHMARK}.json" in u for u in requests), requests
