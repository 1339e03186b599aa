"""The scheduler's persistence: SQLite (a file, or :memory:), the only package that imports sqlite3."""
