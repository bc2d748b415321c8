import pytest
from IPython.core.error import UsageError

from nbdist.kernel.options import RunOptions, parse_run_options


def test_defaults():
    assert parse_run_options("") == RunOptions()


def test_every_flag():
    opts = parse_run_options(
        "-n 3 --framework torch --backend gloo --push a,b --pull x --out res --ranks 0,2 "
        "--timeout 7.5"
    )
    assert opts == RunOptions(
        workers=3,
        framework="torch",
        backend="gloo",
        push=("a", "b"),
        pull=("x",),
        out="res",
        ranks=(0, 2),
        timeout=7.5,
    )


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("--workrs 2", "unrecognized arguments: --workrs 2"),
        ("--work 2", "unrecognized arguments: --work 2"),
        ("-n 0", "needs at least 1 worker, got 0; try -n 2"),
        ("-n two", "expected a whole number of workers, got 'two'"),
        ("--backend mpi", "invalid choice: 'mpi'"),
        ("--framework jax", "invalid choice: 'jax'"),
        ("--push 1x", "--push takes comma-separated variable names"),
        ("--pull ,", "--pull takes comma-separated variable names"),
        ("-o 'a b'", "-o needs a variable name, got 'a b'"),
        ("--ranks -1", "expected ranks like 0 or 0,1"),
        ("--smooth strong", "--smooth: expected a number like 0.1, got 'strong'"),
        ("--smooth 0", "--smooth: must be in (0, 1], got '0'"),
        ("--timeout 0", "must be positive"),
        ("--timeout soon", "expected seconds, got 'soon'"),
        ("--push 'a", "cannot split the flags"),
        ("extra", "unrecognized arguments: extra"),
        ("--scan 2", "expected two or more different worker counts like 1,2 or 1,2,4, got '2'"),
        ("--scan 1,1", "expected two or more different worker counts"),
        ("--scan 0,1", "expected two or more different worker counts"),
        ("--scan one,two", "expected worker counts like 1,2 or 1,2,4, got 'one,two'"),
        ("-n 2 --scan 1,2", "--scan 1,2 sets the worker counts itself; drop -n."),
        ("--scan 1,2 --pull w", "--pull does not go with it"),
        ("--scan 1,2 --strategy mirrored", "--strategy mirrored does not go with it"),
    ],
)
def test_bad_flags_are_usage_errors(line, expected):
    with pytest.raises(UsageError) as info:
        parse_run_options(line)
    assert expected in str(info.value)
    assert str(info.value).startswith("%%distrain")


def test_scan():
    assert parse_run_options("--scan 1,2,4").scan == (1, 2, 4)
    assert parse_run_options("--scan 2,1").scan == (2, 1)
