"""benchmarks/nemo_throughput.py: NVIDIA's published NeMo / Megatron-Bridge DGX-H100 rows as data,
every row asked as its recipe ran, and memx's step time on them within physical bounds."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks import nemo_throughput as nt  # noqa: E402
from benchmarks.common import GPUS  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    return nt.nemo_rows()


def test_every_row_is_expressible_and_fits(rows):
    assert len(rows) == 23 and not [r for r in rows if "error" in r]
    # Every published run ran: memx says each fits in an H100's 80 GB.
    assert all(r["fits"] for r in rows)
    tasks = {r["task"] for r in rows}
    assert tasks == {"pretrain", "sft", "lora"}


def test_transcribed_shapes_give_the_table_s_flops_per_token(rows):
    # The table's TFLOP/s over tokens/s against 6 x the matmul parameters plus the full s x s
    # attention of the shape memx is asked with: a wrong layer count or width would be far off.
    for model, ratio in nt.shape_check(rows).items():
        assert 0.95 <= ratio <= 1.05, model


def test_no_row_is_faster_than_its_matmuls_at_the_fp8_peak(rows):
    peak = 2 * GPUS["h100_80gb"][0]["peak_tflops"] * 1e12
    for r in rows:
        assert r["time_s"] >= r["shape_flops_per_token"] * r["tokens"] / (r["gpus"] * peak), r["layout"]


def test_the_405b_split_counts_the_embedding_and_the_loss_as_layers():
    model = nt.nemo_model("llama3.1-405b", 8192)
    # 126 layers + 2 over 8 stages of 8 chunks: 2 layers a chunk, one less on the first and last.
    assert nt.stage_layers(model, 8, 8, True) == [15, 16, 16, 16, 16, 16, 16, 15]
    assert nt.stage_layers(model, 8, 8, False) is None
