"""Result files: rewritten atomically as rows finish, output paths checked before any work, and
every bad file read back with one line that says what is wrong."""
import json
import os
import stat

import pytest

from attnbench.bench import results


class Row:
    def __init__(self, i):
        self.i, self.speedup = i, None

    def as_dict(self):
        return {"op": "flash", "case": f"c{self.i}", "mode": "fwd", "variant": "split", "speedup": self.speedup,
                "timing": {"median_ms": 1.0 + self.i}}


def test_rows_are_on_disk_as_they_finish(tmp_path):
    path = tmp_path / "r.json"
    f = results.ResultFile(str(path), {"command": "bench"})
    assert not path.exists()  # nothing written (an older report stays) until a row has finished
    rows = [Row(i) for i in range(3)]
    for n, row in enumerate(rows, 1):
        f.add("bench", row)
        doc = json.loads(path.read_text())
        assert doc["status"] == "running" and len(doc["bench"]) == n
    rows[0].speedup = 2.0  # updated after it was added (the baseline ran later): the next write has it
    f.finish("complete")
    doc = json.loads(path.read_text())
    assert doc["status"] == "complete" and doc["bench"][0]["speedup"] == 2.0
    assert "checks" not in doc  # a bench run has no checks list
    assert not [p for p in os.listdir(tmp_path) if p != "r.json"]  # no temporary file left behind


def test_a_failed_write_keeps_the_previous_version(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    f = results.ResultFile(str(path), {})
    f.add("bench", Row(0))
    before = path.read_text()

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(results.os, "replace", full_disk)
    with pytest.raises(results.WriteError, match="No space left on device"):
        f.add("bench", Row(1))
    assert path.read_text() == before  # intact, valid, one row
    assert len(json.loads(before)["bench"]) == 1
    assert os.listdir(tmp_path) == ["r.json"]  # the temporary file was removed


def test_rewrite_keeps_the_file_mode(tmp_path):
    path = tmp_path / "r.json"
    path.write_text("{}")
    path.chmod(0o640)
    results.write_atomic(str(path), "[]")
    assert stat.S_IMODE(path.stat().st_mode) == 0o640 and path.read_text() == "[]"


def test_output_path_checks(tmp_path):
    assert results.check_output_path(str(tmp_path / "new.json")) == str(tmp_path / "new.json")
    (tmp_path / "real.json").write_text("")
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    assert results.check_output_path(str(tmp_path / "link.json")) == str(tmp_path / "real.json")  # the target
    (tmp_path / "file").write_text("")
    bad = {str(tmp_path / "no" / "x.json"): "does not exist", str(tmp_path): "is a directory",
           str(tmp_path / "file" / "x.json"): "is not a directory", "/dev/null": "not a regular file",
           "/proc/attnbench.json": "cannot write"}  # /proc refuses new files, even to root
    for path, why in bad.items():
        with pytest.raises(results.OutputPathError, match=why) as exc:
            results.check_output_path(path)
        assert "\n" not in str(exc.value) and path in str(exc.value)


GOOD_ROW = {"op": "flash", "case": "c", "mode": "fwd", "variant": "split", "timing": {"median_ms": 1.0}}


@pytest.mark.parametrize("content, message", [
    ("[1, 2, 3]", "top level is a list"),
    ('{"bench": "hello"}', "'bench' must be a list of rows, got str"),
    ('{"machine": {}}', "no 'bench' or 'checks' list"),
    ('{"bench": [1]}', r"bench\[0\] is a int"),
    ('{"bench": [{"op": "flash"}]}', r"bench\[0\]: 'case' is missing"),
    (json.dumps({"bench": [{**GOOD_ROW, "timing": {"median_ms": 0}}]}), "median_ms must be a positive number, got 0"),
    (json.dumps({"bench": [{**GOOD_ROW, "timing": {}}]}), "median_ms must be a positive number, got None"),
    (json.dumps({"bench": [{**GOOD_ROW, "timing": None}]}), "no timing and no 'skipped' reason"),
    (json.dumps({"bench": [{**GOOD_ROW, "tflops": "fast"}]}), "'tflops' must be a number or null"),
    (json.dumps({"bench": [], "status": "maybe"}), "'status' must be one of"),
    (json.dumps({"bench": [], "ceilings": {"matmul_tflops": 1}}), "ceilings.copy_gbps must be a positive number"),
    (json.dumps({"checks": [{"op": "flash"}]}), r"checks\[0\]: 'case' is missing"),
    ("", "not JSON"),
    ('{"bench": [', "not JSON"),
])
def test_bad_files_say_what_is_wrong_in_one_line(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(results.BadResultFile, match=message) as exc:
        results.load(str(path))
    assert "\n" not in str(exc.value)


def test_partial_and_old_files_load(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"status": "interrupted", "bench": [GOOD_ROW, {**GOOD_ROW, "tflops": None}]}))
    assert results.load(str(path))["status"] == "interrupted"
    path.write_text(json.dumps({"bench": [GOOD_ROW]}))  # written before the status field: complete
    assert results.load(str(path))["bench"] == [GOOD_ROW]


def test_a_run_with_one_part_at_fixed_configs_merges_as_fixed():
    """Parts of one run where one ran with ATTNBENCH_AUTOTUNE=0: the merged run is not an autotuned one (the
    results pages would otherwise rank it as a headline)."""
    def part(case, autotune):
        return {"format": 1, "status": "complete", "machine": {"device_name": "GPU"}, "autotune": autotune,
                "bench": [{"op": "flash", "case": case, "mode": "fwd", "variant": "triton"}]}

    assert results.merge([part("a", True), part("b", True)], ["1", "2"])["autotune"] is True
    assert results.merge([part("a", True), part("b", False)], ["1", "2"])["autotune"] is False
