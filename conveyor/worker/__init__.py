"""The worker's side: the Celery task class and worker step, the claim, the body beside its
heartbeat, the completion transaction, and what follows a job's end (continuations,
followers, burials), shutdown and interrupts."""
