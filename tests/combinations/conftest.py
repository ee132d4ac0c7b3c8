"""The combination tier: tests marked ``combinations`` (the whole covering array) run
only when the marker expression asks for them (``make test-combinations``:
``-m combinations``); ``make test`` and ``make test-fast`` leave them out (the marker is
registered in pyproject.toml)."""


def pytest_collection_modifyitems(config, items):
    if "combinations" in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if item.get_closest_marker("combinations") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
