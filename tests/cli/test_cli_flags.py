"""Every ``paged-kv`` subcommand: a bad flag value is one line naming the flag, exit 2."""

from __future__ import annotations

import pytest

from paged_kv.cli import main

BAD_FLAGS = [
    pytest.param(["demo", "--block-size", "0"], "--block-size", id="demo-block-size-0"),
    pytest.param(["demo", "--num-requests", "0"], "--num-requests", id="demo-num-requests-0"),
    pytest.param(["demo", "--memory-mib", "0.001"], "--memory-mib", id="demo-memory-tiny"),
    pytest.param(["demo", "--memory-mib", "-1"], "--memory-mib", id="demo-memory-negative"),
    pytest.param(["demo", "--model", "/nonexistent"], "--model", id="demo-model-missing"),
    pytest.param(["demo", "--max-num-seqs", "x"], "--max-num-seqs", id="demo-not-an-int"),
    pytest.param(["serve", "--block-size", "0"], "--block-size", id="serve-block-size-0"),
    pytest.param(["serve", "--memory-mib", "0.001"], "--memory-mib", id="serve-memory-tiny"),
    pytest.param(["serve", "--model", "/nonexistent"], "--model", id="serve-model-missing"),
    pytest.param(["serve", "--api-keys", "/nonexistent"], "--api-keys", id="serve-keys-missing"),
    pytest.param(["serve", "--max-waiting", "-1"], "--max-waiting", id="serve-max-waiting"),
    pytest.param(["serve", "--arrival-hold-ms", "-1"], "--arrival-hold-ms",
                 id="serve-arrival-hold-negative"),
    pytest.param(["bench", "--threads", "0"], "--threads", id="bench-threads-0"),
]


@pytest.mark.parametrize(("argv", "flag"), BAD_FLAGS)
def test_bad_flag_is_one_line_and_exit_2(argv, flag, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert flag in err and "Traceback" not in err


def test_bad_api_keys_line_names_the_line(tmp_path, capsys):
    (tmp_path / "keys").write_text("good alice\nonly-a-key\n")
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--api-keys", str(tmp_path / "keys")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and ":2:" in err and "--api-keys" in err


@pytest.mark.parametrize("command", ["demo", "serve", "bench"])
def test_help_shows_defaults(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "(default:" in capsys.readouterr().out


def test_demo_and_serve_share_the_engine_flags(capsys):
    flags = ("--memory-mib", "--block-size", "--max-num-seqs", "--max-num-batched-tokens",
             "--preemption", "--model")
    for command in ("demo", "serve"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        assert all(flag in out for flag in flags), command


def test_no_progress_bar_when_stderr_is_not_a_terminal(capsys):
    assert main(["demo", "--num-requests", "3", "--memory-mib", "1", "--num-layers", "1",
                 "--hidden-size", "64", "--vocab-size", "256"]) == 0
    assert "\r" not in capsys.readouterr().err
