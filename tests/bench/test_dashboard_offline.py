"""dashboard/offline.py on small made-up folders (no asv, no npm, no browser): the CDN tags are pointed at
pinned local copies whose hash becomes integrity=, a file that differs from its pin stops the copy, and the
check names every reference to another host or to a missing file. tests/bench/test_dashboard_browser.py
publishes the real dashboard and opens it."""
import json
from pathlib import Path

import pytest

from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "dashboard" / "offline.py"

pytestmark = pytest.mark.skipif(not SCRIPT.is_file(), reason="no dashboard/ in this tree")


@pytest.fixture(scope="module")
def offline():
    return load_script("dashboard/offline.py")


CDN = "https://cdn.example.org/lib@1.0/lib.min.js"
PAGE = f"""<html><head>
<script src="{CDN}" integrity="sha256-cdnhash" crossorigin="anonymous" onerror="js_load_failure()"></script>
<script src="local.js"></script>
</head><body><a href="https://example.org/">a link to click</a></body></html>"""


@pytest.fixture
def setup(tmp_path, offline):
    """A node_modules with one package, its manifest, and a published folder whose page loads it from a CDN."""
    package = tmp_path / "node_modules" / "lib"
    (package / "dist").mkdir(parents=True)
    (package / "package.json").write_text(json.dumps({"name": "lib", "version": "1.0.0"}))
    (package / "dist" / "lib.min.js").write_text("window.lib = 1;\n")
    manifest = {"assets": [{"cdn": CDN, "package": "lib", "version": "1.0.0", "file": "dist/lib.min.js",
                            "integrity": offline.integrity(b"window.lib = 1;\n")}],
                "references_that_load_nothing": [{"url": "https://example.org/", "files": "index.html", "why": "a link"}]}
    out = tmp_path / "html"
    out.mkdir()
    (out / "index.html").write_text(PAGE)
    (out / "local.js").write_text("var x = 1;\n")
    return out, tmp_path / "node_modules", manifest


def test_vendoring_points_the_page_at_the_pinned_copy(setup, offline):
    out, node_modules, manifest = setup
    assert offline.check(out, manifest) == [f"index.html: names another host: {CDN}",
                                            f"index.html: loads {CDN} from another host"]
    assert offline.vendor(out, node_modules, manifest) == []  # every pinned CDN address was found
    page = (out / "index.html").read_text()
    pinned = manifest["assets"][0]["integrity"]
    assert f'<script src="vendor/lib/dist/lib.min.js" integrity="{pinned}" crossorigin="anonymous"' in page
    assert CDN not in page and "cdnhash" not in page
    assert (out / "vendor" / "lib" / "dist" / "lib.min.js").read_text() == "window.lib = 1;\n"
    assert offline.check(out, manifest) == []
    # the browser would refuse a copy that differs from the tag's integrity=; so does the check
    (out / "vendor" / "lib" / "dist" / "lib.min.js").write_text("window.lib = 2;\n")
    assert offline.check(out, manifest) == [
        f"index.html: vendor/lib/dist/lib.min.js does not match its integrity={pinned}"]


def test_a_file_unlike_its_pin_is_not_copied(setup, offline):
    out, node_modules, manifest = setup
    (node_modules / "lib" / "dist" / "lib.min.js").write_text("window.lib = 'tampered';\n")
    with pytest.raises(offline.PinError, match="dist/lib.min.js: hash sha512-.*assets.json pins sha512-"):
        offline.vendor(out, node_modules, manifest)
    (node_modules / "lib" / "package.json").write_text(json.dumps({"name": "lib", "version": "1.0.1"}))
    with pytest.raises(offline.PinError, match="lib 1.0.1 is installed, 1.0.0 is pinned"):
        offline.vendor(out, node_modules, manifest)
    assert not (out / "vendor").exists()


def test_check_names_every_other_host_and_missing_file(setup, offline):
    out, node_modules, manifest = setup
    offline.vendor(out, node_modules, manifest)
    (out / "extra.html").write_text('<html><link rel="stylesheet" href="//fonts.example.com/a.css">'
                                    '<img src="missing.png"><div style="background: url(\'gone.png\')"></div></html>')
    (out / "style.css").write_text("@import 'https://cdn.example.net/x.css'; .a { background: url(../up.png) }"
                                   " .b { background: url(data:image/png;base64,AAAA) } .c { src: url('local.js?#x') }")
    (out / "graph.json").write_text(json.dumps({"url": "http://tracker.example.com/p"}))
    problems = offline.check(out, manifest)
    assert sorted(problems) == sorted([
        "extra.html: names another host: //fonts.example.com/a.css",
        "extra.html: loads //fonts.example.com/a.css from another host",
        "extra.html: loads missing.png, which is not in the folder",
        "extra.html: loads gone.png, which is not in the folder",
        "graph.json: names another host: http://tracker.example.com/p",
        "style.css: names another host: https://cdn.example.net/x.css",
        "style.css: loads https://cdn.example.net/x.css from another host",
        "style.css: loads ../up.png, outside the folder",
    ])
    # an allowed reference is allowed only in the files it is listed for
    (out / "other.html").write_text('<a href="https://example.org/">x</a>')
    assert "other.html: names another host: https://example.org/" in offline.check(out, manifest)


def test_the_committed_pins_agree_with_the_lock():
    """assets.json pins the versions package.json and package-lock.json install, and every pinned file carries
    a hash; every CDN tag of asv's page has its copy (the browser test proves they load)."""
    manifest = json.loads((ROOT / "dashboard" / "assets.json").read_text())
    declared = json.loads((ROOT / "dashboard" / "package.json").read_text())["dependencies"]
    lock = json.loads((ROOT / "dashboard" / "package-lock.json").read_text())["packages"]
    for asset in manifest["assets"]:
        assert declared[asset["package"]] == asset["version"], asset  # exact, no range
        assert lock[f"node_modules/{asset['package']}"]["version"] == asset["version"]
        assert lock[f"node_modules/{asset['package']}"]["integrity"].startswith("sha512-")
        assert asset["integrity"].startswith("sha512-") and len(asset["integrity"]) == 7 + 88
    assert set(declared) == {a["package"] for a in manifest["assets"]}
