"""Every bad argument, bad file or request that cannot run here: one line on stderr, exit status 2,
no traceback, and no work done (no result file written)."""
import json

import pytest

import attnbench.operators.flash  # noqa: F401  the built-in operators, loaded as a program would
from attnbench.cli import main


def one_line_error(capsys, argv, *expected):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err  # one line, so no traceback
    assert captured.err.startswith("attnbench")
    for text in expected:
        assert text in captured.err, captured.err
    return captured


BAD_ARGUMENTS = [
    (["bench", "--device", "foo"], "--device foo: expected auto, cpu, cuda or cuda:N"),
    (["bench", "--device", "cpu:1"], "--device cpu:1"),
    (["bench", "--device", "cuda:7"], "--device cuda:7"),  # no CUDA here; on a GPU machine: no 8th GPU
    (["bench", "--seed", "-1"], "--seed: -1 is out of range"),
    (["bench", "--seed", "many"], "--seed: 'many' is not an integer"),
    (["bench", "--op", "flash", "--baseline", "nosuch"], "--baseline nosuch: not a variant of flash"),
    (["bench", "--op", "flash", "--mode", "nosuch"], "--mode nosuch: not a mode of flash; known: bwd, fwd, fwd_bwd"),
    (["check", "--op", "flash", "--variant", "nosuch"], "--variant nosuch: not a variant of flash"),
    (["bench", "--op", "nosuch"], "unknown operator 'nosuch'"),
    (["list", "--op", "nosuch"], "nosuch"),
    (["bench", "--op", "flash", "--cases", "huge"], "--cases huge"),
    (["bench", "--op", "flash", "--match", "D(64"], "--match: 'D(64' is not a regular expression"),
    (["check", "--op", "flash", "--match", " D999 "], "--match ' D999 ': no case of flash matches"),
    (["check", "--match", " D999 "], "--match ' D999 ': no case of flash, jvp_attention"),
    (["check", "--op", "flash", "--shard", "3/2"], "--shard: '3/2': expected 1 <= K <= N"),
    (["bench", "--op", "flash", "--shard", "half"], "--shard: 'half': expected K/N"),
    (["check", "--op", "flash", "--cases", "tiny", "--match", " D32 .* fp16$", "--shard", "40/40"],
     "--shard 40/40: no case of flash is in that part of the cases --match ' D32 .* fp16$' selects"),
    (["check", "--op", "flash", "--cases", "tiny", "--shard", "400/400"], "--shard 400/400: no case of flash is in"),
    (["check", "--graphs"], "unrecognized arguments: --graphs"),  # check times nothing
    (["bench", "--no-such-flag"], "unrecognized arguments"),
    (["nosuch"], "invalid choice"),
    ([], "required: command"),
]


@pytest.mark.parametrize("argv, expected", BAD_ARGUMENTS, ids=[" ".join(a) or "nothing" for a, _ in BAD_ARGUMENTS])
def test_bad_argument(capsys, argv, expected):
    one_line_error(capsys, argv, expected)


def test_bad_argument_names_what_is_known(capsys):
    one_line_error(capsys, ["bench", "--op", "flash", "--baseline", "nosuch"], "reference", "split", "sdpa_math")


@pytest.mark.parametrize("argv, reason", [
    (["bench", "--op", "flash", "--variant", "sdpa_flash"], "variant sdpa_flash cannot run on cpu: needs a CUDA device"),
    (["check", "--op", "flash", "--variant", "flex"], "variant flex cannot run on cpu"),
    (["bench", "--op", "flash", "--baseline", "sdpa_cudnn"], "--baseline sdpa_cudnn: cannot run on cpu"),
    (["bench", "--op", "flash", "--graphs"], "--graphs times CUDA-graph replays: it needs a CUDA device"),
    (["run", "--op", "flash", "--graphs"], "--graphs"),
])
def test_what_cannot_run_here_is_an_error_not_an_empty_table(capsys, tmp_path, argv, reason):
    path = tmp_path / "r.json"
    captured = one_line_error(capsys, argv + ["--device", "cpu", "--json", str(path)], reason)
    assert captured.out == ""  # not even the header: nothing ran
    assert not path.exists()


