"""``dramatiq-reliable web`` refuses what would not work before it starts a server (no service needed)."""

from __future__ import annotations

import pytest

from dramatiq_reliable.cli import ExitCode, main


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.5", "::", "jobs.example.com"])
def test_listening_beyond_loopback_without_an_access_hook_is_refused_with_the_fix(host, capsys):
    assert main(["web", "--host", host, "--database-url", "postgresql://nobody@127.0.0.1:1/none"]) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert f"refusing to listen on {host!r} without --access" in err
    assert "pass --access module:callable" in err


def test_an_access_hook_that_cannot_be_imported_is_a_usage_error(capsys):
    assert main(["web", "--access", "no_such_module_here:access"]) == ExitCode.USAGE
    assert "no module 'no_such_module_here' on the path" in capsys.readouterr().err
    assert main(["web", "--access", "not-a-callable"]) == ExitCode.USAGE
    assert "is not module:callable" in capsys.readouterr().err
    assert main(["web", "--access", "json:no_such_name"]) == ExitCode.USAGE
    assert "module 'json' has no 'no_such_name'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["jobs.internal:8080", "http://jobs.internal", "*"])
def test_an_allowed_host_that_is_not_a_host_name_is_a_usage_error_naming_the_option(name, capsys):
    command = ["web", "--allowed-host", "ok.internal", "--allowed-host", name]
    assert main([*command, "--database-url", "postgresql://nobody@127.0.0.1:1/none"]) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert "--allowed-host: allowed_hosts holds" in err and repr(name) in err
