"""``manage.py rundramatiq_reliable``: Dramatiq workers on the settings' broker, and the outbox relay.

One command for a Django deployment: it finds the actor modules (``<app>.tasks`` of every
installed app, ``DRAMATIQ_RELIABLE["TASKS_MODULE"]``), starts ``dramatiq`` on them in a child
process, and with the ``outbox`` broker runs the relay in this process until the workers exit
or the command receives SIGINT/SIGTERM (passed on to the workers).  Run several of them: relays
and workers share the work safely.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
from typing import Any

from django.apps import apps
from django.conf import settings as django_settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

__all__: list[str] = []


def task_modules(module: str) -> list[str]:
    """``<app>.<module>`` of every installed app that has one, in ``INSTALLED_APPS`` order."""
    found = []
    for config in apps.get_app_configs():
        name = f"{config.name}.{module}"
        try:
            if importlib.util.find_spec(name) is not None:
                found.append(name)
        except ModuleNotFoundError:
            continue
    return found


class Command(BaseCommand):  # type: ignore[misc]  # Django ships no type hints
    help = "Start Dramatiq workers on the DRAMATIQ_RELIABLE broker (and the outbox relay)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--processes", "-p", type=int, default=None, help="worker processes (dramatiq's default)")
        parser.add_argument("--threads", "-t", type=int, default=None, help="threads per process (dramatiq's default)")
        parser.add_argument("--queues", "-Q", nargs="*", default=None, help="consume only these queues")
        parser.add_argument("--no-relay", action="store_true", help="do not run the outbox relay here")
        parser.add_argument("--relay-only", action="store_true", help="run only the outbox relay, no workers")
        parser.add_argument(
            "--dry-run", action="store_true", help="print the worker command and whether a relay runs, then exit"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        from ..._settings import reliable_settings

        config = reliable_settings()
        for name in ("processes", "threads"):
            value = options[name]
            if value is not None and value < 1:
                raise CommandError(f"--{name} must be 1 or more, got {value!r}")
        if options["no_relay"] and options["relay_only"]:
            raise CommandError("--no-relay and --relay-only exclude each other; pass one of them")
        relay = config.broker == "outbox" and not options["no_relay"]
        if options["relay_only"] and not relay:
            raise CommandError(
                "--relay-only needs DRAMATIQ_RELIABLE['BROKER'] = 'outbox' (the postgres broker has none)"
            )
        modules = task_modules(config.tasks_module)
        command = [sys.executable, "-m", "dramatiq", "dramatiq_reliable.django._worker", *modules]
        for name in ("processes", "threads"):
            if options[name] is not None:
                command += [f"--{name}", str(options[name])]
        if options["queues"]:
            command += ["--queues", *options["queues"]]
        if options["dry_run"]:
            self.stdout.write(" ".join(command[1:]) if not options["relay_only"] else "(no workers)")
            self.stdout.write(f"relay: {'yes' if relay else 'no'}")
            return
        if not modules and not options["relay_only"]:
            self.stderr.write(
                f"no installed app has a {config.tasks_module!r} module; workers start with no actors "
                "(set DRAMATIQ_RELIABLE['TASKS_MODULE'])"
            )
        environ = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": os.environ.get("DJANGO_SETTINGS_MODULE") or django_settings.SETTINGS_MODULE,
        }
        workers = None if options["relay_only"] else subprocess.Popen(command, env=environ)
        sys.exit(self._supervise(workers, relay, config))

    def _supervise(self, workers: subprocess.Popen[bytes] | None, relay: bool, config: Any) -> int:
        """Run the relay (if any) until the workers exit or a signal arrives; the workers' exit code."""
        from ....outbox import Relay
        from ..._settings import get_broker

        running = Relay.from_broker(get_broker(), **dict(config.relay_options)) if relay else None
        stop = threading.Event()

        def on_signal(signum: int, frame: Any) -> None:
            stop.set()
            if running is not None:
                running.stop()
            if workers is not None and workers.poll() is None:
                workers.send_signal(signum)

        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, on_signal)
        if workers is not None:
            # The workers ending (a crash, a signal sent to them) ends the relay too.
            def watch() -> None:
                workers.wait()
                stop.set()
                if running is not None:
                    running.stop()

            watcher = threading.Thread(target=watch, name="workers-watcher", daemon=True)
            watcher.start()
        if running is not None:
            running.run()
        else:
            stop.wait()
        return 0 if workers is None else workers.wait()
