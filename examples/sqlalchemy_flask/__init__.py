"""An order endpoint on Flask and SQLAlchemy whose message commits with the order (docs/sqlalchemy.md)."""
