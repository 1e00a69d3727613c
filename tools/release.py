"""Release one package: bump its version, date its changelog, commit, tag, build its dists.

    python tools/release.py apex-optim 0.2.0            # bump, changelog, commit, tag, build
    python tools/release.py apex-optim 0.2.0 --dry-run  # say what would change, change nothing

Steps, each checked before the next:
1. the package's files have no uncommitted change, and the tag ``NAME/vX.Y.Z`` does not exist;
2. ``_version.py`` gets the new version;
3. CHANGELOG.md: the newest section must read ``## X.Y.Z — unreleased`` (or ``## Unreleased``);
   it becomes ``## X.Y.Z — YYYY-MM-DD``. A release without a changelog entry is refused;
4. one commit with those two files, and an annotated tag ``NAME/vX.Y.Z`` on it;
5. the wheel and the sdist built from the tagged tree into ``dist/NAME-X.Y.Z/``.
Pushing the tag and uploading the dists are left to the person releasing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION_RE = re.compile(r"^\d+\.\d+\.\d+$")
HEADING_RE = re.compile(
    r"^## (?:(?P<version>\d+\.\d+\.\d+) — )?(?P<when>unreleased|Unreleased)\s*$"
)


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def version_file(pkg: Path) -> Path:
    found = sorted(pkg.glob("src/apex/*/_version.py"))
    if len(found) != 1:
        raise SystemExit(f"{pkg}: expected one src/apex/*/_version.py, found {found}")
    return found[0]


def bumped_changelog(text: str, version: str, date: str) -> str:
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith("## "):
            m = HEADING_RE.match(line.rstrip("\n"))
            if not m:
                raise SystemExit(
                    f"CHANGELOG.md: the newest section is {line.strip()!r}; write the changes "
                    f"under '## {version} — unreleased' first"
                )
            if m["version"] and m["version"] != version:
                raise SystemExit(
                    f"CHANGELOG.md: the unreleased section is for {m['version']}, not {version}"
                )
            lines[i] = f"## {version} — {date}\n"
            return "".join(lines)
    raise SystemExit("CHANGELOG.md has no '## ' section to release")


def build(dist: str, version: str, tag: str) -> Path:
    """Wheel and sdist from the tagged tree (not the working tree) into dist/NAME-VERSION/."""
    out = ROOT / "dist" / f"{dist}-{version}"
    shutil.rmtree(out, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "archive", tag, f"packages/{dist}"], cwd=ROOT, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        subprocess.run(
            [sys.executable, "-m", "hatchling", "build", "-d", str(out)],
            cwd=Path(tmp, "packages", dist),
            check=True,
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("dist", help="distribution name, e.g. apex-optim")
    p.add_argument("version", help="X.Y.Z")
    p.add_argument("--date", default=dt.date.today().isoformat())
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--no-build", action="store_true", help="commit and tag only")
    args = p.parse_args()

    pkg = ROOT / "packages" / args.dist
    if not pkg.is_dir():
        raise SystemExit(f"no package {args.dist} under packages/")
    if not VERSION_RE.match(args.version):
        raise SystemExit(f"version {args.version!r} is not X.Y.Z")
    tag = f"{args.dist}/v{args.version}"
    if git("tag", "--list", tag):
        raise SystemExit(f"tag {tag} exists already")
    dirty = git("status", "--porcelain", "--", str(pkg))
    if dirty:
        raise SystemExit(f"{args.dist} has uncommitted changes:\n{dirty}")

    vfile = version_file(pkg)
    new_version = re.sub(
        r'__version__ = "[^"]*"', f'__version__ = "{args.version}"', vfile.read_text()
    )
    changelog = pkg / "CHANGELOG.md"
    new_changelog = bumped_changelog(changelog.read_text(), args.version, args.date)
    if args.dry_run:
        print(f"would set {vfile.relative_to(ROOT)} to {args.version}, date the changelog "
              f"{args.date}, commit, tag {tag}" + ("" if args.no_build else ", build"))  # fmt: skip
        return 0
    vfile.write_text(new_version)
    changelog.write_text(new_changelog)
    files = [str(vfile.relative_to(ROOT)), str(changelog.relative_to(ROOT))]
    git("add", *files)
    git("commit", "-q", "-m", f"{args.dist} {args.version}", "--", *files)
    git("tag", "-a", tag, "-m", f"{args.dist} {args.version}")
    print(f"tagged {tag} at {git('rev-parse', '--short', 'HEAD')}")
    if not args.no_build:
        out = build(args.dist, args.version, tag)
        print(f"built {', '.join(sorted(p.name for p in out.iterdir()))} in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
