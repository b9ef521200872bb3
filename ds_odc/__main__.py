"""Command line of ds_odc.

    python -m ds_odc report [--json]    versions, transports and compiled operators of this environment
    python -m ds_odc timeline TRACE... -o timeline.png
                                        draw the busy/idle timeline of traces the "timeline" option wrote
"""
import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_odc", description=__doc__.strip().splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser("report", help="versions, transports and compiled operators of this environment")
    report.add_argument("--json", action="store_true", help="machine-readable output")
    timeline = commands.add_parser("timeline", help="draw the busy/idle timeline of traces the \"timeline\" option "
                                                    "wrote (one panel per trace, on a shared time axis)")
    timeline.add_argument("traces", nargs="+", metavar="TRACE", help="a trace file (JSON)")
    timeline.add_argument("-o", "--output", required=True, help="the PNG to write")
    timeline.add_argument("--title", default="", help="a title above the panels")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "report":
        from ds_odc.report import main as report_main

        return report_main(["--json"] if args.json else [])
    if args.command == "timeline":
        return _timeline(args.traces, args.output, args.title)
    return 2


def _timeline(traces, output: str, title: str) -> int:
    from ds_odc.errors import ODCError
    from ds_odc.metrics.plot import plot_timelines
    from ds_odc.metrics.trace import read_trace

    runs = {}
    try:
        for path in traces:
            label, reports = read_trace(path)
            while label in runs:  # two traces of one label (two ODC runs): told apart by their file
                label = f"{label} ({path})"
            runs[label] = reports
        plot_timelines(runs, output, title)
    except (OSError, ValueError, ODCError) as error:
        print(f"python -m ds_odc timeline: {error}", file=sys.stderr)
        return 1
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
