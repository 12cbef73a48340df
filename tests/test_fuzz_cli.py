"""Property-based fuzzing of the ``specbuild`` command line: every subcommand with random
subsets of its flags, each given a well-formed or a garbage value, plus stray arguments.

Whatever the arguments, ``specbuild`` exits 0 or 2 and, on 2, its last line on stderr is one
``specbuild...: error: ...`` line; never a traceback. Commands that would load models, train,
build or start a server get a cheap fatal input they cannot get past (a model path, deployment
or spec that does not exist, a server URL nobody listens on), so each case costs milliseconds.
The arguments are drawn from the real parser (``builder.cli.main.build_parser``): a new flag is
fuzzed without touching this file.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builder.cli.main import build_parser, main

EXAMPLES = int(os.environ.get("SPECBUILD_FUZZ_EXAMPLES", "150"))


@pytest.fixture(scope="module")
def closed_port() -> Iterator[int]:
    """A loopback port held (bound, not listening) for the test: connecting is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def poisons(port: int) -> dict[str, list[str]]:
    """Per subcommand, arguments that make it fail before any expensive step."""
    missing = "/nonexistent/specbuild-fuzz"
    return {"run": ["--target", f"{missing}/model"], "serve": [f"{missing}/source"],
            "demo": ["--deployment", f"{missing}/deployment.json"], "build": ["--target", f"{missing}/model"],
            "bench": ["--target", f"{missing}/model", "--out", f"{missing}/out"], "distill": ["--target", f"{missing}/model"],
            "train-medusa": ["--target", f"{missing}/model"], "deploy": ["--spec", f"{missing}/spec.yaml"],
            "train-eagle": ["--target", f"{missing}/model"], "eval-eagle": ["--eagle", f"{missing}/eagle"],
            "export-eagle": ["--checkpoint", f"{missing}/checkpoint"], "eagle-data": ["--target", f"{missing}/model"],
            "eagle-features": ["--corpus", f"{missing}/corpus"], "train-eagle3": ["--features", f"{missing}/features"],
            "export-eagle3": ["--eagle", f"{missing}/eagle3"],
            "generate": ["--url", f"127.0.0.1:{port}"]}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


# no leading '/' or '~' (nothing written outside the test's folder); no NUL (argv cannot hold one)
SAFE_TEXT = st.text(st.characters(blacklist_characters="/\\~\x00", blacklist_categories=("Cs",)), max_size=12)
GARBAGE = st.sampled_from(["", "x", "-1", "0", "1.5", "nan", "inf", "-inf", "1e999", "99999999999999999999", "0-5,28",
                           "1,,2", "a-b", "5-", "auto", "-", ".", "..", "é", "--", "None", "null", "[]", "{}"])
PORTISH = st.one_of(st.integers(-5, 70000).map(str), GARBAGE)


def _value(action: argparse.Action) -> st.SearchStrategy[str]:
    if action.choices:
        return st.one_of(st.sampled_from([str(c) for c in action.choices]), GARBAGE, SAFE_TEXT)
    if action.type is int or "port" in action.dest:
        return st.one_of(st.integers(-(2**40), 2**40).map(str), PORTISH)
    if action.type is float:
        return st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), GARBAGE)
    if action.dest == "url":
        return st.sampled_from(["not a url", "http://", ":::", "127.0.0.1:0", "[::1]:x", ""])
    return st.one_of(GARBAGE, SAFE_TEXT)


def _option_args(action: argparse.Action, draw: st.DrawFn) -> list[str]:
    flag = draw(st.sampled_from(action.option_strings))
    if action.nargs == 0:  # store_true / store_const / help
        return [flag]
    if draw(st.integers(0, 9)) == 0:  # a flag without its value
        return [flag]
    return [flag, draw(_value(action))]


