"""The store layer: one checkpoint location on any fsspec filesystem.

The only code in taskpoint that talks to fsspec; every layer above reaches a store through
:class:`~taskpoint.store.store.Store` (:mod:`taskpoint.store.store` lists the layer's
modules). It imports nothing of taskpoint's but :mod:`taskpoint.errors`.

``taskpoint.store`` was one module before it became this package; the names it listed are
importable from here still.
"""

from taskpoint.store.store import RetryPolicy, Store, check_location, is_transient

__all__ = ["RetryPolicy", "Store", "check_location", "is_transient"]
