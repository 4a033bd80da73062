"""The gateway's scheduler: a pure state machine, ``Scheduler.handle(event) -> list[Action]``.

Import each name from the module that defines it (this package re-exports nothing):

- ``types``: what goes in and out: the events, the actions, SchedulerConfig, the snapshots and counters;
- ``core``: ``Scheduler``, the policy, readable top to bottom;
- read by ``core`` only: ``fairness`` (the share of both stages between tenants: a start-time fair queue per stage),
  ``placement`` (the LoRA placement's denoise pass), ``capability`` (which denoisers may run which jobs, by what each
  can do), ``arrival`` (whether an arriving request is admitted), ``records`` (a request and its outputs),
  ``containers`` (the tuned queues), ``pool`` (the workers, and the choice of a free one) and ``speed`` (the CPython
  speed tricks, and what each buys).
"""
