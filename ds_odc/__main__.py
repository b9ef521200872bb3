"""Command line of ds_odc.

    python -m ds_odc --version          prints ``ds_odc <version>``
    python -m ds_odc report [--json] [--version]
                                        versions, transports and compiled operators of this environment; exits 1
                                        when a release is outside its tested range or a setting would be refused
                                        (ds_odc.report says which rows count)
    python -m ds_odc check DS_CONFIG [--json] [--device cpu|cuda] [--nodes N] [--ranks-per-node M]
                                     [--gradient-accumulation-steps N]
                                        validate a ds_config offline: its canonical "odc" block, the loss rule,
                                        what initialize would refuse, warnings; exits 0 valid, 1 refused, 2 when
                                        the file cannot be read (docs/check.md)
    python -m ds_odc timeline TRACE... -o timeline.png
                                        draw the busy/idle timeline of traces the "timeline" option wrote

Output piped into a reader that stops early (``| head``) ends the command quietly, with status 141 (as a
process killed by SIGPIPE), never a traceback.
"""
import argparse
import os
import signal
import sys

import ds_odc

VERSION = f"ds_odc {ds_odc.__version__}"
#: the status of a command whose reader closed the pipe: what a shell reports for a process killed by SIGPIPE
BROKEN_PIPE = 128 + signal.SIGPIPE


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_odc", description=__doc__.strip().splitlines()[0])
    parser.add_argument("--version", action="version", version=VERSION)
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser("report", help="versions, transports and compiled operators of this environment")
    report.add_argument("--json", action="store_true", help="machine-readable output")
    report.add_argument("--version", action="version", version=VERSION)
    check = commands.add_parser("check", help="validate a ds_config offline: the canonical odc block, the loss rule, "
                                              "what initialize would refuse, warnings")
    from ds_odc.check import add_arguments

    add_arguments(check)
    timeline = commands.add_parser("timeline", help="draw the busy/idle timeline of traces the \"timeline\" option "
                                                    "wrote (one panel per trace, on a shared time axis)")
    timeline.add_argument("traces", nargs="+", metavar="TRACE", help="a trace file (JSON)")
    timeline.add_argument("-o", "--output", required=True, help="the PNG to write")
    timeline.add_argument("--title", default="", help="a title above the panels")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "report":
        from ds_odc.report import main as report_main

        return report_main(["--json"] if args.json else [])
    if args.command == "check":
        from ds_odc.check import main as check_main

        return check_main(args)
    if args.command == "timeline":
        return _timeline(args.traces, args.output, args.title)
    return 2


def run(argv=None) -> int:
    """:func:`main`, ending quietly when stdout's reader has gone (``| head``): the standard handling of
    BrokenPipeError (flush; point stdout at devnull so the flush at exit cannot raise again; exit)."""
    try:
        try:
            return main(argv)
        finally:
            sys.stdout.flush()  # also after argparse's SystemExit (--help, --version)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE


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
    sys.exit(run())
