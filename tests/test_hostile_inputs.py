"""Broken and hostile inputs, as a careless user or an attacker would give them: every one is one
``memx: error:`` line on stderr, exit 2 (3 when nothing fits), no traceback, and nothing written.

Table-driven and in-process (memx_launch.cli.main): each case names the files it needs, the
command line (``{d}`` is the case's directory) and the exit code.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import yaml

from memx_launch.cli import main
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

CLUSTER = """version: 1
name: small
device_types:
  big: {vendor: x, domain: shared, memory_gib: 80, peak_tflops: 300, efficiency: 0.5, memory_bandwidth_gbps: 2000}
  small: {vendor: y, domain: shared, memory_gib: 16, peak_tflops: 60}
nodes:
  - {name: n0, devices: {big: 2}, intra_node_gbps: 100}
  - {name: n1, devices: {small: 2}, intra_node_gbps: 50}
inter_node_gbps: 12.5
"""
HF_CONFIG = {"num_hidden_layers": 8, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4,
             "intermediate_size": 1376, "vocab_size": 2048, "max_position_embeddings": 256, "hidden_act": "silu"}


def _good_plan() -> dict:
    cluster = ClusterSpec.from_dict(yaml.safe_load(CLUSTER))
    plan = evaluate_layout(get_model("llama-tiny"), cluster, TrainingSpec(global_batch_size=8, seq_len=64),
                           tp=1, pp=2, dp=2, micro_batch_size=1, references=(1, 1, 1))
    return plan.to_dict()


PLAN = _good_plan()


def plan_with(change) -> str:
    data = copy.deepcopy(PLAN)
    change(data)
    return json.dumps(data)


def config_with(**fields) -> str:
    return json.dumps({**HF_CONFIG, **fields})


def cluster_with(old: str, new: str) -> str:
    assert old in CLUSTER, old
    return CLUSTER.replace(old, new)


def _set(path: str, value):
    """A change that sets data[a][b]... (``stages.0.ranks`` style) to ``value``."""
    def change(data):
        *parents, last = path.split(".")
        for key in parents:
            data = data[int(key)] if key.isdigit() else data[key]
        data[int(last) if last.isdigit() else last] = value
    return change


PLAN_CMD = ["plan", "--model", "llama-tiny", "--cluster", "{d}/cluster.yaml", "--quiet"]
EXPORT = ["export", "--plan", "{d}/plan.json"]
ESTIMATE_PLAN = ["estimate", "--plan", "{d}/plan.json", "--cluster", "{d}/cluster.yaml"]
ESTIMATE = ["estimate", "--model", "llama-tiny", "--cluster", "{d}/cluster.yaml", "--global-batch-size", "8"]
LAYOUT = ["--tp", "1", "--pp", "2", "--dp", "2", "--micro-batch-size", "1"]
HF = ["plan", "--model", "{d}/config.json", "--cluster", "{d}/cluster.yaml", "--quiet"]
EVALUATE = ["evaluate", "--measurements", "{d}/m.csv"]
EVALUATE_JSON = ["evaluate", "--measurements", "{d}/m.json"]
EVALUATE_ESTIMATES = ["evaluate", "--measurements", "{d}/m.jsonl"]
EVALUATE_RUN = ["evaluate", "--measurements", "{d}/run"]
STEP = {"step": 1, "generation": 1, "step_time_s": 1.0, "predicted_step_time_s": 1.0,
        "stages": [{"peak_memory_gib": 1.0, "predicted_peak_memory_gib": 1.0}]}
FIT = ["cluster", "fit", "--cases", "{d}/runs.csv", "--cluster", "{d}/cluster.yaml", "--out", "{d}/fitted.yaml",
       "--model", "llama-tiny", "--global-batch-size", "8"]
RUNS_HEAD = "tp,pp,dp,measured_time_s\n"
PROFILE = ["profile", "--model", "llama-tiny", "--device", "cpu", "--quiet", "--out", "{d}/p.jsonl"]
BINARY = bytes(range(256)) * 8
NESTED = "[" * 5000 + "]" * 5000
ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
CSV_HEAD = "config,predicted_time_s,measured_time_s\n"

# (id, files, argv, exit code); files: name -> text or bytes; every case also gets cluster.yaml.
CASES = [
    # ---- cluster YAML
    ("cluster-binary", {"cluster.yaml": BINARY}, PLAN_CMD, 2),
    ("cluster-empty", {"cluster.yaml": ""}, PLAN_CMD, 2),
    ("cluster-not-utf8", {"cluster.yaml": CLUSTER.encode() + b"\xff\xfe"}, PLAN_CMD, 2),
    ("cluster-alias-bomb", {"cluster.yaml": ALIAS_BOMB}, PLAN_CMD, 2),
    ("cluster-anchor", {"cluster.yaml": cluster_with("big: {vendor", "big: &b {vendor")}, PLAN_CMD, 2),
    ("cluster-duplicate-top-key", {"cluster.yaml": CLUSTER + "version: 1\n"}, PLAN_CMD, 2),
    ("cluster-duplicate-type", {"cluster.yaml": cluster_with("  small: {", "  big: {vendor: z, memory_gib: 1, "
                                                             "peak_tflops: 1}\n  small: {")}, PLAN_CMD, 2),
    ("cluster-duplicate-field", {"cluster.yaml": cluster_with("memory_gib: 80,", "memory_gib: 80, memory_gib: 1,")},
     PLAN_CMD, 2),
    ("cluster-nan-memory", {"cluster.yaml": cluster_with("memory_gib: 80", "memory_gib: .nan")}, PLAN_CMD, 2),
    ("cluster-inf-memory", {"cluster.yaml": cluster_with("memory_gib: 80", "memory_gib: .inf")}, PLAN_CMD, 2),
    ("cluster-inf-peak", {"cluster.yaml": cluster_with("peak_tflops: 300", "peak_tflops: .inf")}, PLAN_CMD, 2),
    ("cluster-nan-link", {"cluster.yaml": cluster_with("intra_node_gbps: 100", "intra_node_gbps: .nan")},
     PLAN_CMD, 2),
    ("cluster-inf-inter", {"cluster.yaml": cluster_with("inter_node_gbps: 12.5", "inter_node_gbps: .inf")},
     PLAN_CMD, 2),
    ("cluster-negative-inter", {"cluster.yaml": cluster_with("inter_node_gbps: 12.5", "inter_node_gbps: -1")},
     PLAN_CMD, 2),
    ("cluster-huge-count", {"cluster.yaml": cluster_with("{big: 2}", "{big: 1000000000000}")}, PLAN_CMD, 2),
    ("cluster-many-nodes", {"cluster.yaml": CLUSTER.replace("nodes:\n", "nodes:\n" + "  - {devices: {small: 4096},"
                                                            " intra_node_gbps: 1}\n" * 300)}, PLAN_CMD, 2),
    ("cluster-count-bool", {"cluster.yaml": cluster_with("{big: 2}", "{big: true}")}, PLAN_CMD, 2),
    ("cluster-count-float", {"cluster.yaml": cluster_with("{big: 2}", "{big: 2.5}")}, PLAN_CMD, 2),
    ("cluster-count-string", {"cluster.yaml": cluster_with("{big: 2}", "{big: two}")}, PLAN_CMD, 2),
    ("cluster-count-zero", {"cluster.yaml": cluster_with("{big: 2}", "{big: 0}")}, PLAN_CMD, 2),
    ("cluster-efficiency-text", {"cluster.yaml": cluster_with("efficiency: 0.5", "efficiency: abc")}, PLAN_CMD, 2),
    ("cluster-efficiency-big", {"cluster.yaml": cluster_with("efficiency: 0.5", "efficiency: 1.5")}, PLAN_CMD, 2),
    ("cluster-efficiency-nan", {"cluster.yaml": cluster_with("efficiency: 0.5", "efficiency: .nan")}, PLAN_CMD, 2),
    ("cluster-bandwidth-text", {"cluster.yaml": cluster_with("memory_bandwidth_gbps: 2000",
                                                             "memory_bandwidth_gbps: fast")}, PLAN_CMD, 2),
    ("cluster-bandwidth-negative", {"cluster.yaml": cluster_with("memory_bandwidth_gbps: 2000",
                                                                 "memory_bandwidth_gbps: -5")}, PLAN_CMD, 2),
    ("cluster-flash-text", {"cluster.yaml": cluster_with("efficiency: 0.5", "flash_attention: maybe")}, PLAN_CMD, 2),
    ("cluster-memory-unit", {"cluster.yaml": cluster_with("memory_gib: 80", "memory_gib: 80GB")}, PLAN_CMD, 2),
    ("cluster-vendor-list", {"cluster.yaml": cluster_with("vendor: x", "vendor: [x, y]")}, PLAN_CMD, 2),
    ("cluster-type-name-list", {"cluster.yaml": cluster_with("  small: {", "  [a, b]: {memory_gib: 1, peak_tflops: 1}"
                                                             "\n  small: {")}, PLAN_CMD, 2),
    ("cluster-types-list", {"cluster.yaml": "version: 1\ndevice_types: [a, b]\nnodes: []\n"}, PLAN_CMD, 2),
    ("cluster-nodes-mapping", {"cluster.yaml": cluster_with("nodes:\n", "nodes: {}\nx:\n")}, PLAN_CMD, 2),
    ("cluster-numa-zero", {"cluster.yaml": cluster_with("{name: n0,", "{name: n0, numa_domains: 0,")}, PLAN_CMD, 2),
    ("cluster-numa-text", {"cluster.yaml": cluster_with("{name: n0,", "{name: n0, numa_domains: two,")},
     PLAN_CMD, 2),
    ("cluster-version-text", {"cluster.yaml": cluster_with("version: 1", "version: '1'")}, PLAN_CMD, 2),
    ("cluster-python-tag", {"cluster.yaml": "!!python/object/apply:os.system ['touch {d}/pwned']\n"}, PLAN_CMD, 2),
    ("cluster-nested", {"cluster.yaml": NESTED}, PLAN_CMD, 2),
    ("cluster-long-line", {"cluster.yaml": CLUSTER + "# " + "x" * (2**20 + 10) + "\n"}, PLAN_CMD, 2),
    ("cluster-too-big", {"cluster.yaml": CLUSTER + ("#" + "x" * 1000 + "\n") * 17000}, PLAN_CMD, 2),
    ("cluster-directory", {"cdir/x": "x"}, ["plan", "--model", "llama-tiny", "--cluster", "{d}/cdir"], 2),
    ("cluster-missing", {}, ["plan", "--model", "llama-tiny", "--cluster", "{d}/nope.yaml"], 2),
    ("cluster-device-file", {}, ["plan", "--model", "llama-tiny", "--cluster", "/dev/zero"], 2),
    ("cluster-slowdown-list", {"cluster.yaml": CLUSTER + "emulation: {slowdown: [1, 2]}\n"}, PLAN_CMD, 2),
    ("cluster-slowdown-nan", {"cluster.yaml": CLUSTER + "emulation: {slowdown: {big: .nan}}\n"}, PLAN_CMD, 2),
    ("cluster-slowdown-below-one", {"cluster.yaml": CLUSTER + "emulation: {slowdown: {big: 0.5}}\n"}, PLAN_CMD, 2),
    ("cluster-node-name-newline", {"cluster.yaml": cluster_with("{name: n0,", "{name: \"n0\\nrm -rf ~\",")},
     PLAN_CMD, 2),
    ("cluster-type-name-escape", {"cluster.yaml": cluster_with("  small: {", "  \"\\e[2Jsmall\": {memory_gib: 1, "
                                                               "peak_tflops: 1}\n  small: {")}, PLAN_CMD, 2),
    ("cluster-name-long", {"cluster.yaml": cluster_with("name: small", "name: " + "x" * 500)}, PLAN_CMD, 2),
    ("cluster-name-mapping", {"cluster.yaml": cluster_with("name: small", "name: {a: 1}")}, PLAN_CMD, 2),
    # ---- Hugging Face config.json
    ("config-binary", {"config.json": BINARY}, HF, 2),
    ("config-invalid-json", {"config.json": "{\"num_hidden_layers\": 8,"}, HF, 2),
    ("config-array", {"config.json": "[1, 2]"}, HF, 2),
    ("config-duplicate-key", {"config.json": config_with()[:-1] + ", \"hidden_size\": 64}"}, HF, 2),
    ("config-nan", {"config.json": config_with().replace("512", "NaN")}, HF, 2),
    ("config-infinity", {"config.json": config_with().replace("512", "Infinity")}, HF, 2),
    ("config-positions-1e400", {"config.json": config_with().replace("256", "1e400")}, HF, 2),
    ("config-positions-text", {"config.json": config_with(max_position_embeddings="abc")}, HF, 2),
    ("config-positions-float", {"config.json": config_with(max_position_embeddings=2.5)}, HF, 2),
    ("config-layers-zero", {"config.json": config_with(num_hidden_layers=0)}, HF, 2),
    ("config-layers-negative", {"config.json": config_with(num_hidden_layers=-3)}, HF, 2),
    ("config-layers-bool", {"config.json": config_with(num_hidden_layers=True)}, HF, 2),
    ("config-layers-huge", {"config.json": config_with(num_hidden_layers=10**30)}, HF, 2),
    ("config-hidden-text", {"config.json": config_with(hidden_size="512")}, HF, 2),
    ("config-heads-not-dividing", {"config.json": config_with(num_attention_heads=7)}, HF, 2),
    ("config-kv-not-dividing", {"config.json": config_with(num_key_value_heads=3)}, HF, 2),
    ("config-vocab-list", {"config.json": config_with(vocab_size=[1, 2])}, HF, 2),
    ("config-act-list", {"config.json": config_with(hidden_act=["silu"])}, HF, 2),
    ("config-tie-text", {"config.json": config_with(tie_word_embeddings="yes")}, HF, 2),
    ("config-missing-keys", {"config.json": json.dumps({"hidden_size": 512})}, HF, 2),
    ("config-nested", {"config.json": NESTED}, HF, 2),
    ("config-empty", {"config.json": ""}, HF, 2),
    # ---- plan JSON
    ("plan-binary", {"plan.json": BINARY}, EXPORT, 2),
    ("plan-invalid-json", {"plan.json": "{"}, EXPORT, 2),
    ("plan-array", {"plan.json": "[]"}, EXPORT, 2),
    ("plan-duplicate-key", {"plan.json": plan_with(lambda d: None)[:-1] + ", \"tp\": 2}"}, EXPORT, 2),
    ("plan-objective-text", {"plan.json": plan_with(_set("objective", "fast"))}, EXPORT, 2),
    ("plan-tp-zero", {"plan.json": plan_with(_set("tp", 0))}, EXPORT, 2),
    ("plan-tp-negative", {"plan.json": plan_with(_set("tp", -1))}, EXPORT, 2),
    ("plan-tp-text", {"plan.json": plan_with(_set("tp", "1"))}, EXPORT, 2),
    ("plan-tp-bool", {"plan.json": plan_with(_set("tp", True))}, EXPORT, 2),
    ("plan-tp-float", {"plan.json": plan_with(_set("tp", 1.0))}, EXPORT, 2),
    ("plan-mbs-zero", {"plan.json": plan_with(_set("micro_batch_size", 0))}, EXPORT, 2),
    ("plan-virtual-zero", {"plan.json": plan_with(_set("virtual_stages", 0))}, EXPORT, 2),
    ("plan-virtual-too-many", {"plan.json": plan_with(_set("virtual_stages", 99))}, EXPORT, 2),
    ("plan-gbs-huge", {"plan.json": plan_with(_set("global_batch_size", 10**40))}, EXPORT, 2),
    ("plan-ranks-text", {"plan.json": plan_with(_set("stages.0.ranks", ["0", "1"]))}, EXPORT, 2),
    ("plan-ranks-repeated", {"plan.json": plan_with(_set("stages.0.ranks", [0, 0]))}, EXPORT, 2),
    ("plan-ranks-negative", {"plan.json": plan_with(_set("stages.0.ranks", [-1, 1]))}, EXPORT, 2),
    ("plan-ranks-empty", {"plan.json": plan_with(_set("stages.0.ranks", []))}, EXPORT, 2),
    ("plan-stages-empty", {"plan.json": plan_with(_set("stages", []))}, EXPORT, 2),
    ("plan-stages-text", {"plan.json": plan_with(_set("stages", "all"))}, EXPORT, 2),
    ("plan-stage-list", {"plan.json": plan_with(_set("stages.0", [1, 2]))}, EXPORT, 2),
    ("plan-layers-sum", {"plan.json": plan_with(_set("stages.0.num_layers", 99))}, EXPORT, 2),
    ("plan-layers-text", {"plan.json": plan_with(_set("stages.0.num_layers", "4"))}, EXPORT, 2),
    ("plan-recompute-unknown", {"plan.json": plan_with(_set("stages.0.recompute", "some"))}, EXPORT, 2),
    ("plan-schedule-unknown", {"plan.json": plan_with(_set("schedule", "gpipe"))}, EXPORT, 2),
    ("plan-schedule-number", {"plan.json": plan_with(_set("schedule", 1))}, EXPORT, 2),
    ("plan-version", {"plan.json": plan_with(_set("version", 2))}, EXPORT, 2),
    ("plan-weights-two", {"plan.json": plan_with(_set("objective.weights", [0.5, 0.5]))}, EXPORT, 2),
    ("plan-weights-text", {"plan.json": plan_with(_set("objective.weights", "0.4,0.2,0.4"))}, EXPORT, 2),
    ("plan-phi-text", {"plan.json": plan_with(_set("objective.phi", "low"))}, EXPORT, 2),
    ("plan-time-nan", {"plan.json": plan_with(lambda d: None).replace(
        "\"predicted_iteration_time_s\": ", "\"predicted_iteration_time_s\": NaN, \"x\": ")}, EXPORT, 2),
    ("plan-time-1e400", {"plan.json": plan_with(_set("predicted_iteration_time_s", 1.5)).replace("1.5", "1e400")},
     EXPORT, 2),
    ("plan-model-spec-text", {"plan.json": plan_with(_set("model_spec", "llama"))}, EXPORT, 2),
    ("plan-model-spec-zero", {"plan.json": plan_with(_set("model_spec.hidden_size", 0))}, EXPORT, 2),
    ("plan-model-spec-unknown", {"plan.json": plan_with(_set("model_spec.colour", "red"))}, EXPORT, 2),
    ("plan-training-unknown", {"plan.json": plan_with(_set("training.lr", 1))}, EXPORT, 2),
    ("plan-emulated-text", {"plan.json": plan_with(_set("emulated", "yes"))}, EXPORT, 2),
    ("plan-world-huge", {"plan.json": plan_with(lambda d: d.update(tp=2**20, dp=2**20))}, EXPORT, 2),
    ("plan-missing-stages", {"plan.json": plan_with(lambda d: d.pop("stages"))}, EXPORT, 2),
    ("plan-nested", {"plan.json": NESTED}, EXPORT, 2),
    ("plan-estimate-tp-negative", {"plan.json": plan_with(_set("tp", -1))}, ESTIMATE_PLAN, 2),
    ("plan-estimate-binary", {"plan.json": BINARY}, ESTIMATE_PLAN, 2),
    ("plan-device-type-newline", {"plan.json": plan_with(_set("stages.0.device_type", "big\nrm -rf ~"))}, EXPORT, 2),
    ("plan-model-name-control", {"plan.json": plan_with(_set("model", "llama\u001b[2J"))}, EXPORT, 2),
    ("export-port-negative", {"plan.json": json.dumps(PLAN)}, EXPORT + ["--master-port", "-5"], 2),
    ("plan-directory", {"plan.json/x": "x"}, EXPORT, 2),
    ("plan-world-size-mismatch", {"plan.json": plan_with(_set("world_size", 8))}, EXPORT, 2),
    ("plan-world-size-mismatch-run", {"plan.json": plan_with(_set("world_size", 2))}, ESTIMATE_PLAN, 2),
    ("plan-unknown-key", {"plan.json": plan_with(_set("pipeline_parallel", 4))}, EXPORT, 2),
    # ---- --config (memx's own options file)
    ("options-duplicate-key", {"o.yaml": "top: 2\ntop: 3\n"}, PLAN_CMD + ["--config", "{d}/o.yaml"], 2),
    ("options-huge-int", {"o.yaml": "top: " + "9" * 5000 + "\n"}, PLAN_CMD + ["--config", "{d}/o.yaml"], 2),
    ("options-nested", {"o.yaml": "top: " + NESTED + "\n"}, PLAN_CMD + ["--config", "{d}/o.yaml"], 2),
    ("options-binary", {"o.yaml": BINARY}, PLAN_CMD + ["--config", "{d}/o.yaml"], 2),
    ("options-long-line", {"o.yaml": "top: " + "1" * 200_000 + "\n"}, PLAN_CMD + ["--config", "{d}/o.yaml"], 2),
    ("options-fullwidth-digit", {"o.yaml": "top: \uff18\n"}, PLAN_CMD + ["--config", "{d}/o.yaml"], 2),
    # ---- flags
    ("flag-weights-nan", {}, PLAN_CMD + ["--weights", "nan,1,1"], 2),
    ("flag-weights-inf", {}, PLAN_CMD + ["--weights", "inf,1,1"], 2),
    ("flag-weights-two", {}, PLAN_CMD + ["--weights", "1,2"], 2),
    ("flag-weights-negative", {}, PLAN_CMD + ["--weights", "-1,1,1"], 2),
    ("flag-budget-nan", {}, PLAN_CMD + ["--search-budget-s", "nan"], 2),
    ("flag-budget-inf", {}, PLAN_CMD + ["--search-budget-s", "inf"], 2),
    ("flag-budget-negative", {}, PLAN_CMD + ["--search-budget-s", "-1"], 2),
    ("flag-headroom-nan", {}, PLAN_CMD + ["--memory-headroom", "nan"], 2),
    ("flag-headroom-one", {}, PLAN_CMD + ["--memory-headroom", "1"], 2),
    ("flag-top-zero", {}, PLAN_CMD + ["--top", "0"], 2),
    ("flag-top-huge", {}, PLAN_CMD + ["--top", "99999999999"], 2),
    ("flag-gbs-zero", {}, PLAN_CMD + ["--global-batch-size", "0"], 2),
    ("flag-seq-negative", {}, PLAN_CMD + ["--seq-len", "-5"], 2),
    ("flag-gbs-huge", {}, PLAN_CMD + ["--global-batch-size", "99999999999999999999999999"], 2),
    ("flag-seq-huge", {}, PLAN_CMD + ["--seq-len", "100000000000"], 2),
    ("flag-superscript-digit", {}, PLAN_CMD + ["--global-batch-size", "\u00b2"], 2),
    ("flag-fullwidth-digit", {}, PLAN_CMD + ["--global-batch-size", "\uff18"], 2),
    ("flag-arabic-indic-digit", {}, PLAN_CMD + ["--top", "\u0663"], 2),
    ("flag-fullwidth-float", {}, PLAN_CMD + ["--memory-headroom", "\uff10.1"], 2),
    ("flag-5000-digits", {}, PLAN_CMD + ["--global-batch-size", "9" * 5000], 2),
    ("flag-recompute-superscript", {}, ESTIMATE + LAYOUT + ["--recompute", "full:\u00b2"], 2),
    ("flag-model-unknown", {}, ["plan", "--model", "llama9", "--cluster", "{d}/cluster.yaml"], 2),
    ("estimate-virtual-99", {}, ESTIMATE + LAYOUT + ["--schedule", "interleaved", "--virtual-stages", "99"], 2),
    ("estimate-virtual-zero", {}, ESTIMATE + LAYOUT + ["--schedule", "interleaved", "--virtual-stages", "0"], 2),
    ("estimate-virtual-without-interleaved", {}, ESTIMATE + LAYOUT + ["--virtual-stages", "2"], 2),
    ("estimate-layers-huge", {}, ESTIMATE + LAYOUT + ["--layers-per-stage", "99999999999999999999,1"], 2),
    ("estimate-layers-text", {}, ESTIMATE + LAYOUT + ["--layers-per-stage", "a,b"], 2),
    # The first or last stage may hold no layers (an embedding-only stage); a middle one may not.
    ("estimate-layers-zero-middle", {}, ESTIMATE + ["--tp", "1", "--pp", "4", "--dp", "1", "--micro-batch-size", "1",
                                                    "--layers-per-stage", "2,0,3,3"], 2),
    ("estimate-tp-negative", {}, ESTIMATE + ["--tp", "-1", "--pp", "2", "--dp", "2", "--micro-batch-size", "1"], 2),
    ("estimate-pp-zero", {}, ESTIMATE + ["--tp", "1", "--pp", "0", "--dp", "2", "--micro-batch-size", "1"], 2),
    ("estimate-pp-too-many", {}, ESTIMATE + ["--tp", "1", "--pp", "99", "--dp", "1", "--micro-batch-size", "1"], 2),
    ("estimate-tp-not-dividing", {}, ESTIMATE + ["--tp", "3", "--pp", "1", "--dp", "1", "--micro-batch-size", "1"], 2),
    ("estimate-world-too-big", {}, ESTIMATE + ["--tp", "1", "--pp", "2", "--dp", "1000", "--micro-batch-size", "1"],
     2),
    ("estimate-mbs-zero", {}, ESTIMATE + ["--tp", "1", "--pp", "2", "--dp", "2", "--micro-batch-size", "0"], 2),
    ("estimate-recompute-unknown", {}, ESTIMATE + LAYOUT + ["--recompute", "most"], 2),
    ("estimate-stage-devices-unknown", {}, ESTIMATE + LAYOUT + ["--stage-devices", "tpu,tpu"], 2),
    # ---- output paths (checked before the work)
    ("json-directory", {"out/x": "x"}, PLAN_CMD + ["--json", "{d}/out"], 2),
    ("json-proc", {}, PLAN_CMD + ["--json", "/proc/self/memx.json"], 2),
    ("json-sys", {}, PLAN_CMD + ["--json", "/sys/memx.json"], 2),
    ("json-dev-null-force", {}, PLAN_CMD + ["--json", "/dev/null", "--force"], 2),
    ("json-below-file", {"file.txt": "keep"}, PLAN_CMD + ["--json", "{d}/file.txt/plan.json"], 2),
    ("json-exists", {"plan-out.json": "keep"}, PLAN_CMD + ["--json", "{d}/plan-out.json"], 2),
    ("profile-out-link-to-another-file", {"notes.txt": "mine\n", "@p.jsonl": "notes.txt"}, PROFILE, 2),
    ("json-and-plot-one-file", {}, PLAN_CMD + ["--json", "{d}/x.png", "--plot", "{d}/x.png", "--force"], 2),
    ("json-link-to-own-file", {"mine.json": "{}", "@link.json": "mine.json"},
     PLAN_CMD + ["--json", "{d}/link.json", "--force"], 2),
    ("json-link-to-dev-null", {"@link.json": "/dev/null"}, PLAN_CMD + ["--json", "{d}/link.json", "--force"], 2),
    ("plot-not-png", {}, PLAN_CMD + ["--plot", "{d}/p.svg"], 2),
    ("plot-directory", {"p.png/x": "x"}, PLAN_CMD + ["--plot", "{d}/p.png"], 2),
    ("estimate-json-directory", {"out/x": "x"}, ESTIMATE + LAYOUT + ["--json", "{d}/out"], 2),
    ("evaluate-json-proc", {"m.csv": CSV_HEAD + "a,1,1\nb,2,2\n"}, EVALUATE + ["--json", "/proc/x.json"], 2),
    ("profile-out-directory", {"out/x": "x"}, PROFILE + ["--out", "{d}/out"], 2),
    ("profile-out-dev-null", {}, PROFILE + ["--out", "/dev/null"], 2),
    ("profile-out-below-file", {"file.txt": "keep"}, PROFILE + ["--out", "{d}/file.txt/p.jsonl"], 2),
    ("profile-device-banana", {}, PROFILE + ["--device", "banana"], 2),
    ("profile-device-missing-gpu", {}, PROFILE + ["--device", "cuda:99"], 2),
    ("profile-seq-lens-zero", {}, PROFILE + ["--seq-lens", "0"], 2),
    ("profile-seq-lens-text", {}, PROFILE + ["--seq-lens", "long"], 2),
    ("profile-num-blocks-huge", {}, PROFILE + ["--num-blocks", "1000000"], 2),
    ("profile-micro-batch-huge", {}, PROFILE + ["--max-micro-batch", "100000000"], 2),
    ("profile-repeats-zero", {}, PROFILE + ["--repeats", "0"], 2),
    ("profile-budget-negative", {}, PROFILE + ["--budget", "-3"], 2),
    ("profile-device-type-unknown", {}, PROFILE + ["--cluster", "{d}/cluster.yaml", "--device-type", "tpu"], 2),
    # ---- profile database given to plan
    ("profile-db-binary", {"db.jsonl": BINARY}, PLAN_CMD + ["--profile-db", "{d}/db.jsonl"], 2),
    ("profile-db-not-utf8", {"db.jsonl": b"\xff\xfe{}\n"}, PLAN_CMD + ["--profile-db", "{d}/db.jsonl"], 2),
    ("profile-db-garbage-lines", {"db.jsonl": "{\"format\": 1, \"time_s\": NaN}\nnot json\n[]\n"},
     PLAN_CMD + ["--profile-db", "{d}/db.jsonl"], 2),
    ("profile-db-directory", {"db/x": "x"}, PLAN_CMD + ["--profile-db", "{d}/db"], 2),
    ("profile-db-missing", {}, PLAN_CMD + ["--profile-db", "{d}/none.jsonl"], 2),
    # ---- measurements (cases) file of memx evaluate
    ("cases-binary", {"m.csv": BINARY}, EVALUATE, 2),
    ("cases-json-binary", {"m.json": BINARY}, EVALUATE_JSON, 2),
    ("cases-invalid-json", {"m.json": "{\"rows\": ["}, EVALUATE_JSON, 2),
    ("cases-duplicate-key", {"m.json": "{\"rows\": [], \"rows\": []}"}, EVALUATE_JSON, 2),
    ("cases-json-nan", {"m.json": json.dumps({"rows": [{"predicted_time_s": 1, "measured_time_s": 1}]}).replace(
        "1}", "NaN}")}, EVALUATE_JSON, 2),
    ("cases-csv-nan", {"m.csv": CSV_HEAD + "a,nan,1\nb,2,2\n"}, EVALUATE, 2),
    ("cases-csv-inf", {"m.csv": CSV_HEAD + "a,1,inf\nb,2,2\n"}, EVALUATE, 2),
    ("cases-csv-text", {"m.csv": CSV_HEAD + "a,fast,1\n"}, EVALUATE, 2),
    ("cases-csv-zero-measured", {"m.csv": CSV_HEAD + "a,1,0\nb,2,2\n"}, EVALUATE, 2),
    ("cases-empty", {"m.csv": ""}, EVALUATE, 2),
    ("cases-no-column", {"m.csv": "config,x\na,1\n"}, EVALUATE, 2),
    ("cases-rows-text", {"m.json": "{\"rows\": \"many\"}"}, EVALUATE_JSON, 2),
    ("cases-directory", {"m.csv/x": "x"}, EVALUATE, 2),
    # ---- memx estimate --cases output read by memx evaluate
    ("estimates-binary", {"m.jsonl": BINARY}, EVALUATE_ESTIMATES, 2),
    ("estimates-not-object", {"m.jsonl": "[1, 2]\n"}, EVALUATE_ESTIMATES, 2),
    ("estimates-broken-line", {"m.jsonl": '{"iteration_time_s": 1, "measured_time_s": 1}\n{"a":\n'},
     EVALUATE_ESTIMATES, 2),
    ("estimates-nan-measured", {"m.jsonl": '{"iteration_time_s": 1, "measured_time_s": "nan"}\n'}, EVALUATE_ESTIMATES, 2),
    ("estimates-unicode-peak", {"m.jsonl": json.dumps({"iteration_time_s": 1, "measured_time_s": 1, "peak_memory_gib": 1,
                                                        "measured_peak_memory_gib": "\uff11.5"}) + "\n"},
     EVALUATE_ESTIMATES, 2),
    ("estimates-only-errors", {"m.jsonl": '{"row": 1, "error": "tp: bad", "measured_time_s": 1}\n'},
     EVALUATE_ESTIMATES, 2),
    # ---- memx-run's metrics read by memx evaluate
    ("run-metrics-binary", {"run/metrics.jsonl": BINARY}, EVALUATE_RUN, 2),
    ("run-metrics-broken-line", {"run/metrics.jsonl": json.dumps(STEP) + '\n{"step":\n'}, EVALUATE_RUN, 2),
    ("run-metrics-nan-time", {"run/metrics.jsonl": json.dumps(STEP).replace("1.0,", "NaN,", 1) + "\n"},
     EVALUATE_RUN, 2),
    ("run-metrics-overflow", {"run/metrics.jsonl": json.dumps(STEP).replace("1.0,", "1e400,", 1) + "\n"},
     EVALUATE_RUN, 2),
    ("run-metrics-text-generation", {"run/metrics.jsonl": json.dumps({**STEP, "generation": "1"}) + "\n"},
     EVALUATE_RUN, 2),
    ("run-metrics-no-stages", {"run/metrics.jsonl": json.dumps({**STEP, "stages": []}) + "\n"}, EVALUATE_RUN, 2),
    ("run-metrics-never-measured", {"run/metrics.jsonl": json.dumps({**STEP, "step_time_s": None}) + "\n"},
     EVALUATE_RUN, 2),
    ("run-metrics-a-directory", {"run/metrics.jsonl/x": "x"}, EVALUATE_RUN, 2),
    ("run-without-metrics", {"run/plan.json": "{}"}, EVALUATE_RUN, 2),
    # ---- measured runs of memx cluster fit
    ("fit-binary", {"runs.csv": BINARY}, FIT, 2),
    ("fit-nan-time", {"runs.csv": RUNS_HEAD + "1,2,2,nan\n"}, FIT, 2),
    ("fit-huge-digits", {"runs.csv": RUNS_HEAD + "1,2,2," + "9" * 5000 + "\n"}, FIT, 2),
    ("fit-no-measurement", {"runs.csv": RUNS_HEAD + "1,2,2,\n"}, FIT, 2),
    ("fit-out-proc", {"runs.csv": RUNS_HEAD + "1,2,2,1.5\n"}, FIT[:-5] + ["/proc/x.yaml"] + FIT[-4:], 2),
    ("fit-out-is-cluster", {"runs.csv": RUNS_HEAD + "1,2,2,1.5\n"}, FIT[:-5] + ["{d}/cluster.yaml"] + FIT[-4:], 2),
    # ---- nothing fits: exit 3 with the closest candidates
    ("nothing-fits", {}, ["plan", "--model", "llama2-70b", "--cluster", "{d}/cluster.yaml", "--quiet"], 3),
]


def _write(directory, files) -> None:
    for name, content in {"cluster.yaml": CLUSTER, **files}.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.startswith("@"):  # a symbolic link to the given target
            os.symlink(content, directory / name[1:])
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


def _snapshot(directory) -> dict:
    return {str(p.relative_to(directory)): (p.stat().st_mode, p.read_bytes() if p.is_file() else None)
            for p in sorted(directory.rglob("*")) if not p.is_symlink()}


@pytest.mark.parametrize("case_id, files, argv, code", CASES, ids=[c[0] for c in CASES])
def test_hostile_input_is_one_line_and_writes_nothing(tmp_path, capsys, case_id, files, argv, code):
    _write(tmp_path, files)
    before = _snapshot(tmp_path)
    argv = [a.replace("{d}", str(tmp_path)) for a in argv]
    try:
        got = main(argv)
    except SystemExit as exc:  # argparse's own errors use the same one-line format
        got = exc.code
    out, err = capsys.readouterr()
    lines = [line for line in err.strip().splitlines() if not line.startswith("memx: warning:")]
    assert "Traceback" not in err + out
    assert got == code, err
    assert len([line for line in lines if line.startswith("memx: error:")]) == 1, err
    if code == 2:
        assert len(lines) == 1 and lines[0].startswith("memx: error:"), err
    assert _snapshot(tmp_path) == before  # nothing written, replaced or left behind
    assert not os.path.exists(tmp_path / "pwned")


def test_the_suite_holds_at_least_a_hundred_cases():
    assert len(CASES) >= 100 and len({c[0] for c in CASES}) == len(CASES)


def test_a_good_plan_and_cluster_pass_the_same_doors(tmp_path, capsys):
    """The base files the cases break are themselves fine."""
    _write(tmp_path, {"plan.json": json.dumps(PLAN), "config.json": json.dumps(HF_CONFIG)})
    assert main([a.replace("{d}", str(tmp_path)) for a in EXPORT]) == 0
    assert main([a.replace("{d}", str(tmp_path)) for a in ESTIMATE_PLAN]) == 0
    assert main([a.replace("{d}", str(tmp_path)) for a in HF + ["--search-budget-s", "5"]]) == 0
    capsys.readouterr()


# ---- memx-run: checked before any worker starts (--dry-run, so that a case let through plans
# here instead of launching workers)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_CLUSTER = os.path.join(REPO, "examples", "clusters", "cpu-emulated.yaml")
TRAIN = os.path.join(REPO, "examples", "train.py")
RUN = ["--nproc-per-node", "4", "--cluster", CPU_CLUSTER, "--dry-run"]
SCRIPT = [TRAIN, "--model", "llama-tiny"]

# (id, environment, files, argv)
LAUNCHER_CASES = [
    ("env-monitor-interval-text", {"MEMX_MONITOR_INTERVAL": "abc"}, {}, RUN + SCRIPT),
    ("env-monitor-interval-zero", {"MEMX_MONITOR_INTERVAL": "0"}, {}, RUN + SCRIPT),
    ("env-headroom-nan", {"MEMX_MIN_HEADROOM": "nan"}, {}, RUN + SCRIPT),
    ("env-above-prediction-nan", {"MEMX_ABOVE_PREDICTION": "nan"}, {}, RUN + SCRIPT),
    ("env-pressure-samples-zero", {"MEMX_PRESSURE_SAMPLES": "0"}, {}, RUN + SCRIPT),
    ("env-ballast-garbage", {"MEMX_FAULT_BALLAST": "garbage"}, {}, RUN + SCRIPT),
    ("env-ballast-inf", {"MEMX_FAULT_BALLAST": "rank=1,step=1,gib=inf"}, {}, RUN + SCRIPT),
    ("env-kill-rank-text", {"MEMX_FAULT_KILL_CALIBRATION": "rank=x"}, {}, RUN + SCRIPT),
    ("env-calibration-timeout-text", {"MEMX_CALIBRATION_TIMEOUT_S": "abc"}, {}, RUN + SCRIPT),
    ("env-calibration-timeout-nan", {"MEMX_CALIBRATION_TIMEOUT_S": "nan"}, {}, RUN + SCRIPT),
    ("env-step-timeout-zero", {"MEMX_STEP_TIMEOUT_S": "0"}, {}, RUN + SCRIPT),
    ("env-strict-domains-true", {"MEMX_STRICT_DOMAINS": "true"}, {}, RUN + SCRIPT),
    ("env-max-replans-negative", {"MEMX_MAX_REPLANS": "-1"}, {}, RUN + SCRIPT),
    ("env-checkpoint-every-text", {"MEMX_CHECKPOINT_EVERY": "often"}, {}, RUN + SCRIPT),
    ("env-checkpoint-every-superscript", {"MEMX_CHECKPOINT_EVERY": "\u00b2"}, {}, RUN + SCRIPT),
    ("env-max-replans-superscript", {"MEMX_MAX_REPLANS": "\u00b2"}, {}, RUN + SCRIPT),
    ("env-max-replans-5000-digits", {"MEMX_MAX_REPLANS": "9" * 5000}, {}, RUN + SCRIPT),
    ("env-monitor-interval-fullwidth", {"MEMX_MONITOR_INTERVAL": "\uff11\uff10"}, {}, RUN + SCRIPT),
    ("env-headroom-fullwidth", {"MEMX_MIN_HEADROOM": "\uff10.1"}, {}, RUN + SCRIPT),
    ("env-step-timeout-superscript", {"MEMX_STEP_TIMEOUT_S": "6\u00b2"}, {}, RUN + SCRIPT),
    ("env-ballast-superscript", {"MEMX_FAULT_BALLAST": "rank=\u00b2,step=1,gib=1"}, {}, RUN + SCRIPT),
    ("run-nproc-fullwidth", {}, {}, ["--nproc-per-node", "\uff14", "--dry-run"] + SCRIPT),
    ("run-nnodes-superscript", {}, {}, RUN + ["--nnodes", "\u00b9"] + SCRIPT),
    ("run-budget-superscript", {}, {}, RUN + ["--search-budget-s", "\u00b2"] + SCRIPT),
    ("run-options-fullwidth", {}, {"o.yaml": "global_batch_size: \uff18\n"}, RUN + ["--config", "{d}/o.yaml"] + SCRIPT),
    ("run-nproc-text", {}, {}, ["--nproc-per-node", "abc", "--dry-run"] + SCRIPT),
    ("run-nproc-negative", {}, {}, ["--nproc-per-node", "-1", "--dry-run"] + SCRIPT),
    ("run-nproc-huge", {}, {}, ["--nproc-per-node", "99999999", "--dry-run"] + SCRIPT),
    ("run-max-restarts-negative", {}, {}, RUN + ["--max-restarts", "-1"] + SCRIPT),
    ("run-profile-db-dev-null", {}, {}, RUN + ["--profile-db", "/dev/null"] + SCRIPT),
    ("run-profile-db-directory", {}, {"db/x": "x"}, RUN + ["--profile-db", "{d}/db"] + SCRIPT),
    ("run-profile-db-binary", {}, {"db.jsonl": BINARY}, RUN + ["--profile-db", "{d}/db.jsonl"] + SCRIPT),
    ("run-budget-nan", {}, {}, RUN + ["--search-budget-s", "nan"] + SCRIPT),
    ("run-weights-nan", {}, {}, RUN + ["--weights", "nan,1,1"] + SCRIPT),
    ("run-export-dev-null", {}, {}, RUN + ["--export-plan", "/dev/null"] + SCRIPT),
    ("run-export-directory", {}, {"out/x": "x"}, RUN + ["--export-plan", "{d}/out"] + SCRIPT),
    ("run-resume-missing", {}, {}, RUN + ["--resume", "{d}/no-run"] + SCRIPT),
    ("run-resume-binary-plan", {}, {"run/plan.json": BINARY}, RUN + ["--resume", "{d}/run"] + SCRIPT),
    ("run-dir-below-file", {}, {"file.txt": "keep"}, RUN + ["--run-dir", "{d}/file.txt/run"] + SCRIPT),
    ("run-dir-other-model", {}, {"run/plan.json": json.dumps(PLAN)}, RUN + ["--run-dir", "{d}/run"] + [
        TRAIN, "--model", "llama-small"]),
    ("run-cluster-binary", {}, {"c.yaml": BINARY}, ["--nproc-per-node", "4", "--cluster", "{d}/c.yaml", "--dry-run"]
     + SCRIPT),
    ("run-plan-tp-negative", {}, {"p.json": plan_with(_set("tp", -1))}, RUN + ["--plan", "{d}/p.json"] + SCRIPT),
]


@pytest.mark.parametrize("case_id, env, files, argv", LAUNCHER_CASES, ids=[c[0] for c in LAUNCHER_CASES])
def test_memx_run_refuses_before_any_worker_starts(tmp_path, capsys, monkeypatch, case_id, env, files, argv):
    from memx_launch.runtime.launcher import main as memx_run

    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    for name in [k for k in os.environ if k.startswith("MEMX_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    before = _snapshot(tmp_path)
    try:
        code = memx_run([a.replace("{d}", str(tmp_path)) for a in argv])
    except SystemExit as exc:  # argparse's own errors use the same one-line format
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2, err
    assert "Traceback" not in err + out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memx-run: error:"), err
    assert _snapshot(tmp_path) == before
