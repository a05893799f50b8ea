"""Generate router/grpc/protos/grpc_service_pb2.py (and its .pyi) from grpc_service.proto.

    python scripts/generate_protos.py           # write the modules beside the .proto
    python scripts/generate_protos.py --check   # exit 1 if the committed modules differ from a fresh run

The generated module builds its messages in a descriptor pool of its own instead of protobuf's
default pool: tritonclient.grpc registers the same names (`inference.ModelInferRequest`, ...) in
the default pool, and a process that holds both (a test, a benchmark, a client embedding the
router) would otherwise fail to import the second with "duplicate symbol".
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTOS = Path(__file__).resolve().parents[1] / "router" / "grpc" / "protos"
SOURCE = "grpc_service.proto"
DEFAULT_POOL = "_descriptor_pool.Default().AddSerializedFile("
PRIVATE_POOL = "_descriptor_pool.DescriptorPool().AddSerializedFile("  # one pool per file: the file imports none


def generate(out: Path) -> list[Path]:
    """Run protoc into `out`; rewrite the module to its private pool. The generated files' paths."""
    code = protoc.main(["protoc", f"-I{PROTOS}", f"--python_out={out}", f"--pyi_out={out}", str(PROTOS / SOURCE)])
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")
    module = out / "grpc_service_pb2.py"
    text = module.read_text(encoding="utf-8")
    if text.count(DEFAULT_POOL) != 1:
        raise SystemExit(f"{module}: expected one {DEFAULT_POOL!r}; protoc's output changed, update this script")
    module.write_text(text.replace(DEFAULT_POOL, PRIVATE_POOL), encoding="utf-8")
    return [module, out / "grpc_service_pb2.pyi"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed modules instead of writing")
    args = parser.parse_args(argv)
    if not args.check:
        for path in generate(PROTOS):
            print(f"wrote {path}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = [p.name for p in generate(Path(tmp)) if p.read_bytes() != (PROTOS / p.name).read_bytes()]
    if stale:
        print(f"stale: {', '.join(stale)} differ from {SOURCE}; run `make protos`", file=sys.stderr)
        return 1
    print(f"the generated modules match {SOURCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
