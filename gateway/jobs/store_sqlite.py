"""The job store in one SQLite file: the default, shared by the gateways of one machine.

WAL mode, so readers never wait on the writer; every write is a ``BEGIN IMMEDIATE`` transaction, which takes the
file's one write lock before reading anything, so two processes' claims serialise and never hand one job to both.
A writer waits up to ``busy_timeout_s`` for the lock, then the call raises StoreUnavailable. Each store holds one
connection (aiosqlite: its own thread) that an asyncio.Lock gives to one transaction at a time.
"""
from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import aiosqlite

from gateway.jobs.store import StoreUnavailable
from gateway.jobs.store_sql import SCHEMA, SqlJobStore

BUSY_TIMEOUT_S = 10.0
TYPES = {"seq": "INTEGER PRIMARY KEY AUTOINCREMENT", "blob": "BLOB", "real": "REAL", "bool": "BOOLEAN"}


def _unavailable(e: BaseException) -> bool:
    """The database failing (locked past the timeout, I/O error, not a database, gone), as opposed to a bug in a
    statement (ProgrammingError, IntegrityError), which should surface as itself."""
    return isinstance(e, (sqlite3.OperationalError, sqlite3.InternalError, OSError)) or type(e) is sqlite3.DatabaseError


async def _run(conn: aiosqlite.Connection, sql: str) -> None:
    async with conn.execute(sql):
        pass


class _Tx:
    def __init__(self, conn: aiosqlite.Connection) -> None:
        self._conn = conn

    async def fetch(self, sql: str, params: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
        return list(await self._conn.execute_fetchall(sql, params))

    async def execute(self, sql: str, params: Mapping[str, Any]) -> int:
        async with self._conn.execute(sql, params) as cursor:
            return cursor.rowcount


class SqliteJobStore(SqlJobStore):
    def __init__(self, path: Path | str, busy_timeout_s: float = BUSY_TIMEOUT_S) -> None:
        self.path = Path(path)
        self.url_for_logs = f"sqlite://{self.path}" if self.path.is_absolute() else str(self.path)
        self._busy_timeout_s = busy_timeout_s
        self._conn: aiosqlite.Connection | None = None
        self._lock = asyncio.Lock()

    async def connect(self) -> None:
        if self._conn is not None:
            return
        conn: aiosqlite.Connection | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # isolation_level None: no implicit transactions; each call opens its own (BEGIN / BEGIN IMMEDIATE).
            # timeout: SQLite's busy timeout, how long a statement waits for another process's lock.
            conn = await aiosqlite.connect(self.path, isolation_level=None, timeout=self._busy_timeout_s)
            conn.row_factory = sqlite3.Row
            mode = await _wal(conn, self._busy_timeout_s)
            if str(mode).lower() != "wal":
                raise StoreUnavailable(f"{self.url_for_logs}: SQLite would not use WAL mode (it kept {mode!r})")
            await _run(conn, "PRAGMA synchronous = FULL")  # an accepted job survives a power loss
            # One starter creates the schema, the others wait for the lock and find it. In the script itself:
            # executescript commits any transaction open before it.
            await conn.executescript(f"BEGIN IMMEDIATE; {SCHEMA.format(**TYPES)} COMMIT;")
        except BaseException as e:
            if conn is not None:
                with suppress(Exception):
                    await conn.close()
            if _unavailable(e):
                raise StoreUnavailable(f"{self.url_for_logs}: {e}") from e
            raise
        self._conn = conn

    async def close(self) -> None:
        async with self._lock:
            if self._conn is not None:
                conn, self._conn = self._conn, None
                with suppress(Exception):
                    await conn.close()

    @asynccontextmanager
    async def _tx(self, write: bool) -> AsyncIterator[_Tx]:
        async with self._lock:
            conn = self._conn
            if conn is None:
                raise StoreUnavailable(f"{self.url_for_logs}: the job store is not connected")
            try:
                if conn.in_transaction:  # left open by a call cancelled mid-way
                    await _run(conn, "ROLLBACK")
                # A read is a transaction too, so its statements see one snapshot.
                await _run(conn, "BEGIN IMMEDIATE" if write else "BEGIN")
                yield _Tx(conn)
                await _run(conn, "COMMIT")
            except BaseException as e:
                # Always, and through the connection's queue: a cancelled call's BEGIN may still be waiting for the
                # lock in aiosqlite's thread and open its transaction later; this ROLLBACK runs after it either way
                # ("no transaction is active" otherwise), shielded so a second cancel cannot skip it.
                with suppress(Exception):
                    await asyncio.shield(_run(conn, "ROLLBACK"))
                if _unavailable(e):
                    raise StoreUnavailable(f"{self.url_for_logs}: {e}") from e
                raise


async def _wal(conn: aiosqlite.Connection, within: float) -> str:
    """Switch the file to WAL (it stays so: later openers find it set). The switch needs the file to itself, and
    SQLite answers "database is locked" at once rather than through the busy timeout while another process opens or
    writes it (several gateways starting together): tried again, for at most ``within`` seconds."""
    deadline = time.monotonic() + within
    delay = 0.01
    while True:
        try:
            current = (await conn.execute_fetchall("PRAGMA journal_mode"))[0][0]
            if str(current).lower() == "wal":
                return str(current)
            return str((await conn.execute_fetchall("PRAGMA journal_mode = WAL"))[0][0])
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() + delay > deadline:
                raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)
