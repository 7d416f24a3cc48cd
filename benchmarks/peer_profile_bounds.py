"""Which public per-layer profiles ran their fp32 matmuls in fp32: each Sailor and Aceso table of
shared/peer-data/sailor imported through ``memx profile import``'s path (``import_profile``) as
fp32 on its GPU's datasheet peaks, and again with ``--tf32`` where the fp32 import refuses a row.

A block cannot run faster than its matmul FLOPs at the peak of the precision it ran in
(``profile_import.matmul_floor_seconds``; these fp32 blocks ran attention unfused, over the whole
s x s square); the import refuses such a row and names ``--tf32``.
Per table: its records, the largest share of the fp32 peak a row would have reached (over 1: not
fp32), what the fp32 import says, whether the TF32 import takes it, and its fastest block
(forward and backward): where a framework's host time per layer shows. Also the largest share
the forward alone and the backward alone reach as the table splits the block (a third and two
thirds of its matmul FLOPs): over 1 in one part only, either the split moves work from one part
to the other or the matmuls ran (partly) as TF32.

Peaks: the vendor datasheets' of ``predictor_accuracy.SAILOR_DEVICES`` (TF32 is half the 16-bit
peak on compute capability 8.0 and later; the others have none).

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
from benchmarks.predictor_accuracy import SAILOR_MODELS, SAILOR_SEQ, sailor_device  # noqa: E402
from benchmarks.real_runs import shared_dir  # noqa: E402
from memx_launch.errors import ConfigError  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402
from memx_launch.profiling.profile_import import import_profile, matmul_floor_seconds, table_rows  # noqa: E402
from memx_launch.specs.catalog import get_model  # noqa: E402
from memx_launch.specs.training import TrainingSpec  # noqa: E402

OUT = os.path.join(ROOT, "benchmarks", "results", "peer_profile_bounds.json")
# How the tables' blocks ran (``memx profile import --no-flash-attention``): fp32 attention unfused
# (FlashAttention kernels take 16-bit inputs only), its QK^T and AV over the whole s x s square.
UNFUSED = {"flash_attention": False}
FP32 = TrainingSpec(dtype="fp32", **UNFUSED)


def _message(exc: ConfigError) -> str:
    """The import's error with the table's path from shared/ on, wherever shared/ lies."""
    return str(exc).replace(shared_dir(), "shared")


def table_bounds(path: str, fmt: str, model_dir: str, gpu: str) -> dict:
    model = get_model(SAILOR_MODELS[model_dir])
    dev = sailor_device(gpu)
    kwargs = dict(dtype="fp32", seq_len=SAILOR_SEQ[model_dir])
    entry = {"table": f"{fmt} {model_dir}/{gpu}"}
    try:
        records = import_profile(path, fmt, model, dev, run_options=UNFUSED, **kwargs)
        entry["fp32_import"] = "ok"
    except ConfigError as exc:
        entry["fp32_import"] = _message(exc)
        try:
            records = import_profile(path, fmt, model, dev, run_options={"tf32": True, **UNFUSED}, **kwargs)
            entry["tf32_import"] = "ok"
        except ConfigError as tf32_exc:
            entry["tf32_import"] = _message(tf32_exc)
            return entry
    timed = [r for r in records if r.time_s]
    shares = [matmul_floor_seconds(r, dev, FP32) / r.time_s for r in timed]
    # The block's forward and backward as the table splits them (the import sums them).
    parts = {(int(row["micro_batch_size"]), int(row["tp"])): (float(row["forward_s"]), float(row["backward_s"]))
             for _, row in table_rows(path, fmt)}
    split = [(matmul_floor_seconds(r, dev, FP32), parts[r.micro_batch_size, r.tp]) for r in timed]
    entry.update(records=len(timed), max_share_of_fp32_peak=round(max(shares), 3),
                 rows_over_the_fp32_peak=sum(s > 1 for s in shares),
                 max_share_forward=round(max(floor / 3.0 / fwd for floor, (fwd, _) in split), 3),
                 max_share_backward=round(max(2.0 * floor / 3.0 / bwd for floor, (_, bwd) in split), 3),
                 fastest_block_ms=round(1e3 * min(r.time_s for r in timed), 2))
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
