"""The operations family, the caller's side (the stages will be ``tasks/operations/``):
:mod:`pipelines.operations.peers` holds the ERP peer for the tests, ``conveyor demo`` and the
bench."""
