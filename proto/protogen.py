"""Generate Python stubs for proto/ttserve/v1/*.proto into ttserve/v1/ (never committed)."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT = ROOT  # package ttserve.v1 mirrors the proto package path ttserve/v1


def generate() -> list[Path]:
    from grpc_tools import protoc
    import grpc_tools

    sources = sorted(PROTO_ROOT.glob("ttserve/v1/*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={OUT}",
            f"--pyi_out={OUT}", f"--grpc_python_out={OUT}", *map(str, sources)]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {', '.join(map(str, sources))}")
    return sources


if __name__ == "__main__":
    for source in generate():
        print(f"generated stubs for {source.relative_to(ROOT)}", file=sys.stderr)
