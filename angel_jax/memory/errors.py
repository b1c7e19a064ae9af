"""Errors of the page store. Every one names the page, tier and (for the disk) the file it is about."""

from __future__ import annotations

from angel_jax.errors import AngelError


class PageStoreError(AngelError):
    """Base class: a page-store operation that cannot be done. The store's state is unchanged by a refused
    operation (a raise at issue time) and rolled back by a failed one (a raise from `PageHandle.wait`)."""


class BudgetExceeded(PageStoreError):
    """A page would push a tier past its byte budget. Raised before anything is allocated or written."""


class PagePinned(PageStoreError):
    """An eviction asked for a page that is pinned (in use by a running stage)."""


class DiskTierError(PageStoreError):
    """The disk tier cannot do its job: its directory is missing, not writable, read-only or full, or an I/O
    call failed. The message names the directory or chunk file and the page."""


class PageCorrupted(DiskTierError):
    """A page read back from disk does not match the checksum stored with it (or its chunk file is gone)."""
