"""Makes a folder that `asv publish` wrote work without a network: the scripts and stylesheets asv's
index.html loads from public CDNs are copied in from dashboard/node_modules (installed by `npm ci` from
package-lock.json), each checked against the hash that dashboard/assets.json pins, and every CDN
address in the html is rewritten to the local copy, whose pinned hash becomes the tag's `integrity`
(so the browser checks the file again). Then the folder is checked: nothing in it may point at
another host, except the few references assets.json lists that load nothing (a link to click, an XML
namespace, a licence comment), and every file a page loads must be there.

    python dashboard/offline.py DIR            vendor, rewrite and check DIR (scripts/dashboard.sh runs this)
    python dashboard/offline.py --check DIR    only check DIR
    python dashboard/offline.py --rehash       after a deliberate version change in package.json and
                                               package-lock.json: write the installed files' hashes into
                                               assets.json (review the diff)

Exit status: 0 done and clean; 1 the check found a problem (each printed on stderr); 2 a pinned file is
missing, of another version, or does not match its hash.
"""
import argparse
import base64
import fnmatch
import hashlib
import json
import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "assets.json"
VENDOR = "vendor"  # the copies live in DIR/vendor/<package>/<path inside the package>
# an address with a host: scheme://host or protocol-relative //host (a dotted name, or localhost)
REMOTE = re.compile(r"(?:\b[a-zA-Z][a-zA-Z0-9+.-]*:)?//(?:[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+|localhost)(?::\d+)?[^\s\"'()<>\\]*")
TEXT_SUFFIXES = {".html", ".htm", ".js", ".css", ".json", ".xml", ".svg", ".txt", ".map"}
# elements whose attribute makes the browser fetch something when the page loads (an <a href> is a click)
LOADING = {"script": ("src",), "link": ("href",), "img": ("src", "srcset"), "iframe": ("src",),
           "source": ("src", "srcset"), "video": ("src", "poster"), "audio": ("src",), "embed": ("src",),
           "object": ("data",), "input": ("src",)}
CSS_URL = re.compile(r"""url\(\s*(['"]?)([^'")]*)\1\s*\)|@import\s+(['"])([^'"]*)\3""")


class PinError(Exception):
    """A pinned file is missing, of another version than pinned, or differs from its pinned hash."""


def integrity(data: bytes, algorithm: str = "sha512") -> str:
    """The Subresource Integrity string of DATA (the form npm's lock and the html's integrity= use)."""
    return f"{algorithm}-{base64.b64encode(hashlib.new(algorithm, data).digest()).decode()}"


def load_manifest(path: Path = MANIFEST) -> dict:
    return json.loads(path.read_text())


def local_path(asset: dict) -> str:
    return f"{VENDOR}/{asset['package']}/{asset['file']}"


def pinned_bytes(asset: dict, node_modules: Path) -> bytes:
    """The installed file of ASSET, after checking its package's version and the file's hash."""
    package = node_modules / asset["package"]
    try:
        installed = json.loads((package / "package.json").read_text())["version"]
    except FileNotFoundError:
        raise PinError(f"{asset['package']} is not installed in {node_modules} "
                       f"(run: cd {HERE.name} && npm ci --ignore-scripts)") from None
    if installed != asset["version"]:
        raise PinError(f"{asset['package']} {installed} is installed, {asset['version']} is pinned "
                       f"(run: cd {HERE.name} && npm ci --ignore-scripts)")
    try:
        data = (package / asset["file"]).read_bytes()
    except FileNotFoundError:
        raise PinError(f"{asset['package']}@{asset['version']} has no {asset['file']}") from None
    algorithm = asset["integrity"].split("-", 1)[0]
    got = integrity(data, algorithm)
    if got != asset["integrity"]:
        raise PinError(f"{asset['package']}@{asset['version']}/{asset['file']}: hash {got}, "
                       f"assets.json pins {asset['integrity']}")
    return data


