"""The email family, caller's side: what apps and operators call (the stage, its outbox and
providers, the worker's side, are ``tasks/email/``).

- :mod:`pipelines.email.messages`: :func:`~pipelines.email.messages.send_email` (the HTML,
  the outbox row and the job in one transaction, the caller's with ``session=``), show,
  list, and ``resolve`` for a message whose delivery is unknown;
- :mod:`pipelines.email.cli`: ``conveyor email …`` (``CLI_EXTENSIONS`` in ``config``);
- :mod:`pipelines.email.http`: ``/email/messages`` (``HTTP_EXTENSIONS`` in
  ``config/celery_app.py``);
- :mod:`pipelines.email.peers`: local SMTP and HTTP email peers for tests, ``conveyor demo``
  (:mod:`pipelines.email.demo`) and ``python -m bench.email``.
"""
