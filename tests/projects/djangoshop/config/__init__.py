"""The shop's settings package: named ``config``, as Conveyor's own deployment's is."""
