"""The PEP 517 build backend of the turbokv package: a wheel (and an sdist)
of turbokv/ with no build dependencies, so that `pip install ./client/python`
works without an index. The metadata comes from pyproject.toml's [project]."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import tarfile
import zipfile
from typing import Dict, Iterator, List, Optional, Tuple

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "turbokv"
TAG = "py3-none-any"


def _project() -> Dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _metadata(project: Dict) -> str:
    lines = ["Metadata-Version: 2.1", f"Name: {project['name']}", f"Version: {project['version']}",
             f"Summary: {project['description']}", f"Requires-Python: {project['requires-python']}"]
    lines += [f"Requires-Dist: {dependency}" for dependency in project.get("dependencies", [])]
    for extra, dependencies in project.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {dependency}; extra == "{extra}"' for dependency in dependencies]
    return "\n".join(lines) + "\n"


def _dist_info(project: Dict) -> Tuple[str, Dict[str, str]]:
    """The .dist-info folder's name and its files, but RECORD."""
    name = f"{project['name']}-{project['version']}.dist-info"
    wheel = f"Wheel-Version: 1.0\nGenerator: turbokv_build\nRoot-Is-Purelib: true\nTag: {TAG}\n"
    return name, {"METADATA": _metadata(project), "WHEEL": wheel}


def _sources() -> Iterator[str]:
    """The package's files, relative to ROOT: its .py files and py.typed."""
    for folder, dirs, files in os.walk(os.path.join(ROOT, PACKAGE)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for file in sorted(files):
            if file.endswith(".py") or file == "py.typed":
                yield os.path.relpath(os.path.join(folder, file), ROOT)


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def get_requires_for_build_wheel(config_settings: Optional[Dict] = None) -> List[str]:
    return []


def get_requires_for_build_sdist(config_settings: Optional[Dict] = None) -> List[str]:
    return []


def prepare_metadata_for_build_wheel(metadata_directory: str, config_settings: Optional[Dict] = None) -> str:
    name, files = _dist_info(_project())
    os.makedirs(os.path.join(metadata_directory, name), exist_ok=True)
    for file, text in files.items():
        with open(os.path.join(metadata_directory, name, file), "w") as f:
            f.write(text)
    return name


def build_wheel(wheel_directory: str, config_settings: Optional[Dict] = None,
                metadata_directory: Optional[str] = None) -> str:
    project = _project()
    filename = f"{project['name']}-{project['version']}-{TAG}.whl"
    dist_info, meta = _dist_info(project)
    record = []
    with zipfile.ZipFile(os.path.join(wheel_directory, filename), "w", zipfile.ZIP_DEFLATED) as wheel:
        entries = [(path.replace(os.sep, "/"), open(os.path.join(ROOT, path), "rb").read()) for path in _sources()]
        entries += [(f"{dist_info}/{file}", text.encode()) for file, text in meta.items()]
        for path, data in entries:
            wheel.writestr(path, data)
            record.append(_record_line(path, data))
        record.append(f"{dist_info}/RECORD,,")
        wheel.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return filename


def build_sdist(sdist_directory: str, config_settings: Optional[Dict] = None) -> str:
    project = _project()
    base = f"{project['name']}-{project['version']}"
    paths = ["pyproject.toml", os.path.join("build_backend", "turbokv_build.py"), *_sources()]
    with tarfile.open(os.path.join(sdist_directory, f"{base}.tar.gz"), "w:gz", format=tarfile.PAX_FORMAT) as sdist:
        for path in paths:
            sdist.add(os.path.join(ROOT, path), arcname=f"{base}/{path}", recursive=False)
        info = _metadata(project).encode()
        entry = tarfile.TarInfo(f"{base}/PKG-INFO")
        entry.size = len(info)
        sdist.addfile(entry, io.BytesIO(info))
    return f"{base}.tar.gz"
