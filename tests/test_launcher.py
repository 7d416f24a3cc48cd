"""memx-run: flag parsing, bad input caught before anything runs, --dry-run output."""

import contextlib
import json
import re
import os
import shlex
import subprocess
import sys
import time

import pytest

from memx_launch.runtime.launcher import build_parser, main, script_flag
from ranks import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "examples", "train.py")
CPU_CLUSTER = os.path.join(REPO, "examples", "clusters", "cpu-emulated.yaml")
OWN_MODEL = os.path.join(REPO, "examples", "train_own_model.py")
PAPER_CLUSTER = os.path.join(REPO, "examples", "clusters", "paper-20gpu.yaml")


def test_torchrun_flags_keep_both_spellings_and_script_args_stay():
    for flag in ("--nproc-per-node", "--nproc_per_node"):
        args = build_parser().parse_args([flag, "4", "--max-restarts", "2", "--cluster", "c.yaml", "--dry-run",
                                          "train.py", "--model", "llama2-7b", "--steps", "3"])
        assert args.nproc_per_node == "4" and args.max_restarts == 2 and args.cluster == "c.yaml" and args.dry_run
        assert args.training_script_args == ["--model", "llama2-7b", "--steps", "3"]


def test_script_model_is_read_and_memx_flag_wins(capsys):
    assert script_flag(["--steps", "3", "--model=llama-tiny"], "--model") == "llama-tiny"
    # memx's --model (llama-tiny) overrides the script's (llama2-7b) for planning
    rc = main(["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run", "--model", "llama-tiny",
               TRAIN, "--model", "llama2-7b"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "model                   llama-tiny  (flag)" in out
    # the script keeps its own arguments in the reproduce line
    assert "examples/train.py --model llama2-7b" in out


def _run(argv, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "memx_launch.runtime.launcher", *argv], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def _run_here(argv, tmp_path, monkeypatch, capsys):
    """memx-run's main in this process, from ``tmp_path``: what :func:`_run` gives without
    starting an interpreter that imports torch (3 s each)."""
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _error_line(stderr):
    lines = [l for l in stderr.splitlines() if l.strip()]
    assert len(lines) == 1, stderr  # one line, no traceback
    assert lines[0].startswith("memx-run: error: ")
    return lines[0]


def _tiny_plan(tmp_path):
    """A valid 4-rank llama-tiny plan from the dry run."""
    path = tmp_path / "tiny-plan.json"
    assert main(["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run", "--export-plan", str(path),
                 TRAIN, "--model", "llama-tiny"]) == 0
    return path


@pytest.mark.parametrize("case", ["unknown model", "cluster size", "missing script", "corrupt plan",
                                  "plan for another model", "plan for another world size", "mixture of experts",
                                  "latent attention"])
def test_bad_input_is_one_line_and_nothing_starts(tmp_path, case, monkeypatch, capsys):
    base = ["--nproc-per-node", "4", "--cluster", CPU_CLUSTER]
    if case == "unknown model":
        argv, field = base + [TRAIN, "--model", "llama-huge"], "--model"
    elif case == "cluster size":
        argv, field = ["--nproc-per-node", "2", "--cluster", CPU_CLUSTER, TRAIN, "--model", "llama-tiny"], \
            "--nproc-per-node"
    elif case == "missing script":
        argv, field = base + ["nope/train.py", "--model", "llama-tiny"], "training_script"
    elif case == "corrupt plan":
        bad = tmp_path / "bad.json"
        bad.write_text('{"version": 1, "model": ')
        argv, field = base + ["--plan", str(bad), TRAIN, "--model", "llama-tiny"], "--plan"
    elif case == "mixture of experts":  # memx's own LLaMA has no experts: a catalog mixture is refused up front
        argv, field = base + [TRAIN, "--model", "mixtral-8x7b"], "--model: mixtral-8x7b has experts, which"
    elif case == "latent attention":  # nor latent attention: its config.json's own module trains it
        argv, field = base + [TRAIN, "--model", "deepseek-v3"], "has experts and latent attention, which memx's own"
    elif case == "plan for another model":
        plan = _tiny_plan(tmp_path)
        argv, field = base + ["--plan", str(plan), TRAIN, "--model", "llama-small"], "--plan"
    else:
        plan = _tiny_plan(tmp_path)
        argv, field = ["--nproc-per-node", "2", "--plan", str(plan), TRAIN, "--model", "llama-tiny"], "--plan"
    before = sorted(p.name for p in tmp_path.iterdir())
    snapshot = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    # One case through the console command (its exit code and output), the others through main.
    rc, out, err = _run(argv, tmp_path) if case == "unknown model" else _run_here(argv, tmp_path, monkeypatch, capsys)
    assert rc != 0
    assert field in _error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no run directory, no new files
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == snapshot


@pytest.mark.parametrize("dry_run", [False, True], ids=["bad input", "dry run"])
def test_the_fork_server_started_first_is_stopped_after_bad_input_and_a_dry_run_starts_none(tmp_path, dry_run):
    """memx-run starts its workers' fork server before it imports torch (agent.start_fork_server):
    bad input stops it again, and a dry run, which starts no worker, never starts one."""
    import uuid

    import psutil

    mark = uuid.uuid4().hex  # the fork server inherits memx-run's environment, this variable too
    argv = ["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, *(["--dry-run"] if dry_run else []), TRAIN, "--model",
            "llama-tiny" if dry_run else "llama-huge"]
    proc = subprocess.Popen([sys.executable, "-m", "memx_launch.runtime.launcher", *argv], cwd=tmp_path,
                            env={**os.environ, "MEMX_TEST_MARK": mark}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    seen = set()
    while proc.poll() is None:
        with contextlib.suppress(psutil.NoSuchProcess):
            seen.update(" ".join(c.cmdline()) for c in psutil.Process(proc.pid).children())
        time.sleep(0.05)
    assert (proc.returncode == 0) == dry_run
    assert any("forkserver" in c for c in seen) != dry_run, seen
    left, fork_servers = [], []
    for p in psutil.process_iter():
        # Read each process once, inside the guard: one that ends meanwhile is a zombie, not left.
        with contextlib.suppress(psutil.Error):
            if p.environ().get("MEMX_TEST_MARK") == mark and p.status() != psutil.STATUS_ZOMBIE:
                command = " ".join(p.cmdline())
                left.append(p)
                fork_servers += [command] if "forkserver" in command else []
    assert not fork_servers
    # multiprocessing's resource tracker ends by itself once the last of its users is gone
    assert not psutil.wait_procs(left, timeout=10)[1]


def test_export_plan_never_overwrites(tmp_path):
    target = tmp_path / "plan.json"
    target.write_text("keep me")
    rc, _, err = _run(["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run", "--export-plan", str(target),
                       TRAIN, "--model", "llama-tiny"], tmp_path)
    assert rc != 0 and "--export-plan" in _error_line(err)
    assert target.read_text() == "keep me"


@pytest.mark.skipif(not os.path.exists(PAPER_CLUSTER), reason="paper-20gpu.yaml not in the tree yet")
def test_dry_run_paper_cluster_prints_plan_and_a_torchrun_line_torchrun_accepts(tmp_path):
    from torch.distributed.run import get_args_parser

    # no --nproc-per-node: each node's count is its entry in the file (4, 8 and 8 GPUs)
    rc, out, err = _run(["--cluster", PAPER_CLUSTER, "--dry-run", TRAIN, "--model", "llama2-7b"], tmp_path)
    assert rc == 0, err
    assert "winner:" in out and "llama2-7b" in out
    lines = [l.strip() for l in out.splitlines() if " torchrun " in l]
    assert lines
    assert len(lines) == 3
    for node_rank, (line, gpus) in enumerate(zip(lines, (4, 8, 8))):
        words = shlex.split(line)
        env = [w for w in words[:words.index("torchrun")]]
        assert any(w.startswith("MEMX_PLAN=") for w in env)
        args = get_args_parser().parse_args(words[words.index("torchrun") + 1:])
        assert args.training_script.endswith("train.py")
        assert args.training_script_args == ["--model", "llama2-7b"]
        assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("3", node_rank, str(gpus))


def test_nodes_take_their_own_process_count_from_the_cluster_file(capsys):
    from memx_launch.runtime.launcher import resolve

    for node_rank, gpus in ((0, 4), (2, 8)):
        args = build_parser().parse_args(["--nnodes", "3", "--node-rank", str(node_rank), "--cluster", PAPER_CLUSTER,
                                          TRAIN, "--model", "llama2-7b"])
        resolved = resolve(args)
        assert args.nproc_per_node == str(gpus)
        rendered = resolved["settings"].render()
        assert f"processes on this node  {gpus}  (file: node {node_rank}" in rendered
        assert "world size              20  (file)" in rendered


def test_memx_run_prices_its_blocks_as_the_eager_ops_they_run():
    """memx's runtime runs the user's (or memx's) blocks as eager PyTorch ops: planned with their host time."""
    from memx_launch.runtime.launcher import resolve

    args = build_parser().parse_args(["--nnodes", "3", "--node-rank", "0", "--cluster", PAPER_CLUSTER, TRAIN,
                                      "--model", "llama2-7b"])
    assert resolve(args)["training"].eager_block is True


@pytest.mark.parametrize("argv, field", [
    (["--nnodes", "3", "--node-rank", "1", "--nproc-per-node", "4"], "--nproc-per-node"),
    (["--nnodes", "3", "--node-rank", "3"], "--node-rank"),
    (["--nnodes", "2"], "--nnodes")])
def test_node_counts_that_disagree_with_the_file_are_refused(argv, field):
    from memx_launch.errors import ConfigError
    from memx_launch.runtime.launcher import resolve

    with pytest.raises(ConfigError) as info:
        resolve(build_parser().parse_args([*argv, "--cluster", PAPER_CLUSTER, TRAIN, "--model", "llama2-7b"]))
    assert info.value.field == field


def test_a_plan_recomputing_k_of_a_stages_layers_is_taken(tmp_path, capsys):
    """memx-run runs full:K (its stages checkpoint their first K blocks)."""
    target = tmp_path / "plan.json"
    assert main(["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run", "--export-plan", str(target),
                 TRAIN, "--model", "llama-tiny"]) == 0
    data = json.loads(target.read_text())
    data["stages"][0]["recompute"] = "full:1"
    target.write_text(json.dumps(data))
    capsys.readouterr()
    rc = main(["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run", "--plan", str(target),
               TRAIN, "--model", "llama-tiny"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "plan's setup" not in out.out + out.err  # memx-run's own plan: counted as it runs
    data["stages"][0]["recompute"] = "full:99"
    target.write_text(json.dumps(data))
    rc = main(["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run", "--plan", str(target),
               TRAIN, "--model", "llama-tiny"])
    assert rc == 2 and "full:99" in capsys.readouterr().err


def test_the_search_restrictions_of_memx_plan_restrict_memx_run_s_search(tmp_path, capsys):
    target = tmp_path / "plan.json"
    assert main(["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run", "--export-plan", str(target),
                 "--pp", "4", "--micro-batch-sizes", "2", "--recompute-levels", "none,full",
                 TRAIN, "--model", "llama-tiny"]) == 0
    plan = json.loads(target.read_text())
    assert plan["pp"] == 4 and plan["micro_batch_size"] == 2
    assert {s["recompute"].split(":")[0] for s in plan["stages"]} <= {"none", "full"}
    assert "search pipeline degrees" in capsys.readouterr().out
    for argv, field in ((["--tp", "3"], "--tp"), (["--schedules", "gpipe"], "--schedules"),
                        (["--model-builder", f"{OWN_MODEL}:build", "--tp", "2"], "--tp")):
        assert main(["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run", *argv,
                     TRAIN, "--model", "llama-tiny"]) == 2
        assert f"error: {field}:" in capsys.readouterr().err
    # With a given (or continued) plan the restrictions hold for the job's re-plans; the same
    # command repeated continues a stopped run, so they are never refused.
    assert main(["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run", "--plan", str(target),
                 "--pp", "2", TRAIN, "--model", "llama-tiny"]) == 0
    assert "search pipeline degrees (re-plans)" in capsys.readouterr().out
    assert main(["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run", "--plan", str(target),
                 "--pp", "2", "--no-replan", TRAIN, "--model", "llama-tiny"]) == 0
    assert "search pipeline degrees (unused: --no-replan)" in capsys.readouterr().out
    # The script's own blocks train with TP 1: its search and re-plans keep to it.
    own = os.path.join(os.path.dirname(OWN_MODEL), "models", "own-gpt-tiny")
    assert main(["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run", "--model-builder",
                 f"{OWN_MODEL}:build", OWN_MODEL, "--model", own]) == 0
    out = capsys.readouterr().out
    assert re.search(r"search tp degrees +1 +\(--model-builder\)", out)
    assert re.findall(r" tp=(\d+) pp=", out) and set(re.findall(r" tp=(\d+) pp=", out)) == {"1"}
    # So do blocks of a config memx has no TP plan for (GPT-2), without --model-builder
    gpt2 = os.path.join(os.path.dirname(OWN_MODEL), "models", "hf-gpt2-tiny")
    assert main(["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run", TRAIN, "--model", gpt2]) == 0
    assert re.search(r"search tp degrees +1 +\(--model\)", capsys.readouterr().out)


def test_the_workers_read_the_restrictions_back():
    from memx_launch.runtime.worker_env import search_restrictions
    env = {"MEMX_SEARCH_RESTRICTIONS": json.dumps({"tp_degrees": [1, 2], "schedules": ["1f1b"]})}
    assert search_restrictions(env) == {"tp_degrees": (1, 2), "schedules": ("1f1b",)}
    assert search_restrictions({}) == {}


def test_the_jobs_searches_leave_the_monitors_free_memory_unless_re_planning_is_off():
    from memx_launch.planning.replan import DEFAULT_MIN_HEADROOM
    from memx_launch.runtime.job_planning import job_search_space
    restricted = {"MEMX_SEARCH_RESTRICTIONS": json.dumps({"tp_degrees": [1]})}
    space = job_search_space(restricted)
    assert space.memory_headroom == DEFAULT_MIN_HEADROOM > 0
    assert space.tp_degrees == (1,) and not space.fewer_microbatches_than_stages
    assert job_search_space({**restricted, "MEMX_MIN_HEADROOM": "0.25"}).memory_headroom == 0.25
    assert job_search_space({**restricted, "MEMX_NO_REPLAN": "1"}).memory_headroom == 0.0


def test_the_dry_run_plans_as_the_job_does(tmp_path, monkeypatch, capsys):
    """--dry-run's plan (the one its torchrun line runs) is searched as the job's rank 0 searches:
    with the script's block as it runs, and the free memory the monitor will ask for."""
    own = os.path.join(os.path.dirname(OWN_MODEL), "models", "own-gpt-tiny")
    plan_path = tmp_path / "own.json"
    rc, out, _ = _run_here(["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run", "--export-plan",
                            str(plan_path), "--model-builder", f"{OWN_MODEL}:build", OWN_MODEL, "--model", own],
                           tmp_path, monkeypatch, capsys)
    assert rc == 0 and "the script's block runs fused_qkv=True" in out  # its one qkv linear
    assert json.loads(plan_path.read_text())["training"]["fused_qkv"] is True
    argv = ["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run", TRAIN, "--model", "llama-tiny"]
    fullest = lambda out: max(int(p) for p in re.findall(r"MiB \((\d+)%\)", out.split("winner:")[1]))
    rc, out, _ = _run_here([*argv[:5], "--no-replan", *argv[5:]], tmp_path, monkeypatch, capsys)
    assert rc == 0 and fullest(out) > 14
    monkeypatch.setenv("MEMX_MIN_HEADROOM", "0.86")
    rc, out, _ = _run_here(argv, tmp_path, monkeypatch, capsys)
    assert rc == 0 and fullest(out) <= 14


def test_a_builder_that_fails_on_the_dry_runs_model_is_one_line(tmp_path, monkeypatch, capsys):
    script = tmp_path / "train_broken.py"
    script.write_text("def build(model, seed):\n    raise ValueError(f'no such folder: {model}')\n")
    rc, _, err = _run_here(["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run", "--model-builder",
                            f"{script}:build", str(script), "--model", "llama-tiny"], tmp_path, monkeypatch, capsys)
    assert rc == 2
    assert _error_line(err).startswith("memx-run: error: --model-builder: build('llama-tiny', 0) in ")
    assert "raised ValueError: no such folder: llama-tiny" in err


def test_version_on_both_commands(capsys):
    from importlib.metadata import version

    from memx_launch.cli import main as memx_main

    for command, name in ((main, "memx-run"), (memx_main, "memx")):
        with pytest.raises(SystemExit) as info:
            command(["--version"])
        assert info.value.code == 0 and capsys.readouterr().out == f"{name} {version('memx')}\n"


def test_a_mistyped_flag_is_one_line_with_the_nearest_flag(tmp_path):
    rc, _, err = _run(["--nproc-per-node", "4", "--clustr", CPU_CLUSTER, TRAIN, "--model", "llama-tiny"], tmp_path)
    assert rc == 2
    assert _error_line(err) == ("memx-run: error: unrecognized arguments: --clustr; did you mean --cluster? "
                                "(see 'memx-run --help')")


@pytest.mark.parametrize("case", ["script flag typo", "memx-run flag after the script", "script syntax",
                                  "builder function", "batch for the pipeline", "batch never divides"])
def test_what_a_worker_would_refuse_after_calibrating_is_refused_before(tmp_path, case):
    from memx_launch.errors import ConfigError
    from memx_launch.runtime.launcher import resolve

    script, before, after = TRAIN, [], ["--model", "llama-tiny"]
    if case == "script flag typo":
        after, field, says = after + ["--stepz", "3"], "training_script", "does not take --stepz"
        fix = "did you mean --steps?"
    elif case == "memx-run flag after the script":
        after, field, says, fix = after + ["--dry-run"], "training_script", "does not take --dry-run", "memx-run's"
    elif case == "script syntax":
        script = tmp_path / "broken.py"
        script.write_text("import argparse\ndef main(:\n")
        field, says, fix = "training_script", "broken.py line 2", "nothing was started"
    elif case == "builder function":
        before, field, says, fix = ["--model-builder", f"{OWN_MODEL}:buld"], "--model-builder", "no function 'buld'", \
            "did you mean build?"
    elif case == "batch for the pipeline":  # pp 4 needs 4 micro-batches; 2 sequences give 2 at most
        before, field, says, fix = ["--pp", "4", "--global-batch-size", "2"], "--global-batch-size", \
            "fewer micro-batches than pipeline stages", "raise"
    else:
        before, field, says, fix = ["--global-batch-size", "3", "--micro-batch-sizes", "2,4"], "--global-batch-size", \
            "not divisible", "multiple"
    argv = ["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, *before, str(script), *after]
    with pytest.raises(ConfigError) as info:
        resolve(build_parser().parse_args(argv))
    assert info.value.field == field and says in info.value.problem and fix in info.value.fix


def test_script_flags_are_judged_only_where_the_script_declares_them_for_sure(tmp_path):
    import ast

    from memx_launch.runtime.script_check import check_script_args, declared_flags

    plain = ("import argparse\nfor p in []: print(p)\ndef main():\n    p = argparse.ArgumentParser()\n"
             "    g = p.add_argument_group('x')\n    g.add_argument('--steps', '-s')\n    p.add_argument('--lr')\n"
             "    return p.parse_args()\n")
    assert declared_flags(ast.parse(plain)) == {"--steps", "--lr"}
    for unsure in ("p.parse_known_args()", "add_common(p)", "p.add_subparsers()", "p.add_argument(*FLAGS)"):
        assert declared_flags(ast.parse(plain.replace("return p.parse_args()", unsure))) is None, unsure
    assert declared_flags(ast.parse("import sys\nprint(sys.argv)\n")) is None
    path = tmp_path / "s.py"
    path.write_text(plain)
    check_script_args(str(path), ["--steps=3", "--st", "4", "--lr", "1", "--", "--anything"])  # = and prefixes
    with pytest.raises(Exception, match="does not take --epochs"):
        check_script_args(str(path), ["--epochs", "3"])


def test_max_slowdown_reaches_the_search_and_the_workers(tmp_path, capsys):
    from memx_launch.planning.search import SearchSpace
    from memx_launch.runtime.launcher import resolve
    from memx_launch.runtime.worker_env import search_restrictions

    argv = ["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run", "--max-slowdown", "0%",
            TRAIN, "--model", "llama-tiny"]
    restrictions = resolve(build_parser().parse_args(argv))["restrictions"]
    env = {"MEMX_SEARCH_RESTRICTIONS": json.dumps(restrictions)}
    assert SearchSpace(**search_restrictions(env)).max_slowdown == 0.0
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "at most 0% slower than the fastest plan  (flag)" in out
    assert "the winner is the fastest feasible plan (--max-slowdown 0%)" in out
    assert main(argv[:5] + ["--max-slowdown", "5", *argv[7:]]) == 2
    assert "--max-slowdown: expected a share" in capsys.readouterr().err


def test_bf16_on_a_device_without_it_is_fp16_in_the_job_or_refused_when_asked():
    from memx_launch.errors import ConfigError
    from memx_launch.runtime.launcher import resolve

    v100 = os.path.join(REPO, "examples", "clusters", "v100-t4.yaml")
    argv = ["--nnodes", "2", "--cluster", v100, TRAIN, "--model", "llama2-7b"]
    resolved = resolve(build_parser().parse_args(argv))
    assert resolved["training"].dtype == "fp16"
    assert "dtype                   fp16, not the default bf16: no bf16 on v100-32gb" in resolved["settings"].render()
    with pytest.raises(ConfigError, match="--dtype: bf16, but there is no bf16"):
        resolve(build_parser().parse_args(["--dtype", "bf16", *argv]))


def test_a_silent_listener_on_the_store_port_is_one_line_not_minutes_of_silence():
    """Something that accepts connections on the rendezvous port but is no torch store: memx-run
    says so within its answer time, before the agent starts (torch would wait out its timeout)."""
    import datetime
    import socket
    import time

    from torch.distributed import TCPStore

    from memx_launch.errors import ConfigError
    from memx_launch.runtime.rendezvous import check_endpoint, store_answers

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # the kernel accepts connections; nobody answers
        port = silent.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(ConfigError, match=rf"--rdzv-endpoint: 127.0.0.1:{port} accepts connections but did not "
                                              "answer as a torch store within 0.5 s"):
            store_answers("127.0.0.1", port, "--rdzv-endpoint", answer_s=0.5)
        assert time.monotonic() - start < 5
        args = build_parser().parse_args(["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", TRAIN])
        with pytest.raises(ConfigError, match="--rdzv-endpoint: .* did not answer as a torch store"):
            check_endpoint(args, answer_s=0.5)  # memx-run's check before the agent starts
        args = build_parser().parse_args(["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                                          "--master-port", str(port), TRAIN])
        with pytest.raises(ConfigError, match="--master-port: .* did not answer as a torch store"):
            check_endpoint(args, answer_s=0.5)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    assert store_answers("127.0.0.1", store.port, "--rdzv-endpoint")  # a store answers its ping
    assert not store_answers("127.0.0.1", free_port(), "--rdzv-endpoint")  # nothing there yet: torch waits for it


def test_a_given_plan_keeps_its_batch_for_the_job_and_its_re_plans(tmp_path):
    """The workers train the plan's batch; the re-plans (MEMX_TRAINING) must plan for the same
    one, not memx-run's default (16 on emulated clusters): a flag may only repeat it."""
    from memx_launch.cli.main import main as memx
    from memx_launch.errors import ConfigError
    from memx_launch.runtime.launcher import resolve

    plan = tmp_path / "plan.json"
    assert memx(["estimate", "--model", "llama-tiny", "--cluster", CPU_CLUSTER, "--tp", "1", "--pp", "4", "--dp", "1",
                 "--micro-batch-size", "1", "--global-batch-size", "4", "--seq-len", "32", "--dtype", "fp32",
                 "--json", str(plan)]) == 0
    base = ["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--plan", str(plan), "--run-dir", str(tmp_path / "r")]
    resolved = resolve(build_parser().parse_args([*base, TRAIN, "--model", "llama-tiny"]))
    assert (resolved["training"].global_batch_size, resolved["training"].seq_len) == (4, 32)
    assert re.search(r"global batch size +4 +\(plan\)", resolved["settings"].render())
    # Counted without --setup memx-run: the settings say so (its predicted peaks are the monitor's baseline).
    assert re.search(r"plan's setup +none: its memory and time counted for another framework",
                     resolved["settings"].render())
    with pytest.raises(ConfigError, match="--global-batch-size: 16, but the plan trains 4"):
        resolve(build_parser().parse_args([*base, "--global-batch-size", "16", TRAIN, "--model", "llama-tiny"]))


def test_fully_sharded_plans_in_the_job_and_a_given_one_stays_so_in_its_re_plans(tmp_path, capsys):
    """--fully-sharded searches FSDP2 plans counted as the runtime holds them (hold_gathered always);
    a given fully sharded plan's re-plans keep it (and its shard groups), and one counted for less is refused."""
    from memx_launch.runtime.launcher import resolve

    target = tmp_path / "plan.json"
    argv = ["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run"]
    assert main([*argv, "--fully-sharded", "--tp", "1", "--pp", "2", "--export-plan", str(target),
                 TRAIN, "--model", "llama-tiny"]) == 0
    plan = json.loads(target.read_text())
    assert (plan["dp"], plan["training"]["fully_sharded"], plan["training"]["hold_gathered"]) == (2, True, "always")
    assert re.search(r"data parallel +fully sharded \(FSDP2\)  \(flag\)", capsys.readouterr().out)
    resolved = resolve(build_parser().parse_args([*argv, "--plan", str(target), TRAIN, "--model", "llama-tiny"]))
    assert resolved["training"].fully_sharded and resolved["training"].hold_gathered == "always"
    assert "fully sharded (FSDP2)  (plan)" in resolved["settings"].render()
    plan["training"]["shard_degree"] = 1  # HSDP: each replica a shard group of its own, re-planned so too
    target.write_text(json.dumps(plan))
    resolved = resolve(build_parser().parse_args([*argv, "--plan", str(target), TRAIN, "--model", "llama-tiny"]))
    assert resolved["training"].shard_degree == 1
    assert "HSDP, shard groups of 1 (FSDP2)  (plan)" in resolved["settings"].render()
    assert not resolve(build_parser().parse_args([*argv, TRAIN, "--model", "llama-tiny"]))["training"].fully_sharded
    plan["training"]["hold_gathered"] = "never"
    target.write_text(json.dumps(plan))
    assert main([*argv, "--plan", str(target), TRAIN, "--model", "llama-tiny"]) == 2
    assert "plan with --setup memx-run (or --hold-gathered always)" in capsys.readouterr().err


def test_shard_degree_plans_hsdp_in_the_job_and_only_with_full_sharding(tmp_path, capsys):
    """--fully-sharded --shard-degree N searches plans sharded over N ranks of each DP group (HSDP);
    without full sharding, or against a given plan's degree, it is refused by name."""
    target = tmp_path / "plan.json"
    argv = ["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run"]
    # Two device types of two: stages of DP 2, each replica a shard group of one (the replicate dimension only).
    assert main([*argv, "--fully-sharded", "--shard-degree", "1", "--tp", "1", "--pp", "2",
                 "--export-plan", str(target), TRAIN, "--model", "llama-tiny"]) == 0
    plan = json.loads(target.read_text())
    assert (plan["dp"], plan["training"]["shard_degree"]) == (2, 1)
    assert re.search(r"data parallel +HSDP, shard groups of 1 \(FSDP2\)  \(flag\)", capsys.readouterr().out)
    for flags, says in ((["--shard-degree", "2"], "--shard-degree: 2, but nothing is sharded; add --fully-sharded"),
                        (["--plan", str(target), "--shard-degree", "2"],
                         "--shard-degree: 2, but the plan shards over 1; drop it")):
        assert main([*argv, *flags, TRAIN, "--model", "llama-tiny"]) == 2
        assert says in capsys.readouterr().err


def test_the_workers_run_pytorch_s_allocator_in_expandable_segments_unless_the_user_set_it(tmp_path, monkeypatch,
                                                                                           capsys):
    """memx-run hands its workers PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the small
    allocator reserve memx counts) and says so; a user's own setting is kept and named."""
    from memx_launch.runtime import agent, launcher

    argv = ["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--run-dir", str(tmp_path / "run"), TRAIN,
            "--model", "llama-tiny"]
    monkeypatch.setattr(os, "environ", os.environ.copy())  # launch() exports the job's variables
    seen = []
    monkeypatch.setattr(agent, "run_agent", lambda *a, **k: seen.append(os.environ.get("PYTORCH_CUDA_ALLOC_CONF")) or 0)
    for given in (None, "max_split_size_mb:128"):
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if given:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = given
        args = build_parser().parse_args(argv)
        resolved = launcher.resolve(args)
        assert ("CUDA allocator", given or "expandable_segments:True",
                given and "PYTORCH_CUDA_ALLOC_CONF" or "default") in resolved["settings"].rows
        assert launcher.launch(args, resolved) == 0
    assert seen == ["expandable_segments:True", "max_split_size_mb:128"]


def test_a_hugging_face_mixture_of_experts_is_planned_with_every_expert_whole_on_a_rank(tmp_path, capsys):
    """memx-run trains a Hugging Face mixture as the user's module (tests/test_adapters.py): its search
    keeps TP 1 and no expert parallelism, and a plan that splits the experts is refused."""
    from memx_launch.planning.plan import Plan

    target = tmp_path / "plan.json"
    hf_train, mixtral = os.path.join(REPO, "examples", "train_hf.py"), os.path.join(REPO, "examples", "models",
                                                                                     "hf-mixtral-tiny")
    assert main(["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run", "--export-plan", str(target),
                 hf_train, "--model", mixtral]) == 0
    plan = Plan.load(str(target))
    assert plan.model_spec.num_experts == 4 and max(plan.stage_tps) == 1
    assert plan.training.get("expert_parallel", 1) == 1 and "ep=1" in capsys.readouterr().out
    data = json.loads(target.read_text())
    data["training"]["expert_parallel"] = 2
    target.write_text(json.dumps(data))
    assert main(["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run", "--plan", str(target),
                 hf_train, "--model", mixtral]) == 2
    assert "--expert-parallel 1" in capsys.readouterr().err


def test_frozen_fraction_plans_a_fine_tuning_job_and_a_given_plan_keeps_its_share(tmp_path, capsys):
    """--frozen-fraction F plans the job's fine-tuning (the share of parameters its script freezes);
    a given plan brings its share, and a flag naming another is refused by name."""
    from memx_launch.runtime.launcher import resolve

    target = tmp_path / "plan.json"
    argv = ["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run"]
    assert main([*argv, "--frozen-fraction", "0.25", "--export-plan", str(target), TRAIN, "--model", "llama-tiny"]) == 0
    assert json.loads(target.read_text())["training"]["frozen_fraction"] == 0.25
    assert re.search(r"frozen parameters +25% \(fine-tuning\)  \(flag\)", capsys.readouterr().out)
    resolved = resolve(build_parser().parse_args([*argv, "--plan", str(target), TRAIN, "--model", "llama-tiny"]))
    assert resolved["training"].frozen_fraction == 0.25 and "25% (fine-tuning)  (plan)" in resolved["settings"].render()
    assert resolve(build_parser().parse_args([*argv, TRAIN, "--model", "llama-tiny"]))["training"].frozen_fraction == 0
    assert main([*argv, "--plan", str(target), "--frozen-fraction", "0.5", TRAIN, "--model", "llama-tiny"]) == 2
    assert "--frozen-fraction: 0.5, but the plan freezes 0.25; drop it" in capsys.readouterr().err


def test_a_model_whose_frozen_share_is_not_the_plans_is_named(caplog):
    import torch

    from memx_launch.runtime.prepare import check_frozen_share

    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 30))  # 110 and 330 parameters
    model[0].requires_grad_(False)
    with caplog.at_level("WARNING", logger="memx"):
        check_frozen_share(model, 0.25)  # the model's 25.0%: as planned
        assert not caplog.records
        check_frozen_share(model, 0.0)
    assert "25.0% of the model's parameters are frozen but the plan priced 0.0%: memx-run --frozen-fraction 0.250" \
        in caplog.text


def test_param_dtype_plans_a_model_loaded_in_16_bits_without_a_master_copy(tmp_path, capsys):
    """--param-dtype bf16 (a checkpoint from_pretrained keeps in bf16) plans 16-bit weights,
    gradients and Adam moments with no fp32 copy, in bf16; a given plan keeps its parameters'
    dtype, and a flag naming another, or another training dtype, is refused by name."""
    from memx_launch.runtime.launcher import resolve

    target = tmp_path / "plan.json"
    argv = ["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run"]
    assert main([*argv, "--param-dtype", "bf16", "--export-plan", str(target), TRAIN, "--model", "llama-tiny"]) == 0
    planned = json.loads(target.read_text())["training"]
    assert (planned["dtype"], planned["weights_dtype"], planned["grad_dtype"], planned["optimizer_dtype"]) == \
        ("bf16", "training", "training", "training_no_master")
    assert re.search(r"parameters +bf16: no fp32 copy  \(flag\)", capsys.readouterr().out)
    resolved = resolve(build_parser().parse_args([*argv, "--plan", str(target), TRAIN, "--model", "llama-tiny"]))
    assert resolved["training"].optimizer_dtype == "training_no_master" and resolved["training"].dtype == "bf16"
    assert "bf16: no fp32 copy  (plan)" in resolved["settings"].render()
    default = resolve(build_parser().parse_args([*argv, "--dtype", "bf16", TRAIN, "--model", "llama-tiny"]))
    assert (default["training"].weights_dtype, default["training"].optimizer_dtype) == ("fp32", "fp32")  # autocast
    for flags, says in ((["--plan", str(target), "--param-dtype", "fp32"],
                         "--param-dtype: fp32, but the plan's parameters are bf16; drop it"),
                        (["--param-dtype", "bf16", "--dtype", "fp16"],
                         "--param-dtype: bf16, but the training runs in fp16; use --dtype bf16, or --param-dtype fp32")):
        assert main([*argv, *flags, TRAIN, "--model", "llama-tiny"]) == 2
        assert says in capsys.readouterr().err


def test_a_model_whose_parameters_are_not_in_the_plans_dtype_is_named(caplog):
    import torch

    from memx_launch.runtime.prepare import check_param_dtype

    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    with caplog.at_level("WARNING", logger="memx"):
        check_param_dtype(model, "bf16")
        assert not caplog.records
        check_param_dtype(model, "fp32")
    assert "the model's parameters are bf16 but the plan priced fp32: memx-run --param-dtype bf16" in caplog.text


def test_a_given_plan_brings_its_training_dtype_to_the_job_and_its_re_plans(tmp_path):
    from memx_launch.runtime.launcher import resolve

    target = tmp_path / "plan.json"
    argv = ["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run"]
    assert main([*argv, "--dtype", "bf16", "--export-plan", str(target), TRAIN, "--model", "llama-tiny"]) == 0
    given = resolve(build_parser().parse_args([*argv, "--plan", str(target), TRAIN, "--model", "llama-tiny"]))
    assert given["training"].dtype == "bf16"  # on the emulated (CPU) cluster the default would be fp32
    told = resolve(build_parser().parse_args([*argv, "--plan", str(target), "--dtype", "fp32", TRAIN,
                                              "--model", "llama-tiny"]))
    assert told["training"].dtype == "fp32"
