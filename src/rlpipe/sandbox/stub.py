"""The unprivileged interpreter inside the sandbox: wait for one request, apply its limits, run it once.

bootstrap.py execs `python -I -S -B -u -X utf8 -c <this source>` as the leased uid in the sandbox's
workdir. The stub imports what it needs first and then blocks on stdin, so a warm-pool sandbox has paid
every start-up cost before a request exists. Stdlib only: no site-packages are visible (-S).

Protocol on stdin: a line with the byte length of a JSON header, the header
{"code": str, "rlimits": {"RLIMIT_CPU": [soft, hard], ...}}, then the program's own stdin.
fd 3 receives one byte before any of the code runs (b"S": it does not compile, b"R": it runs) and is then
closed, so the code itself can never write a forged report.
"""

import json
import os
import resource
import sys
import traceback
import types

HEADER_LENGTH_DIGITS = 20
REPORT_FD = 3


def read_exactly(count: int) -> bytes:
    """Read count bytes from fd 0 without buffering, so sys.stdin later starts at the program's input."""
    chunks, remaining = [], count
    while remaining:
        chunk = os.read(0, remaining)
        if not chunk:
            raise EOFError(f"stdin closed {remaining} bytes before the end of the request header")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def read_header() -> dict:
    """The request header; its length line is read byte by byte for the same reason as read_exactly."""
    digits = b""
    while not digits.endswith(b"\n"):
        digits += read_exactly(1)
        if len(digits) > HEADER_LENGTH_DIGITS:
            raise ValueError("malformed request: header length line too long")
    return json.loads(read_exactly(int(digits)))


def main() -> None:
    header = read_header()
    for name, (soft, hard) in header["rlimits"].items():  # 1) limits first: all later work is bounded
        resource.setrlimit(getattr(resource, name), (soft, hard))
    code = header["code"]
    with open("main.py", "w", encoding="utf-8") as source:  # so tracebacks can quote source lines
        source.write(code)
    try:
        compiled = compile(code, "main.py", "exec")
    except (SyntaxError, ValueError) as exc:  # ValueError: 3.11 rejects null bytes in source this way
        os.write(REPORT_FD, b"S")
        traceback.print_exception(type(exc), exc, None)  # as the interpreter prints it: no stub frames
        sys.exit(1)
    os.write(REPORT_FD, b"R")
    os.close(REPORT_FD)
    module = types.ModuleType("__main__")  # a fresh __main__, as if run as `python main.py`
    module.__file__ = "main.py"
    sys.modules["__main__"] = module
    sys.argv = ["main.py"]
    sys.path.insert(0, os.getcwd())  # like `python main.py`: files the code writes next to it import
    try:
        exec(compiled, module.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:  # print like the interpreter would, minus this frame
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next if exc.__traceback__ else None)
        sys.exit(1)


main()
