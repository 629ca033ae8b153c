"""No Django models: Conveyor's tables are its own (Alembic, in its own schema). The module
exists so that Django sends this app ``post_migrate``, which brings them up to date."""
