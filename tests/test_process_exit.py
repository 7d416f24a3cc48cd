"""runtime/process_exit.end_process: how memx-run's processes end (and a script run by plain
torchrun may end itself, docs/bring-your-own-model.md): exit handlers run and the streams are
flushed, with the given code, but the interpreter is not finalized."""

import subprocess
import sys

SCRIPT = """
import atexit, sys
from memx_launch.runtime.process_exit import end_process
atexit.register(lambda: print("handler ran", end=""))
class Finalized:
    def __del__(self):
        sys.stdout.write("; finalized")  # interpreter finalization clears the module: not with end_process
kept = Finalized()
sys.stdout.write("last line, unflushed; ")
sys.stderr.write("to stderr")
end_process(3)
print("never printed")
"""


def test_end_process_runs_exit_handlers_flushes_and_exits_with_its_code():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 3
    assert run.stdout == "last line, unflushed; handler ran" and run.stderr == "to stderr"
