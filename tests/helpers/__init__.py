"""Helpers shared by tests in several directories: strategy builders, compiled trainers, eager references."""
