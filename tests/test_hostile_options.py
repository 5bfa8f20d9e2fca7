"""Hostile option values, datasets and servers (issue #38): each is one line naming the option (or file) and the
bad value, exit status 2, no traceback; nothing hangs (a FIFO runs in a subprocess with a timeout, so that a
regression fails instead of blocking the suite) and nothing empty passes for the default."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from cli_checks import assert_one_line, run_cli

from kvwall.cli import main
from kvwall.errors import KvwallError
from kvwall.units import ascii_digits
from kvwall.workload import Lengths, load_dataset, parse_lengths

SIM = ["simulate", "llama-3.2-1b", "--device", "h100", "--rate", "1", "--requests", "2"]


def run(argv, capsys):
    rc, _, err = run_cli(argv, capsys)
    return rc, err


# -- 1. digits that are not 0-9, numbers that are not numbers -----------------------------------------------------

def test_only_ascii_digits_are_digits():
    assert ascii_digits("0123456789")
    for text in ("²", "1²", "٣", "１", "", " 1", "1_000", "-1", "+1"):  # '²' and '٣' pass str.isdigit
        assert not ascii_digits(text), text


@pytest.mark.parametrize("argv, names", [
    (["roofline", "llama-3.2-1b", "--batch", "1,²"], ["batch", "1,²"]),
    (["memory", "llama-3.2-1b", "--kv-format", "int4:g²"], ["--kv-format", "int4:g²"]),
    (["memory", "llama-3.2-1b", "--weight-format", "int4:g٣"], ["--weight-format", "int4:g٣"]),
    (["memory", "llama-3.2-1b", "--batch", "٣"], ["--batch", "٣"]),  # int() would read it as 3
    ([*SIM, "--prompt-tokens", "²"], ["--prompt-tokens", "²"]),
    ([*SIM, "--prompt-tokens", "lognormal:mean=.,sd=0.5"], ["--prompt-tokens", "lognormal:mean=.,sd=0.5"]),
    ([*SIM, "--output-tokens", "uniform:min=1.2.3,max=5"], ["--output-tokens", "uniform:min=1.2.3,max=5"]),
    ([*SIM, "--prompt-tokens", "9" * 30], ["--prompt-tokens", "2,147,483,648"]),
    ([*SIM, "--prompt-tokens", "uniform:min=1,max=" + "9" * 400], ["--prompt-tokens", "2,147,483,648"]),
    (["roofline", "llama-3.2-1b", "--batch", "1," + "9" * 5000], ["batch"]),  # int() refuses past 4,300 digits
])
def test_bad_numbers_are_one_line(argv, names, capsys):
    assert_one_line(*run(argv, capsys), *names)


def test_lengths_take_every_decimal_float_reads():
    assert parse_lengths("lognormal:mean=512.,sd=.5") == Lengths("lognormal", 512, 0.5)
    assert parse_lengths("uniform:min=64.0,max=128") == Lengths("uniform", 64, 128)
    for bad in ("lognormal:mean=..,sd=1", "uniform:min=1.2.3,max=9", "lognormal:mean=512,sd=0.5.", "٣"):
        with pytest.raises(KvwallError, match="bad token length"):
            parse_lengths(bad)


# -- 2. a dataset that never ends, a rate that never arrives, a server that says no --------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("argv", [
    ["simulate", "llama-3.2-1b", "--device", "h100", "--rate", "1"],
    ["loadtest", "http://127.0.0.1:9", "--model", "m", "--rate", "1"],
])
def test_a_fifo_dataset_is_refused_not_waited_on(tmp_path, argv):
    fifo = tmp_path / "d.jsonl"
    os.mkfifo(fifo)
    out = subprocess.run([sys.executable, "-m", "kvwall", *argv, "--dataset", str(fifo)], capture_output=True,
                         text=True, timeout=60)
    assert_one_line(out.returncode, out.stderr, "--dataset", str(fifo), "not a regular file")


def test_a_folder_dataset_is_refused(tmp_path, capsys):
    assert_one_line(*run([*SIM, "--dataset", tmp_path], capsys), "--dataset", str(tmp_path), "is a directory")


@pytest.mark.parametrize("argv, names", [
    (["--rate", "1e-6"], ["--rate 1e-06", "31,000,000 s", "0.00833/s"]),  # 31 gaps of 1e6 s; 1 / 120 s
    (["--sweep", "rate=1,0.001", "--timeout", "100s"], ["--sweep rate 0.001", "31,000 s", "0.01/s"]),
])
def test_loadtest_refuses_a_rate_slower_than_its_timeout(argv, names, capsys):
    """No server at all: the rate is refused before anything is sent."""
    assert_one_line(*run(["loadtest", "http://127.0.0.1:9", "--model", "m", *argv], capsys), *names)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_loadtest_stops_when_nothing_listens(capsys):
    """5 requests at 0.01/s would take ~400 s of arrivals; the first refused connection ends the run."""
    start = time.monotonic()
    rc, err = run(["loadtest", f"http://127.0.0.1:{_closed_port()}", "--model", "m", "--rate", "0.01", "--timeout",
                   "200s", "--requests", "5"], capsys)
    assert time.monotonic() - start < 30
    assert_one_line(rc, err, "refused a request before any completed", "ConnectError", "stopped after sending 1 of 5")


class _Server:
    """A stand-in server on a free loopback port: answers each POST with statuses[k] (the last one repeated);
    200 streams one text chunk. Stopped by the test."""

    def __init__(self, statuses):
        self.statuses, self.seen = statuses, 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                status = outer.statuses[min(outer.seen, len(outer.statuses) - 1)]
                outer.seen += 1
                body = (b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n' if status == 200
                        else b"no such model\n  (or busy)")  # a body of two lines: the error keeps one
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


def test_loadtest_stops_at_a_refusal_before_any_success(capsys):
    with _Server([404]) as srv:
        start = time.monotonic()
        rc, err = run(["loadtest", srv.url, "--model", "nope", "--rate", "0.01", "--timeout", "200s", "--requests",
                       "5"], capsys)
    assert time.monotonic() - start < 30 and srv.seen == 1
    assert_one_line(rc, err, "HTTP 404", "no such model (or busy)", "stopped after sending 1 of 5", "'nope'")


@pytest.mark.slow
def test_loadtest_counts_load_errors_and_later_refusals(capsys):
    """503 is load, not a refusal: all 3 are sent. A 400 after a served request is counted, not fatal."""
    with _Server([503]) as srv:
        rc, err = run(["loadtest", srv.url, "--model", "m", "--concurrency", "1", "--requests", "3"], capsys)
    assert srv.seen == 3
    assert_one_line(rc, err, "no request to", "HTTP 503")
    with _Server([200, 400]) as srv:
        rc = main(["loadtest", srv.url, "--model", "m", "--concurrency", "1", "--requests", "3", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and srv.seen == 3 and (d["completed"], d["errors"]) == (1, 2)
    assert [s["refused"] for s in d["samples"]] == [False, True, True]


# -- 3. an empty value is not the default ------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("argv, option", [
    (["quality", "smollm2-135m", "--cache", ""], "--cache"),
    (["quality", "smollm2-135m", "--text", " "], "--text"),
    (["bench", "--cache", ""], "--cache"),
    (["memory", "llama-3.2-1b", "--kv-format", ""], "--kv-format"),
    (["memory", "llama-3.2-1b", "--device", ""], "--device"),
    (["fit", "llama-3.2-1b", "--memory", ""], "--memory"),
    (["fit", "llama-3.2-1b", "--context", ""], "--context"),
    (["compare", "llama-3.2-1b", "--device", "  "], "--device"),
    (["roofline", "llama-3.2-1b", "--context", ""], "--context"),
    (["speed", "llama-3.2-1b", "--device", ""], "--device"),
    (["validate", "--engine", ""], "--engine"),
    ([*SIM, "--dataset", ""], "--dataset"),
    ([*SIM, "--plot", ""], "--plot"),
    (["simulate", "llama-3.2-1b", "--sweep", ""], "--sweep"),
    ([*SIM, "--sweep", "tp=,"], "--sweep 'tp=,'"),
    (["loadtest", "http://127.0.0.1:9", "--model", "", "--rate", "1"], "--model"),
    (["loadtest", "http://127.0.0.1:9", "--model", "m", "--rate", "1", "--dataset", ""], "--dataset"),
])
def test_an_empty_option_is_an_error(argv, option, capsys):
    rc, err = run(argv, capsys)
    assert_one_line(rc, err, option)
    assert "empty" in err or "at least one value" in err


def test_a_required_option_is_not_told_of_a_default(capsys):
    _, err = run(["loadtest", "http://127.0.0.1:9", "--model", "", "--rate", "1"], capsys)
    assert "default" not in err
    _, err = run(["memory", "llama-3.2-1b", "--device", ""], capsys)
    assert "leave the option out for its default" in err


@pytest.mark.parametrize("argv, names", [  # lists of only commas were errors already: they stay so
    (["compare", "llama-3.2-1b", "--context", ","], ["context", "','"]),
    (["roofline", "llama-3.2-1b", "--batch", ",,"], ["batch", "',,'"]),
    (["quality", "smollm2-135m", "--passkey-lengths", ","], ["pass-key length", "','"]),
])
def test_a_list_of_only_commas_is_an_error(argv, names, capsys):
    assert_one_line(*run(argv, capsys), *names)


# -- 4. an empty prompt in a simulate dataset --------------------------------------------------------------------

def test_an_empty_prompt_in_a_dataset_is_refused(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "x" * 8, "output_tokens": 2}) + "\n"
                    + json.dumps({"prompt": "", "output_tokens": 2}) + "\n")
    assert_one_line(*run([*SIM, "--dataset", path], capsys), str(path), "line 2", "prompt must be a non-empty string")
    path.write_text(json.dumps({"prompt": "", "prompt_tokens": 5, "output_tokens": 2}) + "\n")
    with pytest.raises(KvwallError, match="line 1: prompt must be"):
        load_dataset(path)
    path.write_text(json.dumps({"prompt": None, "prompt_tokens": 5, "output_tokens": 2}) + "\n")
    assert [r.prompt_tokens for r in load_dataset(path)] == [5]  # no prompt text: prompt_tokens alone
