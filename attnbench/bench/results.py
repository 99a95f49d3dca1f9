"""Result files: written as rows finish, read back (also after an interrupted run) and validated.

A result file is one JSON document, rewritten whole after every finished row: written to a
temporary file in the same directory, flushed to disk, then renamed over the target with
``os.replace``, which is atomic on POSIX. A reader therefore always sees either the previous
complete document or the new one, never a truncated file; a full disk or a Ctrl-C during a write
leaves the previous version in place. The document, rather than JSON Lines, keeps the format that
``json.load`` and the committed results under results/ already use; rewriting it costs
milliseconds per row, small beside the time a row takes to measure.

    {"format": 1, "status": "running" | "complete" | "interrupted" | "error", "date": "2026-11-27T10:00:00+00:00",
     "command": "bench", "argv": [...], "machine": {...}, "code": {...}, "autotune": true,
     "ceilings": {...} | null,
     "operators": {"flash": {"ratio_subject": "triton", "ratio_peers": [...], "unavailable": {...}}},
     "checks": [...], "bench": [...]}

Numbers follow Python's ``json`` module: a value that is not finite (no error measured, an
infinite error) is written as ``NaN`` or ``Infinity``, which ``json.load`` reads back.
"""
import datetime
import json
import math
import os
import stat
import sys
import tempfile

FORMAT = 1
STATUSES = ("running", "complete", "interrupted", "error")


class BadResultFile(ValueError):
    """A result file that cannot be read or is not an attnbench result; the message is one line."""


class OutputPathError(ValueError):
    """An output path that cannot be written; the message is one line naming the path and why."""


class WriteError(Exception):
    """The result file could not be rewritten mid-run (a full disk, say); its previous version,
    with every row written before, is intact."""


def check_output_path(path: str, option: str = "--json") -> str:
    """The real path to write ``path`` to, after checking that it can be written, before any work:
    its directory exists and is writable, and the path is not a directory or a special file.
    Raises ``OutputPathError`` otherwise."""
    real = os.path.realpath(path)  # a symlink is followed: its target is replaced, not the link
    directory = os.path.dirname(real)
    if os.path.isdir(real):
        raise OutputPathError(f"{option} {path}: is a directory")
    if not os.path.isdir(directory):
        shown = os.path.dirname(path) or "."
        why = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise OutputPathError(f"{option} {path}: {shown} {why}")
    if os.path.exists(real):
        if not stat.S_ISREG(os.stat(real).st_mode):
            raise OutputPathError(f"{option} {path}: not a regular file" + (" (use '-' for stdout)" if option == "--json" else ""))
        if not os.access(real, os.W_OK):
            raise OutputPathError(f"{option} {path}: permission denied")
    try:  # the only sure test: create (and remove) the temporary file the writer will use
        fd, tmp = tempfile.mkstemp(prefix=".attnbench-", suffix=".tmp", dir=directory)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise OutputPathError(f"{option} {path}: cannot write in {directory}: {exc.strerror or exc}") from None
    return real


