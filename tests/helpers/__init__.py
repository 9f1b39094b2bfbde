"""Helpers shared by test modules (tests/ is on sys.path: `from helpers.cli import ...`)."""