def test_triton_without_the_interpreter_on_a_cpu_is_an_error(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    one_line_error(capsys, ["bench", "--op", "flash", "--device", "cpu", "--variant", "triton"],
                   "variant triton cannot run on cpu", "TRITON_INTERPRET=1")


@pytest.mark.parametrize("where, reason", [
    ("{tmp}/no/such/dir/x.json", "does not exist"),
    ("{tmp}", "is a directory"),
    ("{tmp}/file/x.json", "is not a directory"),
    ("/proc/attnbench-x.json", "cannot write"),  # refused even to root, unlike a chmod-ed folder
    ("/dev/null", "not a regular file"),
])
@pytest.mark.parametrize("command", ["bench", "check"])
def test_output_path_is_checked_before_any_work(capsys, tmp_path, where, reason, command):
    (tmp_path / "file").write_text("")
    path = where.format(tmp=tmp_path)
    captured = one_line_error(capsys, [command, "--op", "flash", "--json", path], f"--json {path}: ", reason)
    assert captured.out == ""


def report_file(tmp_path, content):
    path = tmp_path / "r.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


ROW = {"op": "flash", "case": "B1 H1 N64 D64 bf16", "mode": "fwd", "variant": "triton", "timing": {"median_ms": 1.0},
       "tflops": 1.0, "max_error": 1e-3}


@pytest.mark.parametrize("content, reason", [
    ([1, 2, 3], "top level is a list"),
    ({"bench": "hello"}, "'bench' must be a list"),
    ({"bench": [{**ROW, "timing": {"median_ms": 0}}]}, "median_ms must be a positive number, got 0"),
    ({"bench": [{"op": "flash", "mode": "fwd", "variant": "triton", "timing": None}]}, "'case' is missing"),
    ({"hello": 1}, "no 'bench' or 'checks' list"),
    ("this is not json", "not JSON"),
    ("", "not JSON"),
])
def test_report_on_a_bad_file(capsys, tmp_path, content, reason):
    one_line_error(capsys, ["report", report_file(tmp_path, content)], reason)


def test_report_on_a_missing_file_or_a_directory(capsys, tmp_path):
    one_line_error(capsys, ["report", str(tmp_path / "none.json")], "no such file")
    one_line_error(capsys, ["report", str(tmp_path)], "is a directory")


def test_report_output_paths_are_checked_first(capsys, tmp_path):
    good = report_file(tmp_path, {"bench": [ROW]})
    one_line_error(capsys, ["report", good, "--markdown", str(tmp_path / "no" / "x.md")], "--markdown")
    one_line_error(capsys, ["report", good, "--plot", str(tmp_path)], "--plot", "is a directory")


def test_report_reads_a_null_throughput_as_not_measured(capsys, tmp_path):
    """tflops null (an operator without a cost model) is data, not a broken file: shown as '-' beside a row that
    has it, and no TF/s column at all where no row does (nothing was measured)."""
    other = {**ROW, "case": "B1 H1 N128 D64 bf16", "tflops": 2.0}
    assert main(["report", report_file(tmp_path, {"bench": [{**ROW, "tflops": None, "roofline_pct": None}, other]})]) == 0
    assert "| B1 H1 N64 D64 bf16 | fwd | 1.000 | - |" in capsys.readouterr().out
    assert main(["report", report_file(tmp_path, {"bench": [{**ROW, "tflops": None, "roofline_pct": None}]})]) == 0
    out = capsys.readouterr().out
    assert "| B1 H1 N64 D64 bf16 | fwd | 1.000 | 1.0e-03 |" in out and "TF/s" not in out


@pytest.mark.parametrize("argv", [5, "list", [1, 2], ["list", 3], b"list"], ids=repr)
def test_main_takes_a_list_of_strings(argv):
    """main("list") had been split into characters ("invalid choice: 'l'"); main(5) raised inside argparse."""
    with pytest.raises(TypeError, match="argv must be a list of str"):
        main(argv)

