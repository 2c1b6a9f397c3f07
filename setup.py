"""Build glue: maps service folders into the ttserve namespace and generates protobuf stubs.

The stubs (ttserve/v1/*_pb2*.py) are build products, never committed: `build_py` regenerates
them from proto/ for wheels and editable installs alike.
"""
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
# folder on disk -> import package
SERVICE_FOLDERS = {"ttserve": "ttserve", "control": "ttserve.control",
                   "worker": "ttserve.worker", "gateway": "ttserve.gateway"}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages, package_dir = [], {}
    for folder, package in SERVICE_FOLDERS.items():
        package_dir[package] = folder
        packages.append(package)
        packages += [f"{package}.{sub}" for sub in find_packages(where=folder)]
    return packages, package_dir


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        import importlib.util
        spec = importlib.util.spec_from_file_location("protogen", ROOT / "proto" / "protogen.py")
        protogen = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(protogen)
        protogen.generate()
        super().run()


packages, package_dir = _packages()
setup(packages=packages, package_dir=package_dir, cmdclass={"build_py": BuildPyWithStubs},
      package_data={"ttserve.v1": ["*.py", "*.pyi"],
                    "ttserve.worker.backends.torch.models": ["*.c", "*.h"]})  # decode_attention.c, bf16_gemm.c: built where they run
