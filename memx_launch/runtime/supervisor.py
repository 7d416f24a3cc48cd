"""What memx-run adds around every training step, so that scripts get it for free.

Before each step: the checks of the previous step, then fault injection (MEMX_FAULT_BALLAST).
The checks run when the next step begins, so that the script has logged a step's results before
any restart (the last step of a run is therefore not checked): the memory monitor and, every
MEMX_CHECKPOINT_EVERY steps, a checkpoint into the run directory. On a re-plan event that all
ranks agree on, rank 0 re-plans (replan.py), writes the new plan atomically to MEMX_PLAN (the
old one stays as ``plan.gen<N>.json``) and logs what and why; every rank then checkpoints and
exits with the planned-restart code, and the next generation resumes from the checkpoint with
the new plan at the next step. An out-of-memory error on one rank cannot be agreed on (the
other ranks are blocked on it): that rank saves the event, re-plans and exits with the same
code; the next generation resumes from the last periodic checkpoint, so the steps after it are
run again (the only case where a step repeats).

Built by runtime.from_env when MEMX_RUN_DIR is set (memx-run). Environment: MEMX_NO_REPLAN=1
(monitor and log only), MEMX_MAX_REPLANS (default 3), MEMX_CHECKPOINT_EVERY (default 10, 0 off),
and the monitor's variables (monitor.MonitorConfig.from_env).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import replace

import torch.distributed as dist

from memx_launch.errors import ConfigError
from memx_launch.runtime.faults import Faults
from memx_launch.runtime.runs import (CHECKPOINT_DIR, COMMAND_VAR, LAUNCHER_PID_VAR, checkpoint_every, max_replans,
                                      record_stopped)
from memx_launch.runtime.monitor import MemoryMonitor, MonitorConfig, memory_reader, oom_event
from memx_launch.planning.plan import Plan
from memx_launch.files import write_json_atomic
from memx_launch.planning.replan import ReplanEvent
from memx_launch.specs.inputs import load_json

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
LAUNCHER_POLL_S = 1.0
REPLANS_FILE = "replans.json"
# Only the latest is resumed from (a step folder is complete before latest.json points at it).
KEEP_CHECKPOINTS = 1
log = logging.getLogger("memx")


def _show_logs() -> None:
    """memx's INFO lines (monitor samples, re-plans) on stderr, unless the script set up logging."""
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("memx-run: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def _stage_changes(old: Plan, new: Plan) -> str:
    if [s.ranks for s in old.stages] != [s.ranks for s in new.stages]:
        return (f"layout pp={old.pp} dp={old.dp} tp={old.tp} -> pp={new.pp} dp={new.dp} tp={new.tp}, layers "
                f"{[s.num_layers for s in new.stages]}, recompute {[s.recompute for s in new.stages]}")
    return "; ".join(f"stage {i} ({a.device_type}): layers {a.num_layers} -> {b.num_layers}, recompute "
                     f"{a.recompute} -> {b.recompute}, predicted {a.predicted_peak_memory_gib * 1024:.1f} -> "
                     f"{b.predicted_peak_memory_gib * 1024:.1f} MiB"
                     for i, (a, b) in enumerate(zip(old.stages, new.stages))
                     if (a.num_layers, a.recompute) != (b.num_layers, b.recompute)) or "no stage changes"


class Supervisor:
    """One rank's monitor, faults, checkpoints and re-planning; Runtime.step calls it."""

    def __init__(self, runtime, run_dir: str, environ=os.environ):
        self.runtime = runtime
        self.run_dir = run_dir
        self.environ = environ
        self.rank = runtime.layout.rank
        from memx_launch.runtime.restarts import restart_generation
        self.generation = restart_generation(environ)
        self.replan_enabled = environ.get("MEMX_NO_REPLAN", "0") != "1"
        self.max_replans = max_replans(environ)
        self.checkpoint_every = checkpoint_every(environ)
        self.checkpoint_dir = os.path.join(run_dir, CHECKPOINT_DIR)
        self.faults = Faults.from_env(environ)
        self.reader = memory_reader(runtime.emulated, runtime.device) if runtime.memory is None else runtime.memory
        self.config = MonitorConfig.from_env(environ)
        self.monitor = MemoryMonitor(runtime.plan, self.rank, self.reader, self.config)
        self.first_step = 1
        """The first step of this generation: the checks of the step before it ran already."""
        self.signal_received = 0
        """SIGINT, SIGTERM or SIGHUP seen by this rank (0: none); Runtime.step gathers it from every rank."""
        self.stop_signal = 0
        """The largest signal any rank saw by the last completed step: every rank agrees on it."""
        self.launcher_gone = False
        """memx-run's process is gone (killed with SIGKILL): this rank stops as after a SIGHUP."""
        self._launcher = None  # memx-run's process (psutil.Process), where it started this rank
        self._catch_stop_signals()
        self._watch_launcher()
        _show_logs()

    def _note_signal(self, signum, frame=None) -> None:
        self.signal_received = max(self.signal_received, signum)

    def _catch_stop_signals(self) -> None:
        """SIGINT/SIGTERM/SIGHUP (memx-run's agent forwards them) let the step finish; the next
        step checkpoints and stops (stop_at_signal)."""
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                signal.signal(signum, self._note_signal)

    def _watch_launcher(self) -> None:
        """Without memx-run nobody restarts, re-plans or stops the job: when its process is gone,
        stop at the next step boundary with a checkpoint. (Not this process's parent: that is the
        fork server, which lives on while any worker does.)"""
        import psutil

        pid = self.environ.get(LAUNCHER_PID_VAR, "")
        if not pid.isdigit():
            return
        try:
            self._launcher = psutil.Process(int(pid))
        except psutil.NoSuchProcess:  # gone before this rank started
            self.launcher_gone = True
            self._note_signal(signal.SIGHUP)
            return

        def watch():
            while not self._launcher_is_gone():
                time.sleep(LAUNCHER_POLL_S)
            self.launcher_gone = True
            self._note_signal(signal.SIGHUP)

        threading.Thread(target=watch, name="memx-launcher-watch", daemon=True).start()

    def _launcher_is_gone(self) -> bool:
        """memx-run's process has ended (False for a rank not started by it). is_running() tells a
        reused pid apart; a memx-run killed but not yet reaped is a zombie."""
        import psutil

        if self._launcher is None:
            return False
        try:
            return not self._launcher.is_running() or self._launcher.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    def stop_at_signal(self) -> None:
        """Every rank, before a step, when a rank saw a signal by the last one: checkpoint the
        completed steps and exit 128 + the signal (130 SIGINT, 143 SIGTERM, 129 SIGHUP); memx-run
        says so, or rank 0 does when memx-run is gone."""
        step = self.runtime.step_count
        if step and not self._checkpoint_saved(step):
            self.runtime.save_checkpoint(self.checkpoint_dir, keep=KEEP_CHECKPOINTS)
        dist.barrier()
        # Another rank's watcher may have seen memx-run gone first: rank 0 looks for itself.
        if dist.get_rank() == 0 and (self.launcher_gone or self._launcher_is_gone()):
            command = self.environ.get(COMMAND_VAR)
            record_stopped(self.run_dir, json.loads(command) if command else None, "memx-run gone")
            log.warning("memx-run (pid %s) is gone: stopped after step %d with its checkpoint; to continue, run "
                        "the same command again (or with --resume %s)", self.environ[LAUNCHER_PID_VAR], step,
                        self.run_dir)
        dist.destroy_process_group()
        sys.exit(128 + self.stop_signal)

    def _checkpoint_saved(self, step: int) -> bool:
        from memx_launch.runtime.checkpoint import latest_checkpoint

        latest = latest_checkpoint(self.checkpoint_dir) if os.path.isdir(self.checkpoint_dir) else None
        return latest is not None and os.path.basename(latest) == f"step-{step:08d}"

    def resume(self) -> None:
        """Continue from the run's latest checkpoint, when a previous generation left one."""
        resumed = self.runtime.load_checkpoint(self.checkpoint_dir)
        self.first_step = self.runtime.step_count + 1
        if resumed is not None and dist.get_rank() == 0:
            log.info("resumed after step %d from %s (generation %d, plan %s)", resumed.step, resumed.path,
                     self.generation, self.environ.get("MEMX_PLAN"))

    def before_step(self, step: int) -> None:
        """The checks of the step before (run now, so that the script has logged that step's
        results before a restart), then fault injection."""
        if self.stop_signal:
            self.stop_at_signal()
        if step > self.first_step:
            self._after_step(step - 1)
        if self.faults.ballast is not None and self.faults.ballast.before_step(
                step, self.rank, emulated=self.runtime.emulated, device=self.runtime.device):
            log.warning("fault injection: %.4f GiB ballast on rank %d before step %d", self.faults.ballast.gib,
                        self.rank, step)

    def _after_step(self, step: int) -> None:
        event = self.monitor.after_step(step)
        if event is not None:
            if not self.replan_enabled:
                if dist.get_rank() == 0:
                    log.warning("re-planning is off (--no-replan): continuing with the current plan")
            else:
                self._agreed_replan(event)
        if self.checkpoint_every and step % self.checkpoint_every == 0:
            self.runtime.save_checkpoint(self.checkpoint_dir, keep=KEEP_CHECKPOINTS)

    def _agreed_replan(self, event: ReplanEvent) -> None:
        """Every rank: rank 0 decides and writes the decision to a file the others read after a
        barrier (no pickled objects travel)."""
        path = os.path.join(self.run_dir, f"decision.gen{self.generation}.step{event.step}.json")
        if dist.get_rank() == 0:
            try:
                record = self._decide(event)
            except Exception as exc:  # every rank must learn of it, or the others wait forever
                record = {"error": f"{exc}"}
            write_json_atomic(path, record, overwrite=True)
        dist.barrier()
        record = load_json(path, path, fix="delete the run directory's decision files and resume")
        if "error" in record:  # the run stops: keep every step done so far
            self.runtime.save_checkpoint(self.checkpoint_dir, keep=KEEP_CHECKPOINTS)
            if dist.get_rank() == 0:
                log.warning("checkpoint of step %d written before stopping", event.step)
            raise ConfigError("re-plan", record["error"])
        new_plan = Plan.load(self.environ["MEMX_PLAN"])
        if not record["restart"]:  # corrected predictions only: same layout, keep training
            self.runtime.plan = new_plan
            self.monitor = MemoryMonitor(new_plan, self.rank, self.reader, self.config)
            return
        self.runtime.save_checkpoint(self.checkpoint_dir, keep=KEEP_CHECKPOINTS)
        self._planned_restart()

    def on_out_of_memory(self, error: BaseException) -> None:
        """On the rank that ran out of memory: save the event, re-plan here, restart. Re-raises
        when re-planning is off."""
        if not self.replan_enabled:
            raise error
        step = self.runtime.step_count
        event = oom_event(self.runtime.plan, self.rank, step, error, self.reader)
        event.save(os.path.join(self.run_dir, f"oom-event.gen{self.generation}.rank{self.rank}.json"))
        log.warning("out of memory on rank %d in step %d: %s", self.rank, step + 1, event.message)
        self._decide(event)
        log.warning("resuming from the last checkpoint: the steps after it run again")
        self._planned_restart(destroy=False)  # the other ranks are stuck in this step

    def on_peer_failure(self, error: BaseException) -> None:
        """A step failed for another reason than memory on this rank: when a peer is restarting
        for a re-plan (it ran out of memory), restart quietly too; else re-raise."""
        from memx_launch.runtime.restarts import planned_restarts

        if self.generation not in planned_restarts(self.run_dir):
            raise error
        self._planned_restart(destroy=False)

    def _decide(self, event: ReplanEvent) -> dict:
        """Re-plan, write the new plan and the record; on one rank."""
        with _replan_lock(self.run_dir):
            return self._decide_locked(event)

    def _decide_locked(self, event: ReplanEvent) -> dict:
        from memx_launch.planning.replan import replan
        from memx_launch.runtime.restarts import record_planned_restart
        from memx_launch.specs.cluster import ClusterSpec
        from memx_launch.models.block_reading import READ_FIELDS
        from memx_launch.specs.training import TrainingSpec

        env = self.environ
        records = _read_records(self.run_dir)
        # Two ranks out of memory at once: the first one's new plan restarts the generation.
        earlier = [r for r in records if r["generation"] == self.generation and r["restart"]]
        if earlier:
            log.warning("rank %d: generation %d already re-planned (rank %d at step %d); restarting with that plan",
                        self.rank, self.generation, earlier[-1]["rank"], earlier[-1]["step"])
            return earlier[-1]
        done = sum(r["restart"] for r in records)
        if done >= self.max_replans:
            raise ConfigError("MEMX_MAX_REPLANS", f"{event.reason} on rank {event.rank} at step {event.step} would be "
                              f"re-plan {done + 1}, over the limit of {self.max_replans}",
                              "raise MEMX_MAX_REPLANS, free memory on that device, or pass --no-replan")
        from memx_launch.runtime.worker_env import cluster_path, search_restrictions
        path = cluster_path(env)
        if path is None:
            raise ConfigError("--cluster", "re-planning during training needs the cluster file, given or detected "
                              "when the job planned", "pass --cluster FILE to memx-run, or --no-replan")
        plan = self.runtime.plan
        cluster = ClusterSpec.from_yaml(path)
        # The job's setup, with what the in-job plan read off the model's own block (models/block_reading.py).
        own = {k: plan.training[k] for k in READ_FIELDS if k in plan.training}
        training = replace(TrainingSpec(**json.loads(env["MEMX_TRAINING"])), **own)
        budget = float(env["MEMX_SEARCH_BUDGET_S"]) if env.get("MEMX_SEARCH_BUDGET_S") else None
        decision = replan(event, plan, plan.model_spec, cluster, training, _cost_model(env, plan, cluster, training),
                          min_headroom=self.config.min_headroom, search_budget_s=budget,
                          restrictions=search_restrictions(env))
        archive = os.path.join(self.run_dir, f"plan.gen{self.generation}.json")
        if not os.path.exists(archive):  # the plan this generation started with
            plan.save(archive)
        decision.plan.save(env["MEMX_PLAN"], overwrite=True)
        record = {"generation": self.generation, "step": event.step, "reason": event.reason, "rank": event.rank,
                  "stage": event.stage, "action": decision.action, "restart": decision.needs_restart,
                  "why": decision.why, "changes": _stage_changes(plan, decision.plan), "event": event.to_dict()}
        write_json_atomic(os.path.join(self.run_dir, REPLANS_FILE), records + [record], overwrite=True)
        if decision.needs_restart:
            record_planned_restart(self.run_dir, self.generation)
        log.warning("re-plan at step %d: %s on rank %d (stage %d) -> %s: %s", event.step, event.reason,
                    event.rank, event.stage, decision.action, record["changes"])
        log.warning("why: %s", decision.why)
        return record

    def _planned_restart(self, destroy: bool = True) -> None:
        from memx_launch.runtime.restarts import PLANNED_RESTART_EXIT_CODE

        if destroy:
            dist.barrier()
            if dist.get_rank() == 0:
                log.warning("restarting the workers in place with the new plan %s", self.environ["MEMX_PLAN"])
            dist.destroy_process_group()
        sys.exit(PLANNED_RESTART_EXIT_CODE)


@contextlib.contextmanager
def _replan_lock(run_dir: str):
    """One re-plan at a time per run directory (plan.json and replans.json are read, then written)."""
    fd = os.open(os.path.join(run_dir, "replan.lock"), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _read_records(run_dir: str) -> list[dict]:

    path = os.path.join(run_dir, REPLANS_FILE)
    if not os.path.exists(path):
        return []
    records = load_json(path, path, fix="move it away to start the re-plan count afresh")
    if not isinstance(records, list) or not all(isinstance(r, dict) and isinstance(r.get("generation"), int)
                                                and isinstance(r.get("restart"), bool) for r in records):
        raise ConfigError(path, "not a list of re-plan records", "move it away to start the re-plan count afresh")
    return records


def _cost_model(env, plan: Plan, cluster, training):
    """The cost model the job plans with: the ProfileDB's when it holds samples of this model,
    else the analytical one (None)."""
    from memx_launch.profiling.profiledb import ProfileDB

    path = env.get("MEMX_PROFILE_DB", "")
    if not path or not os.path.exists(path) or not ProfileDB(path).for_model(plan.model_spec):
        return None
    from memx_launch.profiling.predictor import load_cost_model
    return load_cost_model(path, plan.model_spec, cluster, training)