class Tags(HTMLParser):
    """Every start tag of a page, as (tag, {attribute: value})."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, {k: v for k, v in attrs if v is not None}))

    handle_startendtag = handle_starttag


def tags(text: str):
    parser = Tags()
    parser.feed(text)
    parser.close()
    return parser.tags


def rewrite_html(text: str, assets: list) -> tuple[str, list]:
    """TEXT with each CDN address of ASSETS in a <script src> or <link href> replaced by its local copy,
    and that tag's integrity= set to the copy's pinned hash; also the CDN addresses it replaced."""
    by_url = {a["cdn"]: a for a in assets if a.get("cdn")}
    replaced = []

    def one_tag(match):
        tag = match.group(0)
        for url, asset in by_url.items():
            attribute = re.search(r'\b(src|href)\s*=\s*(["\'])' + re.escape(url) + r"\2", tag)
            if not attribute:
                continue
            replaced.append(url)
            tag = tag[:attribute.start()] + f'{attribute.group(1)}="{local_path(asset)}"' + tag[attribute.end():]
            pinned = f'integrity="{asset["integrity"]}"'
            if re.search(r"\bintegrity\s*=", tag):
                tag = re.sub(r'\bintegrity\s*=\s*(["\'])[^"\']*\1', pinned, tag)
            else:
                tag = re.sub(r"\s*/?>$", lambda end: f" {pinned}{end.group(0)}", tag)
            break
        return tag

    return re.sub(r"<(?:script|link)\b[^>]*>", one_tag, text, flags=re.I), replaced


def vendor(out: Path, node_modules: Path, manifest: dict) -> list:
    """Copies every pinned file into OUT/vendor/ and rewrites OUT's html files; returns the CDN
    addresses of assets.json that no page named (an asv upgrade may have changed them)."""
    assets = manifest["assets"]
    copies = {local_path(asset): pinned_bytes(asset, node_modules) for asset in assets}  # all checked first
    for relative, data in copies.items():
        dest = out / relative
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
    seen = set()
    for page in sorted(out.glob("*.htm*")):
        text, replaced = rewrite_html(page.read_text(encoding="utf-8"), assets)
        seen.update(replaced)
        page.write_text(text, encoding="utf-8")
    return sorted({a["cdn"] for a in assets if a.get("cdn")} - seen)


def allowed(url: str, relative: str, manifest: dict) -> bool:
    return any(url == entry["url"] and fnmatch.fnmatch(relative, entry["files"])
               for entry in manifest["references_that_load_nothing"])


def local_target(base: Path, reference: str, out: Path):
    """The file in OUT that REFERENCE (relative, from a file in BASE) names, or None for an in-page
    reference (#..., data:, about:, javascript:)."""
    parts = urlsplit(reference)
    if parts.scheme or not parts.path:
        return None
    path = unquote(parts.path)
    target = (out / path.lstrip("/")) if path.startswith("/") else (base / path)
    return target.resolve()


def check(out: Path, manifest: dict) -> list:
    """Problems that would make OUT reach another host or miss a file offline, one line each."""
    out = out.resolve()
    problems = []
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        relative = path.relative_to(out).as_posix()
        if path.suffix.lower() not in TEXT_SUFFIXES:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for match in REMOTE.finditer(text):
            url = match.group(0)
            if not allowed(url, relative, manifest):
                problems.append(f"{relative}: names another host: {url}")
        loads = []
        if path.suffix.lower() in (".html", ".htm"):
            for tag, attrs in tags(text):
                for attribute in LOADING.get(tag, ()):
                    if attribute in attrs:
                        loads.append((attrs[attribute], attrs.get("integrity")))
                if "style" in attrs:
                    loads += [(m.group(2) or m.group(4), None) for m in CSS_URL.finditer(attrs["style"])]
        elif path.suffix.lower() == ".css":
            loads = [(m.group(2) or m.group(4), None) for m in CSS_URL.finditer(text)]
        for reference, pinned in loads:
            if REMOTE.match(reference):
                problems.append(f"{relative}: loads {reference} from another host")
                continue
            target = local_target(path.parent, reference, out)
            if target is None:
                continue
            if not target.is_relative_to(out):
                problems.append(f"{relative}: loads {reference}, outside the folder")
            elif not target.is_file():
                problems.append(f"{relative}: loads {reference}, which is not in the folder")
            elif pinned and integrity(target.read_bytes(), pinned.split("-", 1)[0]) != pinned:
                problems.append(f"{relative}: {reference} does not match its integrity={pinned}")
    return problems


def rehash(manifest_path: Path, node_modules: Path) -> None:
    """Writes the installed files' hashes (and versions) into the manifest."""
    manifest = load_manifest(manifest_path)
    for asset in manifest["assets"]:
        package = node_modules / asset["package"]
        asset["version"] = json.loads((package / "package.json").read_text())["version"]
        algorithm = asset["integrity"].split("-", 1)[0] if asset.get("integrity") else "sha512"
        asset["integrity"] = integrity((package / asset["file"]).read_bytes(), algorithm)
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", nargs="?", type=Path, help="a folder `asv publish` wrote")
    parser.add_argument("--check", action="store_true", help="only check FOLDER")
    parser.add_argument("--rehash", action="store_true", help="write the installed files' hashes into assets.json")
    parser.add_argument("--node-modules", type=Path, default=HERE / "node_modules")
    parser.add_argument("--manifest", type=Path, default=MANIFEST)
    args = parser.parse_args(argv)
    if args.rehash:
        rehash(args.manifest, args.node_modules)
        return 0
    if args.folder is None or not (args.folder / "index.html").is_file():
        parser.error("FOLDER must be a folder `asv publish` wrote (it has an index.html)")
    manifest = load_manifest(args.manifest)
    if not args.check:
        try:
            unused = vendor(args.folder, args.node_modules, manifest)
        except PinError as error:
            print(f"dashboard: {error}", file=sys.stderr)
            return 2
        for url in unused:
            print(f"dashboard: no page loads {url} (asv's templates changed? see docs/dashboard.md)", file=sys.stderr)
    problems = check(args.folder, manifest)
    for line in problems:
        print(f"dashboard: {line}", file=sys.stderr)
    if problems:
        print(f"dashboard: {args.folder} is not self-contained ({len(problems)} problems)", file=sys.stderr)
        return 1
    print(f"dashboard: {args.folder} is self-contained: {len(manifest['assets'])} pinned files, no other host loaded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
