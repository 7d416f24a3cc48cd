"""The ``memx`` command: ``plan``, ``estimate``, ``export``, ``profile`` and ``evaluate``.

One ``add_<name>_command(subparsers)`` and one ``run_<name>(args) -> int`` per subcommand;
adding one means writing that pair and listing the first in ``COMMANDS``. Every
:class:`~memx_launch.errors.MemxError` becomes one ``memx: error: ...`` line on stderr and
its exit code (2, or 3 when nothing fits). Nothing here imports torch at module level:
planning and estimating run on any machine; only ``profile`` loads it.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import warnings

from memx_launch.errors import MemxError, NoFeasiblePlanError
from memx_launch.specs.config_file import add_version_arg, config_yaml, parse_with_config
from memx_launch.cli.common import Parser
from memx_launch.cli.measure_commands import add_cluster_command, add_evaluate_command, add_profile_command
from memx_launch.cli.plan_commands import add_estimate_command, add_export_command, add_plan_command


COMMANDS = [add_plan_command, add_estimate_command, add_export_command, add_profile_command,
            add_evaluate_command, add_cluster_command]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="memx", description="Memory-aware parallelism planning for heterogeneous GPU clusters.")
    add_version_arg(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(
        c.__name__[len("add_"):-len("_command")] for c in COMMANDS) + "}", parser_class=Parser)
    for add in COMMANDS:
        add(sub)
    return parser


TERMINATED = 128 + signal.SIGTERM
# How often SIGTERM's exit is raised again until it unwinds (see _terminate).
TERMINATE_RETRY_S = 0.2


def _terminate(signum, frame):
    """SIGTERM: unwind (temporary files are removed on the way out). Raised where the signal lands, the
    exit is dropped when that is a weakref callback or a ``__del__`` (the emulated device's, on every
    tensor freed: Python prints and ignores what they raise), so an alarm raises it again, unless it is
    already unwinding, until it reaches :func:`_run`."""
    sys.unraisablehook = _quiet_terminated_hook(sys.unraisablehook)
    signal.signal(signal.SIGALRM, _terminate_again)
    signal.setitimer(signal.ITIMER_REAL, TERMINATE_RETRY_S, TERMINATE_RETRY_S)
    raise SystemExit(TERMINATED)


def _terminate_again(signum, frame):
    if not isinstance(sys.exc_info()[1], SystemExit):  # dropped, not unwinding: raise it again
        raise SystemExit(TERMINATED)


def _quiet_terminated_hook(default):
    """The unraisable-exception hook, silent about a dropped termination (the one line says it)."""
    def hook(unraisable):
        if not (isinstance(unraisable.exc_value, SystemExit) and unraisable.exc_value.code == TERMINATED):
            default(unraisable)
    return hook


def main(argv: list[str] | None = None) -> int:
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminate)
    with warnings.catch_warnings():  # one line each, like the errors
        warnings.showwarning = lambda message, *_, **__: print(f"memx: warning: {message}", file=sys.stderr)
        return _run(build_parser(), argv)


def _run(parser, argv) -> int:
    try:
        args = parse_with_config(parser, argv)
        if getattr(args, "print_config", False):
            print(config_yaml(parser, args), end="")
            return 0
        return args.handler(args)
    except KeyboardInterrupt:
        print("memx: interrupted; no output file was written", file=sys.stderr)
        return 130
    except SystemExit as exc:
        if exc.code == TERMINATED:
            signal.setitimer(signal.ITIMER_REAL, 0)
            print("memx: terminated; no output file was written", file=sys.stderr)
        raise
    except NoFeasiblePlanError as exc:
        print(f"memx: error: {exc}", file=sys.stderr)
        if exc.closest:
            print("closest candidates (GiB short per device):", file=sys.stderr)
            for text in exc.closest:
                print(f"  {text}", file=sys.stderr)
        return exc.exit_code
    except MemxError as exc:
        print(f"memx: error: {exc}", file=sys.stderr)
        return exc.exit_code
