"""The generated protobuf code in mirrorspec/v1 must be exactly what protos/ produces."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_generated_code_is_not_stale(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_protos", REPO / "scripts" / "gen_protos.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = {p.name: p.read_bytes() for p in gen.generate(tmp_path)}
    committed = {p.name: p.read_bytes() for p in sorted((REPO / "mirrorspec" / "v1").glob("*.py*"))}
    assert fresh.keys() == committed.keys(), "generated file set changed: run python scripts/gen_protos.py"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated code {stale}: run python scripts/gen_protos.py and commit"
