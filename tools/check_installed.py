"""Assert which apex packages an environment has: used by the isolated nox sessions.

    python tools/check_installed.py --present apex.optimizers --absent apex.amp=apex-amp ...
    python tools/check_installed.py --version apex-optim=0.1.0 ...

Each --present module must import from an installed wheel (site-packages, not a src/ folder);
each --absent module's distribution must not be installed, and importing the module must raise
an ImportError that names that distribution; each --version distribution must be installed at
exactly that version.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--present", nargs="*", default=[], metavar="MODULE")
    parser.add_argument("--absent", nargs="*", default=[], metavar="MODULE=DIST")
    parser.add_argument("--version", nargs="*", default=[], metavar="DIST=X.Y.Z")
    args = parser.parse_args(argv)
    problems = []
    for name in args.present:
        module = importlib.import_module(name)
        where = module.__file__ or ""
        if "site-packages" not in where:
            problems.append(f"{name} comes from {where}, not from an installed wheel")
        print(f"present: {name} from {where}")
    for item in args.absent:
        name, _, dist = item.partition("=")
        try:
            importlib.metadata.distribution(dist)
            problems.append(f"{dist} is installed")
        except importlib.metadata.PackageNotFoundError:
            pass
        try:
            importlib.import_module(name)
            problems.append(f"{name} imported, but {dist} is not installed")
        except ImportError as exc:
            if dist not in str(exc):
                problems.append(f"the ImportError of {name} does not name {dist}: {exc}")
            else:
                print(f"absent: {name} -> ImportError naming {dist}")
    for item in args.version:
        dist, _, wanted = item.partition("=")
        try:
            have = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have != wanted:
            problems.append(f"{dist} is {have or 'not installed'}, expected {wanted}")
        else:
            print(f"version: {dist} {have}")
    for problem in problems:
        print(f"ERROR {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
