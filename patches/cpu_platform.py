"""Placeholder."""

UPSTREAM = ""


def wanted(ctx) -> bool:
    return False


def apply(ctx) -> None:
    pass
