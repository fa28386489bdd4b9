#!/usr/bin/env python
"""Generate the Python protobuf/gRPC code in mirrorspec/v1 from protos/, reproducibly.

Usage: python scripts/gen_protos.py [OUT_ROOT]   (default: the repository root)

The output is a pure function of the .proto files and the pinned grpcio-tools version
(see pyproject's test extra); tests/test_protos.py regenerates into a temporary folder and
fails if the committed code differs.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"
PACKAGE = Path("mirrorspec") / "v1"
INIT = '"""Generated from protos/mirrorspec/v1 by scripts/gen_protos.py. Do not edit."""\n'


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(p.relative_to(PROTO_ROOT).as_posix() for p in (PROTO_ROOT / PACKAGE).glob("*.proto"))
    (out_root / PACKAGE).mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_root}", f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    (out_root / PACKAGE / "__init__.py").write_text(INIT)
    return sorted((out_root / PACKAGE).glob("*.py*"))


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO
    for path in generate(out):
        print(path.relative_to(out))
