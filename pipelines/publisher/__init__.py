"""Scheduled publishing, the caller's side (the stages are ``tasks/publisher/``).

- :mod:`pipelines.publisher.posts`: schedule, show, list, edit, cancel, replay and test posts;
- :mod:`pipelines.publisher.cli`: ``conveyor publisher …`` (``CLI_EXTENSIONS`` in ``config``);
- :mod:`pipelines.publisher.http`: ``/publisher/jobs`` (``HTTP_EXTENSIONS``);
- :mod:`pipelines.publisher.peers`: a Graph-like peer for tests, ``conveyor demo`` and the bench.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipelines.publisher.posts import (
        Plan,
        PostConflict,
        PostNotFound,
        Scheduled,
        cancel_post,
        check_post,
        edit_post,
        list_posts,
        replay_post,
        schedule_post,
        show_post,
    )

__all__ = [
    "Plan",
    "PostConflict",
    "PostNotFound",
    "Scheduled",
    "cancel_post",
    "check_post",
    "edit_post",
    "list_posts",
    "replay_post",
    "schedule_post",
    "show_post",
]


def __getattr__(name: str) -> Any:
    # `conveyor --help` imports pipelines.publisher.cli, hence this package: the posts
    # module (and the platform it needs) loads on first use only.
    if name in __all__:
        from pipelines.publisher import posts

        return getattr(posts, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
