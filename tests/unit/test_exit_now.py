"""opsd.errors.exit_now: an entry point that has done its work ends with its status, after the exit handlers ran
and the buffered output was flushed, without the interpreter's teardown."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={"PYTHONPATH": str(ROOT), "MARK": str(tmp_path / "mark")})  # fmt: skip


def test_handlers_run_output_is_flushed_and_the_status_is_kept(tmp_path):
    res = run(
        """
        import atexit, logging, os, sys
        from opsd.errors import exit_now
        atexit.register(lambda: open(os.environ["MARK"], "w").write("handler ran"))
        logging.basicConfig(stream=sys.stderr, format="%(message)s")
        logging.getLogger("x").warning("logged")
        sys.stdout.write("no newline, still buffered")  # a pipe: block-buffered until flushed
        class Finalised:
            def __del__(self):
                print("finalised at teardown")
        keep = Finalised()
        exit_now(3)
        print("not reached")
        """,
        tmp_path,
    )
    assert res.returncode == 3, res.stderr
    assert res.stdout == "no newline, still buffered"  # flushed; no teardown ran the finaliser
    assert res.stderr == "logged\n"
    assert (tmp_path / "mark").read_text() == "handler ran"


def test_status_zero_for_none_and_an_exception_ends_the_usual_way(tmp_path):
    assert run("from opsd.errors import exit_now\nexit_now(None)", tmp_path).returncode == 0
    res = run("from opsd.errors import exit_now\nraise KeyError('bug')\nexit_now(0)", tmp_path)
    assert res.returncode == 1 and "KeyError: 'bug'" in res.stderr
