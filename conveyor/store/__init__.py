"""Where job state lives: the job store (every status change a compare-and-set), claims,
the event outbox, liveness records, dedup keys, and the database itself (``db``,
``migrations``)."""
