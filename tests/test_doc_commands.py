"""The `memx plan`, `memx estimate` and `memx export` commands the README and the docs show run as
written, in order, each document in a folder of its own (a later command reads what an earlier
one wrote, e.g. plan.json). A command that reads a file of the reader's own (runs.csv, a100.yaml)
or shows optional flags in brackets is not runnable as written and is left out; the ones left out
are listed by ``test_the_documents_show_runnable_commands``. memx-run's commands are run by the
end-to-end tests."""

import glob
import os
import re
import shlex

import pytest

from memx_launch.cli.main import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENTS = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))]
COMMAND = re.compile(r"^(?:\.venv/bin/)?memx (plan|estimate|export)\b")
READS = ("--cluster", "--plan", "--cases", "--profile-db")
WRITES = ("--json", "--out", "--plot")


def shell_lines(path: str) -> list[str]:
    """The lines of the document's shell code blocks, continuation lines joined."""
    lines, block = [], None
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        text = f.read().replace("\\\n", " ")
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            block = None if block is not None else line.strip()[3:]
        elif block in ("bash", "sh", "console", ""):
            lines.append(line.strip())
    return lines


def documented_commands() -> tuple[dict, list]:
    """{document: [argv, ...]} of the runnable commands, and the (document, command) left out."""
    runnable, left_out = {}, []
    for path in DOCUMENTS:
        written = set()
        for line in shell_lines(path):
            for part in (p.strip() for p in line.split("&&")):
                if not COMMAND.match(part):
                    continue
                argv = shlex.split(part.split("#")[0])[1:]
                reads = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in READS]
                if "[" in part or any(not os.path.exists(os.path.join(REPO, f)) and f not in written for f in reads):
                    left_out.append((path, part))
                    continue
                written.update(argv[i + 1] for i, a in enumerate(argv[:-1]) if a in WRITES)
                runnable.setdefault(path, []).append(argv)
    return runnable, left_out


RUNNABLE, LEFT_OUT = documented_commands()


def test_the_documents_show_runnable_commands():
    assert sum(len(c) for c in RUNNABLE.values()) >= 7, RUNNABLE
    # what is left out reads the reader's own files (a plan made by a command shown elsewhere) or
    # shows optional flags
    assert all("[" in command or any(f in command for f in ("runs.csv", "runs.jsonl", "a100.yaml", "plan.json"))
               for _, command in LEFT_OUT), LEFT_OUT


@pytest.mark.parametrize("document", sorted(RUNNABLE))
def test_documented_commands_run_as_written(document, tmp_path, monkeypatch, capsys):
    os.symlink(os.path.join(REPO, "examples"), tmp_path / "examples")
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    for argv in RUNNABLE[document]:
        code = main(argv)
        out, err = capsys.readouterr()
        # 3: memx estimate of a layout that does not fit (the README shows one, with its OOM line)
        assert code == 0 or (code == 3 and argv[0] == "estimate" and "OOM" in out), (document, " ".join(argv),
                                                                                    err[-2000:])
        assert "Traceback" not in err, (document, " ".join(argv), err[-2000:])


def test_the_readme_names_the_test_command_ci_runs():
    """`.ci/run`'s pytest line is what the README says CI runs and what benchmarks/ci_duration.py times."""
    from benchmarks.ci_duration import ci_pytest_args

    args = ci_pytest_args()
    assert args[0] == "-q"
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = " ".join(f.read().split())
    assert f"runs `pytest {' '.join(args)}`" in readme