def write_atomic(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` atomically (temporary file in the same directory + rename)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".attnbench-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:  # keep the permissions an existing file had (mkstemp creates it 0600)
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
        except FileNotFoundError:
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class ResultFile:
    """The JSON document of one run, kept current on disk as rows finish.

    ``path`` None keeps it in memory only; ``"-"`` writes it to stdout once, at ``finish``.
    Rows are held as objects with ``as_dict()`` and serialized at every write, so a row updated
    after it was added (a speedup known once the baseline has run) is written as it is now."""

    def __init__(self, path, header: dict):
        self.path = path
        # when the run started (UTC): the index of committed results (attnbench report --index) dates rows by it
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.doc = {"format": FORMAT, "status": "running", "date": started, **header}
        self.rows = {"checks": [], "bench": []}

    def operator(self, name: str, info: dict):
        self.doc.setdefault("operators", {})[name] = info

    def add(self, kind: str, row) -> None:
        self.rows[kind].append(row)
        if self.path not in (None, "-"):
            self._write()

    def _write(self):
        try:
            write_atomic(self.path, self.text())
        except OSError as exc:
            raise WriteError(f"cannot write {self.path}: {exc.strerror or exc}") from exc

    def count(self, kind: str) -> int:
        return len(self.rows[kind])

    def text(self) -> str:
        doc = dict(self.doc)
        for kind, rows in self.rows.items():
            if rows or kind in doc:
                doc[kind] = [r.as_dict() for r in rows]
        return json.dumps(doc, indent=1, default=str)

    def finish(self, status: str) -> None:
        assert status in STATUSES, status
        self.doc["status"] = status
        if self.path == "-":
            sys.stdout.write(self.text() + "\n")
            sys.stdout.flush()
        elif self.path is not None:
            self._write()


# ---------------------------------------------------------------- reading

_ROW_KEYS = ("op", "case", "mode", "variant")
_OPTIONAL_NUMBERS = ("tflops", "gbps", "roofline_pct", "floor_ms", "floor_pct", "speedup", "speedup_eager", "max_error")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def load(path: str) -> dict:
    """Read and validate a result file written by ``bench``/``check``/``run --json``, complete or
    partial (an interrupted run). Raises ``BadResultFile`` with one line saying what is wrong."""
    data = read_json(path)
    validate(data, path)
    return data


def read_json(path: str):
    """A file's JSON, not yet validated (result files and traffic files alike); ``BadResultFile`` with one line
    saying why it cannot be read."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise BadResultFile(f"{path}: no such file") from None
    except IsADirectoryError:
        raise BadResultFile(f"{path}: is a directory, not a result file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadResultFile(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadResultFile(f"{path}: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    return data


def merge(parts: list, paths: list, kinds=("checks", "bench")) -> dict:
    """One document of a run split over several files (e.g. with ``--match``): the rows of each list in ``kinds``
    concatenated in order (a traffic file's: ``("traffic",)``), operators' claims combined; the status is
    "complete" only if every part is. Parts must come from one machine and software stack. A row in two parts
    (the second-order checks every --match part of jvp_attention runs; a case a resumed run timed again) is
    taken from the later part, and ``replaced_rows`` counts them per kind so that the report says so: refusing
    them had left such parts unreadable together."""
    if len(parts) == 1:
        return parts[0]
    if len({os.path.realpath(p) for p in paths}) < len(paths):
        raise BadResultFile(f"{', '.join(paths)}: a file is given twice (its rows would be read as two parts)")
    stack = ("device_name", "torch", "triton", "cuda")
    stacks = {tuple((d.get("machine") or {}).get(k) for k in stack) for d in parts}
    if len(stacks) > 1:
        raise BadResultFile(f"{', '.join(paths)}: parts from different devices or versions "
                            f"({'; '.join(' '.join(map(str, s)) for s in sorted(stacks, key=str))})")
    doc = dict(parts[0])
    for kind in kinds:
        if any(kind in d for d in parts):
            rows = [row for d in parts for row in d.get(kind, [])]
            last = {tuple(row.get(k) for k in _ROW_KEYS): i for i, row in enumerate(rows)}
            kept = [row for i, row in enumerate(rows) if last[tuple(row.get(k) for k in _ROW_KEYS)] == i]
            if len(kept) < len(rows):
                doc.setdefault("replaced_rows", {})[kind] = len(rows) - len(kept)
            doc[kind] = kept
    doc["operators"] = {}
    for d in parts:
        for name, claim in (d.get("operators") or {}).items():
            earlier = doc["operators"].get(name)
            if earlier and earlier.get("case_set") != claim.get("case_set"):  # e.g. two --match parts of a set
                claim = dict(claim, case_set=f"{earlier.get('case_set')} + {claim.get('case_set')}")
            doc["operators"][name] = claim
    # the code of each part ("code": attnbench.bench.provenance): parts of one grid may run on different commits (a part
    # whose code did not change is not measured again); the merged document lists them, in part order
    codes = [d.get("code") for d in parts]
    if any(c != codes[0] for c in codes):
        doc["code"] = {"parts": [dict(c or {}, file=p) for c, p in zip(codes, paths)]}
    if any(d.get("autotune") is False for d in parts):  # a part at fixed launch configs makes the run a study's
        doc["autotune"] = False
    statuses = [d.get("status", "complete") for d in parts]
    doc["status"] = "complete" if all(s == "complete" for s in statuses) else next(
        s for s in statuses if s != "complete")
    return doc


def validate(data, path: str = "report") -> None:
    if not isinstance(data, dict):
        raise BadResultFile(f"{path}: not an attnbench result: the top level is a {type(data).__name__}, "
                            "expected an object with 'bench' and/or 'checks' lists")
    if "bench" not in data and "checks" not in data:
        raise BadResultFile(f"{path}: not an attnbench result: no 'bench' or 'checks' list")
    status = data.get("status", "complete")  # files written before the status field were complete
    if status not in STATUSES:
        raise BadResultFile(f"{path}: 'status' must be one of {list(STATUSES)}, got {status!r}")
    for key in ("machine", "code", "ceilings", "operators"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            raise BadResultFile(f"{path}: '{key}' must be an object, got {type(data[key]).__name__}")
    ceil = data.get("ceilings")
    for key in ("matmul_tflops", "copy_gbps") if ceil else ():
        if not _number(ceil.get(key)) or not ceil[key] > 0:
            raise BadResultFile(f"{path}: ceilings.{key} must be a positive number, got {ceil.get(key)!r}")
    for kind in ("bench", "checks"):
        rows = data.get(kind, [])
        if not isinstance(rows, list):
            raise BadResultFile(f"{path}: '{kind}' must be a list of rows, got {type(rows).__name__}")
        for i, row in enumerate(rows):
            where = f"{path}: {kind}[{i}]"
            if not isinstance(row, dict):
                raise BadResultFile(f"{where} is a {type(row).__name__}, expected an object")
            for key in _ROW_KEYS:
                if not isinstance(row.get(key), str):
                    raise BadResultFile(f"{where}: '{key}' is missing or not a string")
            if kind == "bench":
                _validate_bench_row(row, where)


def _validate_bench_row(row, where):
    timing = row.get("timing")
    if timing is None:
        if not row.get("skipped"):
            raise BadResultFile(f"{where}: no timing and no 'skipped' reason")
        return
    for clock in ("timing", "eager", "host"):  # GPU time, eager latency, host time (the last two optional)
        if row.get(clock) is not None:
            _validate_timing(row[clock], f"{where}: {clock}")
    for key in _OPTIONAL_NUMBERS:  # null means "not measured" (no cost model, no ceilings)
        if row.get(key) is not None and not _number(row[key]):
            raise BadResultFile(f"{where}: '{key}' must be a number or null, got {row[key]!r}")


def _validate_timing(timing, where):
    if not isinstance(timing, dict):
        raise BadResultFile(f"{where} must be an object or null")
    median = timing.get("median_ms")
    if not _number(median) or not math.isfinite(median) or median <= 0:
        raise BadResultFile(f"{where}.median_ms must be a positive number, got {median!r}")
    for key in ("q1_ms", "q3_ms", "iqr_ms"):
        if key in timing and not _number(timing[key]):
            raise BadResultFile(f"{where}.{key} must be a number, got {timing[key]!r}")