@st.composite
def argvs(draw: st.DrawFn, name: str, port: int) -> list[str]:
    commands = subcommands()
    poison = poisons(port).get(name, [])
    positional = poison and not poison[0].startswith("-")  # serve's source: first, so no valueless flag eats it
    actions = [a for a in commands[name]._actions
               if not isinstance(a, argparse._HelpAction) and not set(a.option_strings) & set(poison)]
    argv = [name] + (poison if positional else []) if draw(st.integers(0, 30)) else []  # sometimes no subcommand
    if draw(st.integers(0, 20)) == 0:
        argv.insert(0, draw(st.sampled_from(["-v", "--verbose", "-h", "--bogus"])))
    required = [a for a in actions if a.required and draw(st.integers(0, 9))]  # mostly given
    chosen = draw(st.lists(st.sampled_from(actions), max_size=6, unique_by=id)) if actions else []
    for action in required + [a for a in chosen if a not in required]:
        if action.option_strings:
            argv += _option_args(action, draw)
        elif not poison:  # a positional; poisoned commands keep their fatal one
            argv.append(draw(st.one_of(GARBAGE, SAFE_TEXT)))
    if draw(st.integers(0, 8)) == 0:
        argv.append(draw(st.one_of(GARBAGE, st.sampled_from(["--no-such-flag", "-Z", "extra"]))))
    if draw(st.integers(0, 30)) == 0:
        argv.append(draw(st.sampled_from(["-h", "--help"])))
    return argv if positional else argv + poison


class TooSlow(Exception):
    pass


def _too_slow(signum: int, frame: Any) -> None:
    raise TooSlow("a fuzzed command ran for over 60 s: it got past its cheap fatal input")


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    previous = signal.signal(signal.SIGALRM, _too_slow)
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, 60)
    started = time.monotonic()
    try:
        code: Any = main(argv)
    except SystemExit as exc:  # argparse (--help: 0; bad arguments: 2)
        code = exc.code
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_delay:  # give back what is left of an outer timer (pytest-timeout's)
            signal.setitimer(signal.ITIMER_REAL, max(0.001, outer_delay - (time.monotonic() - started)),
                             outer_interval)
    err = capsys.readouterr().err
    return code, err


def assert_clean_exit(argv: list[str], code: Any, err: str) -> None:
    assert "Traceback" not in err, f"{argv}: traceback on stderr:\n{err[-2000:]}"
    assert code in (0, 2, None), f"{argv}: exit code {code!r}; stderr: {err[-500:]}"
    if code == 2:
        last = err.strip().split("\n")[-1]  # (not splitlines: a path may hold \x1c-\x1e)
        assert last.startswith("specbuild") and "error:" in last, f"{argv}: last stderr line {last!r}"
        assert len(last) < 2000


@pytest.mark.parametrize("command", sorted(subcommands()))
@settings(max_examples=max(10, EXAMPLES // 4), deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_arguments_exit_0_or_2_with_a_one_line_error(command: str, data: st.DataObject, closed_port: int,
                                                           tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``max(10, EXAMPLES / 4)`` argument lists per subcommand."""
    monkeypatch.chdir(tmp_path)  # whatever a command writes (plan.json, ...) stays in the test's folder
    argv = data.draw(argvs(command, closed_port), label="argv")
    code, err = run_cli(argv, capsys)
    assert_clean_exit(argv, code, err)


@pytest.mark.parametrize("argv", [
    ["generate", "--stream", "--prompt", "hi"],  # found by the fuzz: a traceback from the gRPC stream
    ["serve", "--render-only"],  # found by the fuzz: exit status 1 and no 'error:' line
    ["generate", "--prompt", "hi", "--max-tokens", "4294967297"],  # found by the fuzz: sent as max_tokens=1
])
def test_regressions_found_by_the_fuzz(argv: list[str], closed_port: int, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    if argv[0] == "generate":
        argv = argv + ["--url", f"127.0.0.1:{closed_port}"]
    code, err = run_cli(argv, capsys)
    assert_clean_exit(argv, code, err)
    assert code == 2
    if "4294967297" in argv:  # refused before anything is sent, rather than wrapped around to 1
        assert "max_tokens=4294967297 does not fit the model's INT32 input" in err
