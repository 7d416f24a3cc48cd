"""Which public per-layer profiles ran their fp32 matmuls in fp32: each Sailor and Aceso table of
shared/peer-data/sailor imported through ``memx profile import``'s path (``import_profile``) as
fp32 on its GPU's datasheet peaks, and again with ``--tf32`` where the fp32 import refuses a row.

A block cannot run faster than its matmul FLOPs at the peak of the precision it ran in
(``profile_import.matmul_floor_seconds``); the import refuses such a row and names ``--tf32``.
Per table: its records, the largest share of the fp32 peak a row would have reached (over 1: not
fp32), what the fp32 import says, and whether the TF32 import takes it.

Peaks (vendor datasheets, dense): A100 312 (16-bit) and 19.5 (fp32) TFLOPS, compute capability
8.0; GH200 989 and 67, 9.0; V100 125 and 15.7, 7.0; RTX 2080 40.3 (16-bit with fp32
accumulation) and 10.1, 7.5; RTX 3090 71 and 35.6, 8.6; Titan RTX 130 and 16.3, 7.5. TF32 is half
the 16-bit peak on compute capability 8.0 and later; the others have none.

Writes benchmarks/results/peer_profile_bounds.json. Run: .venv/bin/python benchmarks/peer_profile_bounds.py
(a few seconds).
"""

from __future__ import annotations

import glob
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.predictor_accuracy import SAILOR_MODELS, SAILOR_SEQ  # noqa: E402
from benchmarks.real_runs import shared_dir  # noqa: E402
from memx_launch.errors import ConfigError  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402
from memx_launch.profiling.profile_import import import_profile, matmul_floor_seconds  # noqa: E402
from memx_launch.specs.cluster import DeviceType  # noqa: E402
from memx_launch.specs.model import get_model  # noqa: E402
from memx_launch.specs.training import TrainingSpec  # noqa: E402

OUT = os.path.join(ROOT, "benchmarks", "results", "peer_profile_bounds.json")
# name: (16-bit peak, fp32 peak, compute capability, memory GiB)
PEAKS = {"A100-40": (312, 19.5, 8.0, 40), "A100-80": (312, 19.5, 8.0, 80), "GH-96": (989, 67, 9.0, 96),
         "V100-16": (125, 15.7, 7.0, 16), "RTX-2080": (40.3, 10.1, 7.5, 8), "RTX-3090": (71, 35.6, 8.6, 24),
         "Titan-RTX": (130, 16.3, 7.5, 24)}
FP32 = TrainingSpec(dtype="fp32")


def device(name: str) -> DeviceType:
    peak, fp32, capability, memory = PEAKS[name]
    return DeviceType(name, "nvidia", memory, peak, peak_tflops_fp32=fp32, compute_capability=capability)


def table_bounds(path: str, fmt: str, model_dir: str, gpu: str) -> dict:
    model = get_model(SAILOR_MODELS[model_dir])
    dev = device(gpu)
    kwargs = dict(dtype="fp32", seq_len=SAILOR_SEQ[model_dir])
    entry = {"table": f"{fmt} {model_dir}/{gpu}"}
    try:
        records = import_profile(path, fmt, model, dev, **kwargs)
        entry["fp32_import"] = "ok"
    except ConfigError as exc:
        entry["fp32_import"] = str(exc)
        try:
            records = import_profile(path, fmt, model, dev, run_options={"tf32": True}, **kwargs)
            entry["tf32_import"] = "ok"
        except ConfigError as tf32_exc:
            entry["tf32_import"] = str(tf32_exc)
            return entry
    timed = [r for r in records if r.time_s]
    shares = [matmul_floor_seconds(r, dev, FP32) / r.time_s for r in timed]
    entry.update(records=len(timed), max_share_of_fp32_peak=round(max(shares), 3),
                 rows_over_the_fp32_peak=sum(s > 1 for s in shares))
    return entry


def main() -> None:
    start = time.time()
    peer = os.path.join(shared_dir(), "peer-data", "sailor")
    tables = [(p, "sailor", p.split(os.sep)[-3], p.split(os.sep)[-2])
              for p in sorted(glob.glob(os.path.join(peer, "profiles", "*", "*", "profile.json")))]
    tables += [(p, "aceso", "OPT-350", os.path.basename(p)[:-4])
               for p in sorted(glob.glob(os.path.join(peer, "aceso_layer_time", "*.csv")))]
    rows = [table_bounds(*t) for t in tables]
    for r in rows:
        print(f"{r['table']:28s} share of fp32 peak up to {r.get('max_share_of_fp32_peak', '-')}: "
              f"fp32 {'ok' if r['fp32_import'] == 'ok' else 'refused'}"
              + (f", tf32 {'ok' if r['tf32_import'] == 'ok' else 'refused'}" if "tf32_import" in r else ""))
    out = {"machine": machine_info(), "what": __doc__.split("\n\n")[0], "tables": rows,
           "refused_as_fp32": [r["table"] for r in rows if r["fp32_import"] != "ok"],
           "seconds": round(time.time() - start, 2)}
    write_json_atomic(OUT, out, overwrite=True)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
