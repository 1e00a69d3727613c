"""Check the wheels and sdists of the apex-* packages before anyone installs them.

    python tools/check_wheels.py dist/*.whl dist/*.tar.gz

For each wheel: it holds only the import paths its distribution owns (DESIGN.md; only
apex-mta-kernels holds apex/__init__.py) and its .dist-info; no two wheels hold the same path;
RECORD lists every file with the right hash; METADATA has the right name and version, a
Requires-Python and the dependencies the package needs (a feature package's range of
apex-mta-kernels must admit the apex-mta-kernels being checked beside it). For each sdist:
PKG-INFO, pyproject.toml, README.md, CHANGELOG.md, src/ and tests/ are there, src/ holds only
what the wheel may hold, and nothing compiled is in it. Prints one line per artifact; exits 1 if anything is wrong.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version

MTA = "apex-mta-kernels"
# Import paths each distribution owns: folders (ending in "/") and single files. `required`
# must be there; the rest may be (top-level extension aliases that later releases add).
OWNED = {
    MTA: {
        "required": ["apex/__init__.py", "apex/multi_tensor_apply/", "amp_C.py", "apex_C.py"],
        "optional": ["apex/_autocast_utils.py", "apex/_autocast_utils/"],
    },
    "apex-optim": {"required": ["apex/optimizers/"], "optional": []},
    "apex-norm": {"required": ["apex/normalization/"], "optional": ["fused_layer_norm_cuda.py"]},
    "apex-parallel": {"required": ["apex/parallel/"], "optional": ["syncbn.py"]},
    "apex-amp": {"required": ["apex/amp/", "apex/fp16_utils/"], "optional": []},
}
# Distribution -> requirement names its METADATA must list (with what specifier, if any).
# setuptools: torch<2.4 cpp_extension imports it to compile, and Python 3.12 no longer ships it.
NEEDS = {MTA: {"torch": ">=2.3", "ninja": "", "setuptools": ">=64"}}
NEEDS.update({d: {"torch": ">=2.3", MTA: None} for d in OWNED if d != MTA})
SDIST_FILES = ["PKG-INFO", "pyproject.toml", "README.md", "CHANGELOG.md"]
NEVER = ("__pycache__/", ".pyc", ".pyo", ".so.lock", ".egg-info/")


def owner_entry(path: str, dist: str) -> bool:
    spec = OWNED[dist]
    for entry in spec["required"] + spec["optional"]:
        if (entry.endswith("/") and path.startswith(entry)) or path == entry:
            return True
    return False


def required_present(paths: list[str], dist: str) -> list[str]:
    missing = []
    for entry in OWNED[dist]["required"]:
        want = entry + "__init__.py" if entry.endswith("/") else entry
        if want not in paths:
            missing.append(want)
    return missing


def record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


class Checker:
    def __init__(self) -> None:
        self.errors: list[str] = []
        self.seen: dict[str, str] = {}  # wheel path -> wheel file holding it
        self.versions: dict[str, Version] = {}  # dist -> version of its wheel
        self.mta_ranges: list[tuple[str, Requirement]] = []

    def error(self, artifact: Path, message: str) -> None:
        self.errors.append(f"{artifact.name}: {message}")

    def metadata(self, artifact: Path, text: str, dist: str, version: Version) -> None:
        meta = Parser().parsestr(text)
        if canonicalize_name(meta.get("Name", "")) != dist:
            self.error(
                artifact, f"METADATA Name is {meta.get('Name')!r}, the file name says {dist}"
            )
        if Version(meta.get("Version", "0")) != version:
            self.error(artifact, f"METADATA Version {meta.get('Version')} != file name {version}")
        if not meta.get("Requires-Python", "").startswith(">=3.10"):
            self.error(artifact, f"Requires-Python is {meta.get('Requires-Python')!r}, want >=3.10")
        if meta.get("Description-Content-Type") != "text/markdown" or not meta.get_payload():
            self.error(artifact, "no README (markdown) in the metadata")
        reqs = {}
        for line in meta.get_all("Requires-Dist") or []:
            req = Requirement(line)
            if req.marker is None:
                reqs[canonicalize_name(req.name)] = req
        for name, spec in NEEDS[dist].items():
            if name not in reqs:
                self.error(artifact, f"Requires-Dist lacks {name}")
            elif name == MTA:
                self.mta_ranges.append((artifact.name, reqs[name]))
                if not reqs[name].specifier or all(
                    s.operator not in ("<", "<=", "==", "~=") for s in reqs[name].specifier
                ):
                    self.error(artifact, f"{reqs[name]} has no upper bound on apex-mta-kernels")
            elif spec and str(reqs[name].specifier) != spec:
                self.error(artifact, f"Requires-Dist {reqs[name]}, want {name}{spec}")
        extra = sorted(set(reqs) - set(NEEDS[dist]))
        if extra:
            self.error(artifact, f"unexpected dependencies {extra}")

    def wheel(self, path: Path) -> str:
        name, version, _, tags = parse_wheel_filename(path.name)
        dist = str(name)
        if dist not in OWNED:
            self.error(path, f"{dist} is not one of the apex-* distributions")
            return "skipped"
        self.versions[dist] = version
        info = f"{dist.replace('-', '_')}-{version}.dist-info/"
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if not n.endswith("/")]
            files = {n: zf.read(n) for n in names}
        payload = [n for n in names if not n.startswith(info)]
        for n in payload:
            if not owner_entry(n, dist):
                self.error(path, f"holds {n}, which is not {dist}'s to ship")
            if n in self.seen:
                self.error(path, f"{n} is also in {self.seen[n]}")
            self.seen.setdefault(n, path.name)
        for n in names:
            if any(bad in n for bad in NEVER):
                self.error(path, f"holds a build leftover: {n}")
        for missing in required_present(payload, dist):
            self.error(path, f"lacks {missing}")
        for req in ("METADATA", "WHEEL", "RECORD"):
            if info + req not in files:
                self.error(path, f"lacks {info}{req}")
                return "broken"
        self.metadata(path, files[info + "METADATA"].decode(), dist, version)
        record = {
            row[0]: row[1] for row in csv.reader(io.StringIO(files[info + "RECORD"].decode()))
        }
        for n, data in files.items():
            if n == info + "RECORD":
                continue
            if n not in record:
                self.error(path, f"RECORD does not list {n}")
            elif record[n] != record_hash(data):
                self.error(path, f"RECORD hash of {n} is wrong")
        for n in record:
            if n not in files:
                self.error(path, f"RECORD lists {n}, which is not in the wheel")
        wheel_meta = Parser().parsestr(files[info + "WHEEL"].decode())
        pure = wheel_meta.get("Root-Is-Purelib", "").strip().lower() == "true"
        prebuilt = [n for n in payload if "/_prebuilt/" in n]
        tag = ".".join(sorted(str(t) for t in tags))
        if prebuilt and pure:
            self.error(path, "holds compiled kernels but says Root-Is-Purelib: true")
        if not prebuilt and (not pure or tag != "py3-none-any"):
            self.error(path, f"a pure-Python package should be py3-none-any, is {tag}")
        return f"{len(payload)} files, {tag}"

    def sdist(self, path: Path) -> str:
        name, version = parse_sdist_filename(path.name)
        dist = str(name)
        if dist not in OWNED:
            self.error(path, f"{dist} is not one of the apex-* distributions")
            return "skipped"
        top = f"{dist.replace('-', '_')}-{version}/"
        with tarfile.open(path) as tf:
            members = [m for m in tf.getmembers() if m.isfile()]
            names = [m.name for m in members]
            pkg_info = tf.extractfile(top + "PKG-INFO") if top + "PKG-INFO" in names else None
            pkg_info_text = pkg_info.read().decode() if pkg_info else None
        outside = [n for n in names if not n.startswith(top)]
        if outside:
            self.error(path, f"files outside {top}: {outside[:3]}")
        rel = [n[len(top) :] for n in names if n.startswith(top)]
        for want in SDIST_FILES:
            if want not in rel:
                self.error(path, f"lacks {want}")
        for folder in ("src/", "tests/"):
            if not any(n.startswith(folder) for n in rel):
                self.error(path, f"lacks {folder}")
        for n in rel:
            if any(bad in n for bad in NEVER):
                self.error(path, f"holds a build leftover: {n}")
            if n.startswith("src/") and not owner_entry(n[len("src/") :], dist):
                self.error(path, f"holds {n}, which is not {dist}'s to ship")
            if "/_prebuilt/" in n or n.endswith((".so", ".o")):
                self.error(path, f"holds a compiled file: {n} (sdists are source only)")
        missing = required_present([n[len("src/") :] for n in rel if n.startswith("src/")], dist)
        for m in missing:
            self.error(path, f"lacks src/{m}")
        if pkg_info_text is not None:
            self.metadata(path, pkg_info_text, dist, version)
        return f"{len(rel)} files"

    def cross_checks(self) -> None:
        mta = self.versions.get(MTA)
        if mta is None:
            return
        for artifact, req in self.mta_ranges:
            if not req.specifier.contains(mta, prereleases=True):
                self.errors.append(f"{artifact}: {req} does not admit apex-mta-kernels {mta}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+", type=Path, help=".whl and .tar.gz files")
    args = parser.parse_args(argv)
    checker = Checker()
    for path in sorted(args.artifacts, key=lambda p: p.name):
        if path.name.endswith(".whl"):
            summary = checker.wheel(path)
        elif path.name.endswith(".tar.gz"):
            summary = checker.sdist(path)
        else:
            checker.error(path, "neither a wheel nor an sdist")
            continue
        print(f"{path.name}: {summary}")
    checker.cross_checks()
    for line in checker.errors:
        print(f"ERROR {line}", file=sys.stderr)
    if checker.errors:
        print(
            f"{len(checker.errors)} problem(s) in {len(args.artifacts)} artifact(s)",
            file=sys.stderr,
        )
        return 1
    print(f"all {len(args.artifacts)} artifacts are fine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
