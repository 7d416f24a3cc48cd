"""What memx-run reads of the training script and its arguments: the script's own ``--model``
(:func:`script_flag`) and, before any worker calibrates, what it can tell: that Python
compiles it, that a --model-builder FILE defines its FUNCTION, and, where the script declares its
flags with argparse in plain strings, that its own arguments name flags it takes. The files are
read, never imported: nothing of the user's code runs in the launcher.

A script whose flags cannot be read for sure (parse_known_args, subcommands, parents, a parser
handed to another function, flags built at run time, no argparse at all) is not judged.
"""

from __future__ import annotations

import ast
import difflib

from memx_launch.errors import ConfigError

# The source of a script memx-run reads (larger files are not judged, only run).
MAX_SCRIPT_BYTES = 4 * 2**20


def script_flag(script_args: list[str], flag: str) -> str | None:
    """The value of ``flag`` among the script's arguments (``--flag V`` or ``--flag=V``), last wins."""
    value = None
    for i, arg in enumerate(script_args):
        if arg == flag and i + 1 < len(script_args):
            value = script_args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def parse_source(path: str, field: str) -> ast.Module | None:
    """The file's syntax tree; a syntax error is the user's one-line error now, not after calibration."""
    try:
        with open(path, "rb") as f:
            source = f.read(MAX_SCRIPT_BYTES + 1)
    except OSError:  # the workers will say what they make of it
        return None
    if len(source) > MAX_SCRIPT_BYTES:
        return None
    try:
        return ast.parse(source, path)
    except SyntaxError as exc:
        raise ConfigError(field, f"{path} line {exc.lineno}: {exc.msg}", "fix the file; nothing was started") from None
    except ValueError:  # null bytes: not Python source memx can read
        return None


def check_script_args(path: str, script_args: list[str], runner_flags: set[str] = frozenset()) -> None:
    """Refuse a ``--flag`` among the script's arguments that its argparse parser does not declare
    (``runner_flags``: memx-run's and torchrun's, which belong before the script)."""
    tree = parse_source(path, "training_script")
    flags = declared_flags(tree) if tree is not None else None
    if not flags:
        return
    for word in script_args:
        if word == "--":  # argparse: everything after it is positional
            break
        name = word.split("=", 1)[0]
        # argparse also takes a unique prefix of a long flag (allow_abbrev): accept any prefix.
        if not name.startswith("--") or any(flag.startswith(name) for flag in flags):
            continue
        close = difflib.get_close_matches(name, sorted(flags), n=1, cutoff=0.75)
        fix = (f"did you mean {close[0]}?" if close else
               "memx-run's and torchrun's flags go before the script; the script's own after it")
        if name in runner_flags:
            fix = f"{name} is memx-run's: give it before the script"
        raise ConfigError("training_script", f"{path} does not take {name} (its parser declares "
                          f"{', '.join(sorted(flags))})", fix)


def check_builder(path: str, function: str) -> None:
    """--model-builder FILE:FUNCTION names something FILE defines (anywhere in it: a definition
    under an ``if`` is still the module's)."""
    tree = parse_source(path, "--model-builder")
    if tree is None:
        return
    functions = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    bound = functions | {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)} \
        | {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
           for a in n.names}
    if function not in bound:
        close = difflib.get_close_matches(function, sorted(functions), n=1)
        raise ConfigError("--model-builder", f"{path} defines no function {function!r}",
                          f"did you mean {close[0]}?" if close else
                          f"name a function of {path}: {', '.join(sorted(functions)) or 'it defines none'}")


_PARSER_MAKERS = {"ArgumentParser", "add_argument_group", "add_mutually_exclusive_group"}
_UNSURE_CALLS = {"parse_known_args", "parse_known_intermixed_args", "add_subparsers"}


def declared_flags(tree: ast.Module) -> set[str] | None:
    """The long flags the script's argparse calls declare, or None where that is not certain.
    Names are looked up per function (a loop variable ``p`` elsewhere is not the parser ``p``),
    the module's own parsers seen from every function."""
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, _SCOPES)]
    module_parsers = _parser_names(tree)
    if module_parsers is None:
        return None
    flags: set[str] = set()
    made = bool(module_parsers)
    for scope in scopes[1:] + [tree]:
        own = _parser_names(scope)
        if own is None:
            return None
        made |= bool(own)
        parsers = own | module_parsers
        for node in _own_nodes(scope):
            if not isinstance(node, ast.Call):
                continue
            name = _called(node)
            if name in _UNSURE_CALLS:
                return None
            if name == "add_argument":
                receiver = node.func.value if isinstance(node.func, ast.Attribute) else None
                if not (isinstance(receiver, ast.Name) and receiver.id in parsers):
                    return None
                if not all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args):
                    return None
                flags |= {a.value for a in node.args if a.value.startswith("--")}
            # A parser handed to other code may gain flags this file does not show.
            elif any(isinstance(a, ast.Name) and a.id in parsers
                     for a in [*node.args, *(k.value for k in node.keywords)]):
                return None
    return flags if made else None


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _own_nodes(scope):
    """The nodes of ``scope`` outside the functions defined in it."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, _SCOPES):
            stack.extend(ast.iter_child_nodes(node))


def _parser_names(scope) -> set[str] | None:
    """Names a scope binds to a new parser or argument group (None: one built from ``parents``)."""
    names = set()
    for node in _own_nodes(scope):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _called(node.value) in _PARSER_MAKERS:
            if any(k.arg == "parents" for k in node.value.keywords):
                return None
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _called(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
