"""The committed gRPC stubs (turbokv/v1/turbokv_pb2*.py) against what protoc
and grpc_python_plugin make of proto/turbokv/v1/turbokv.proto now: exits 1
naming each file that differs (a proto change without regenerating them), 0
when they are current. With --write it rewrites them instead (CMake's target
python_stubs)."""

import argparse
import difflib
import os
import subprocess
import sys
import tempfile

STUBS = ("turbokv_pb2.py", "turbokv_pb2_grpc.py")


def generate(args, out: str) -> None:
    subprocess.run([args.protoc, f"--proto_path={args.proto_dir}", f"--python_out={out}", f"--grpc_python_out={out}",
                    f"--plugin=protoc-gen-grpc_python={args.plugin}",
                    os.path.join(args.proto_dir, "turbokv", "v1", "turbokv.proto")], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    for flag in ("--protoc", "--plugin", "--proto-dir", "--package-dir"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--write", action="store_true", help="rewrite the committed stubs")
    args = parser.parse_args()
    committed = os.path.join(args.package_dir, "turbokv", "v1")
    with tempfile.TemporaryDirectory(prefix="turbokv-stubs-") as out:
        generate(args, out)
        stale = []
        for name in STUBS:
            with open(os.path.join(out, "turbokv", "v1", name)) as f:
                fresh = f.read()
            path = os.path.join(committed, name)
            old = open(path).read() if os.path.exists(path) else ""
            if fresh == old:
                continue
            if args.write:
                with open(path, "w") as f:
                    f.write(fresh)
                print(f"rewrote {path}")
                continue
            stale.append(path)
            sys.stdout.writelines(list(difflib.unified_diff(old.splitlines(True), fresh.splitlines(True), path,
                                                            "generated from the proto now"))[:40])
    if stale:
        print(f"\nstale stubs: {', '.join(stale)}: the proto changed; regenerate them with "
              "`cmake --build build --target python_stubs` and commit them")
        return 1
    print("the committed stubs match the proto")
    return 0


if __name__ == "__main__":
    sys.exit(main())
