"""`memx estimate` run in the test's process: a cluster dict written as a file, a layout's plan
(its --json file) and the rows of a --cases file by id."""

import json

from memx_launch.cli import main


def cluster_file(tmp_path, cluster: dict) -> str:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(cluster))
    return str(path)


def estimated_plan(tmp_path, name: str, args: list) -> dict:
    """The plan `memx estimate ARGS --json` writes, as a dict (the file is tmp_path/NAME.json)."""
    path = tmp_path / f"{name}.json"
    assert main(["estimate", *args, "--json", str(path)]) == 0
    return json.loads(path.read_text())


def cases_rows(capsys, tmp_path, table: str, args: list) -> dict:
    """The rows `memx estimate --cases` gives for the CSV ``table``, by their id column."""
    path = tmp_path / "cases.csv"
    path.write_text(table)
    capsys.readouterr()
    assert main(["estimate", *args, "--cases", str(path)]) == 0
    rows = {r["id"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert all("error" not in r for r in rows.values()), rows
    return rows
