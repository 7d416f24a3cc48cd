"""Seconds to fit the predictor (fit_predictor: CV-tuned XGBoost, the default 10 trials) on
public per-layer profiles of three sizes, with one and two XGBoost threads, on a quiet machine
and with one other busy process per core but one (what memx-run's rank 0 meets while its other
ranks wait, or a suite of tests).

Usage: python benchmarks/predictor_fit_speed.py [--repeats 3] [--out benchmarks/results/predictor_fit_speed.json]
Needs ../shared/peer-data/sailor (the profiles). Seconds are the median of the repeats.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.predictor_accuracy import sailor_records  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402
from memx_launch.profiling import predictor, tree_tuning  # noqa: E402


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def _fit_seconds(records, threads: int, repeats: int) -> list[float]:
    tree_tuning.XGBOOST_THREADS = threads
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        predictor.fit_predictor(records)
        out.append(round(time.perf_counter() - start, 3))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(HERE, "results", "predictor_fit_speed.json"))
    args = p.parse_args()
    machine, shipped = machine_info(), tree_tuning.XGBOOST_THREADS
    profiles = sailor_records()
    gh = [r for r in profiles if r.device_type == "GH-96"]
    cases = {"one type, 9 records (a calibration)": gh[:9], "one type, 42 records": gh,
             f"seven types, {len(profiles)} records": profiles}
    rows = []
    for busy in (0, (os.cpu_count() or 2) - 1):
        stop = multiprocessing.Event()
        spinners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(busy)]
        for s in spinners:
            s.start()
        try:
            for name, records in cases.items():
                for threads in (1, 2):
                    seconds = _fit_seconds(records, threads, args.repeats)
                    rows.append({"case": name, "busy_processes": busy, "xgboost_threads": threads,
                                 "seconds_median": statistics.median(seconds), "seconds_all": seconds})
                    print(rows[-1], flush=True)
        finally:
            stop.set()
            for s in spinners:
                s.join()
    for row in rows:
        one = next(r for r in rows if r["case"] == row["case"] and r["busy_processes"] == row["busy_processes"]
                   and r["xgboost_threads"] == 1)
        row["ratio_to_one_thread"] = round(row["seconds_median"] / one["seconds_median"], 2)
    write_json_atomic(args.out, {"machine": machine, "shipped_threads": shipped, "rows": rows}, overwrite=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
