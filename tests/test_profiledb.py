import json

import pytest

from memx_launch.errors import ConfigError
from memx_launch.profiling.profiledb import Measurement, ProfileDB, ProfileWarning, merge_profiles
from memx_launch.specs.catalog import MODEL_CATALOG


def record(model="llama-tiny", mbs=1, time_s=0.01, rank_software="2.13"):
    spec = MODEL_CATALOG[model]
    return Measurement(device_type="cpu", device={"vendor": "cpu", "memory_gib": 8.0, "peak_tflops": 0.1},
                       model=spec.name, model_signature=spec.signature(), block_shape=spec.to_dict(), tp=1,
                       micro_batch_size=mbs, seq_len=32, recompute="none", dtype="fp32", num_blocks=1,
                       feasible=True, time_s=time_s, peak_memory_bytes=1e6, software={"torch": rank_software})


def test_append_and_read_round_trip(tmp_path):
    db = ProfileDB(str(tmp_path / "p.jsonl"))
    assert db.append([record(mbs=1), record(mbs=2)]) == 2
    db.append([record(mbs=4)])
    assert [r.micro_batch_size for r in db.read()] == [1, 2, 4]


def test_the_tp_link_a_record_ran_over_round_trips_and_a_bad_one_is_corrupt(tmp_path):
    from dataclasses import replace

    path = tmp_path / "p.jsonl"
    db = ProfileDB(str(path))
    db.append([replace(record(mbs=1), tp=2, tp_link_gbps=16.0, tp_over_pcie=True)])
    with open(path, "a") as f:
        f.write(json.dumps({**json.loads(record(mbs=2).to_json()), "tp_over_pcie": "yes"}) + "\n")
    with pytest.warns(ProfileWarning, match="p.jsonl:2: skipped a corrupt profile record"):
        [r] = db.read()
    assert (r.tp_link_gbps, r.tp_over_pcie) == (16.0, True)


def test_corrupt_line_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "p.jsonl"
    db = ProfileDB(str(path))
    db.append([record(mbs=1)])
    with open(path, "a") as f:
        f.write('{"device_type": "cpu", "truncated\n')
        f.write(json.dumps({**json.loads(record(mbs=2).to_json()), "format": 99}) + "\n")
    db.append([record(mbs=8)])
    with pytest.warns(ProfileWarning) as caught:
        records = db.read()
    messages = [str(w.message) for w in caught]
    assert any("p.jsonl:2: skipped a corrupt profile record" in m for m in messages)
    assert any("p.jsonl:3: skipped" in m and "format 99, this memx reads 1" in m for m in messages)
    assert [r.micro_batch_size for r in records] == [1, 8]


def test_profile_of_another_model_is_a_clear_error(tmp_path):
    db = ProfileDB(str(tmp_path / "p.jsonl"))
    db.append([record(model="llama-tiny")])
    with pytest.raises(ConfigError, match=r"holds measurements of llama-tiny .* not of llama-small.*memx profile "
                                          r"--model llama-small"):
        db.for_model(MODEL_CATALOG["llama-small"])
    assert len(db.for_model(MODEL_CATALOG["llama-tiny"])) == 1


def test_missing_file_names_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="--profile-db.*run memx profile"):
        ProfileDB(str(tmp_path / "none.jsonl")).read()


def test_merge_from_ranks_deduplicates_and_keeps_the_latest(tmp_path):
    a, b = tmp_path / "rank0.jsonl", tmp_path / "rank1.jsonl"
    ProfileDB(str(a)).append([record(mbs=1, time_s=0.01), record(mbs=2)])
    ProfileDB(str(b)).append([record(mbs=1, time_s=0.02), record(mbs=4), record(mbs=4, rank_software="2.14")])
    out = tmp_path / "merged.jsonl"
    assert merge_profiles([str(a), str(b)], str(out)) == 4
    merged = ProfileDB(str(out)).read()
    assert {r.micro_batch_size: r.time_s for r in merged if r.software["torch"] == "2.13"}[1] == 0.02


def test_a_record_torn_by_a_crash_is_not_glued_onto_the_next(tmp_path):
    path = tmp_path / "p.jsonl"
    db = ProfileDB(str(path))
    db.append([record(mbs=1)])
    with open(path, "a") as f:
        f.write(record(mbs=2).to_json()[:40])  # the disk filled (or the process died) mid-record
    assert db.append([record(mbs=4)]) == 1
    with pytest.warns(ProfileWarning, match="p.jsonl:2: skipped a corrupt profile record"):
        assert [r.micro_batch_size for r in db.read()] == [1, 4]


def test_an_append_that_fails_midway_leaves_the_profile_as_it_was(tmp_path, monkeypatch):
    import errno
    import os

    path = tmp_path / "p.jsonl"
    db = ProfileDB(str(path))
    db.append([record(mbs=1)])
    before = path.read_bytes()
    real_write = os.write

    def disk_full(fd, data):  # half the bytes land, then the disk is full
        real_write(fd, data[:len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", disk_full)
    with pytest.raises(OSError):
        db.append([record(mbs=2), record(mbs=4)])
    monkeypatch.undo()
    assert path.read_bytes() == before
    db.append([record(mbs=8)])
    assert [r.micro_batch_size for r in db.read()] == [1, 8]


def test_an_append_never_follows_a_link_into_another_file(tmp_path):
    import os

    victim = tmp_path / "notes.txt"
    victim.write_text("mine\n")
    os.symlink(victim, tmp_path / "p.jsonl")
    with pytest.raises(ConfigError, match="symbolic link"):
        ProfileDB(str(tmp_path / "p.jsonl")).check_appendable("--out")
    with pytest.raises(OSError):  # the append itself refuses the link too (O_NOFOLLOW)
        ProfileDB(str(tmp_path / "p.jsonl")).append([record()])
    assert victim.read_text() == "mine\n"


def test_the_host_time_a_gpu_record_measured_round_trips_and_a_negative_one_is_corrupt(tmp_path):
    from dataclasses import replace

    path = tmp_path / "p.jsonl"
    db = ProfileDB(str(path))
    db.append([replace(record(mbs=1), host_time_s=3e-3)])
    with open(path, "a") as f:
        f.write(json.dumps({**json.loads(record(mbs=2).to_json()), "host_time_s": -1.0}) + "\n")
    with pytest.warns(ProfileWarning, match="p.jsonl:2: skipped a corrupt profile record"):
        [r] = db.read()
    assert r.host_time_s == 3e-3
    # A line an older memx wrote, without the field, reads back as unmeasured.
    older = {k: v for k, v in json.loads(record(mbs=4).to_json()).items() if k != "host_time_s"}
    path.write_text(json.dumps(older) + "\n")
    [r] = db.read()
    assert r.micro_batch_size == 4 and r.host_time_s is None
