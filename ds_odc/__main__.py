"""Command line of ds_odc.

    python -m ds_odc report [--json]    versions, transports and compiled operators of this environment
"""
import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_odc", description=__doc__.strip().splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser("report", help="versions, transports and compiled operators of this environment")
    report.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "report":
        from ds_odc.report import main as report_main

        return report_main(["--json"] if args.json else [])
    return 2


if __name__ == "__main__":
    sys.exit(main())
