"""Job state in SQL: schema, dialect differences, engines and migrations."""
