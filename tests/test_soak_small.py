"""A small run of profiles/scripts/soak_cpu.py (the 1,000-request soak is too slow for CI): mixed
params, refused and faulting requests, blocks back after every call, outputs equal to solo
runs, vanilla and EAGLE-3."""
import importlib.util
from pathlib import Path


def test_small_soak(tmp_path):
    path = Path(__file__).resolve().parents[1] / "profiles" / "scripts" / "soak_cpu.py"
    spec = importlib.util.spec_from_file_location("soak_cpu", path)
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    target, head = soak.build_fixtures(tmp_path, trained=False)
    reqs = soak.make_requests(80, seed=1, p_bad=0.05, p_fault=0.05)
    for kind in ("vanilla", "eagle3"):
        res = soak.soak(kind, target, head, reqs, chunk=20)
        assert res["calls_with_blocks_missing"] == 0 and res["leftover_requests"] == 0, res
        assert res["blocks_free_at_end"] == res["blocks_total"], res
        assert res["solo_mismatches"] == 0 and res["solo_checked"] == res["served"] > 60, res
        assert res["refused"] >= 1 and res["num_step_faults"] >= 1, res
