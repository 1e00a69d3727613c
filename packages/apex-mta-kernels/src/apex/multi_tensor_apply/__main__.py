"""``python -m apex.multi_tensor_apply`` [report | build --archs '8.0;9.0' [--into-package] | clean]."""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m apex.multi_tensor_apply")
    sub = parser.add_subparsers(dest="cmd")
    sub.add_parser("report", help="print the environment report (default)")
    b = sub.add_parser("build", help="compile every kernel of every installed apex package")
    b.add_argument("--archs", required=True, help="CUDA archs, e.g. '8.0;9.0'")
    b.add_argument(
        "--into-package",
        action="store_true",
        help="also copy each library into its package (for a platform wheel)",
    )
    sub.add_parser("clean", help="remove libraries copied into the packages by --into-package")
    args = parser.parse_args(argv)

    if args.cmd in (None, "report"):
        from .build.report import report

        return report()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from .build import aot

    if args.cmd == "build":
        try:
            libs = aot.build(args.archs, into_package=args.into_package)
        except Exception as exc:  # noqa: BLE001 - one clear line, then fail
            print(f"apex: ahead-of-time build failed: {exc}", file=sys.stderr)
            return 1
        for lib in libs:
            print(lib)
        return 0
    aot.clean_package()
    return 0


if __name__ == "__main__":
    sys.exit(main())
