"""A cluster file of one node of one device type, for tests that need a plain GPU node."""

A100 = {"vendor": "nvidia", "memory_gib": 80, "peak_tflops": 312, "memory_bandwidth_gbps": 2039,
        "compute_capability": 8.0}
H100 = {"vendor": "nvidia", "memory_gib": 80, "peak_tflops": 989, "memory_bandwidth_gbps": 3350,
        "compute_capability": 9.0}


def one_node(device: dict, count: int, intra_node_gbps: float, name: str = "one-node") -> dict:
    """The cluster dict (ClusterSpec.from_dict, or a JSON cluster file) of ``count`` devices."""
    return {"version": 1, "name": name, "device_types": {"gpu": device},
            "nodes": [{"devices": {"gpu": count}, "intra_node_gbps": intra_node_gbps}]}
