"""What a user error looks like from the command line, for the tests of bad input: kvwall run in-process, and
the one-line, exit-2, no-traceback shape every such error must have."""

from kvwall.cli import main


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """kvwall in-process: (exit status, stdout, stderr)."""
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def assert_one_line(rc: int, err: str, *names: str, most: int = 1) -> None:
    """Exit status 2, no traceback, at most `most` lines, naming each of `names`."""
    assert rc == 2, err
    assert "Traceback" not in err
    assert 1 <= len(err.strip().splitlines()) <= most, err
    for name in names:
        assert name in err, (name, err)
