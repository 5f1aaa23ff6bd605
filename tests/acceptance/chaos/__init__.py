"""The chaos harness: real worker and relay processes, outages through TCP proxies, and a ledger.

``scenario.run`` sends orders through ``OutboxBroker`` in transactions (some rolled back on
purpose) while an idempotent actor, run by ``dramatiq`` worker processes, writes one effect row
per order; workers and relays are SIGKILLed at seeded random points and the connections to
Postgres and RabbitMQ are cut through proxies the test owns.  ``ledger.tally`` then says, order
by order, whether anything was lost, doubled, done for a rolled-back order, or left stuck.

Modules: ``app`` (the worker processes' Dramatiq app), ``fleet`` (process management),
``proxies`` (a proxy in front of each server, and the URLs through them), ``ledger`` (the
verdict) and ``scenario`` (producer, chaos schedule, drain).
"""

#: The actor the workers run and the producer sends to (declared on both sides by this name).
ACTOR_NAME = "chaos_effect"
