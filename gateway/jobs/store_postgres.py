"""The job store in PostgreSQL: one database shared by the gateways of several machines.

A claim locks the row it takes with ``FOR UPDATE SKIP LOCKED``, so concurrent claimers each take a different job
without waiting on one another; every other write is a short READ COMMITTED transaction on a small asyncpg pool.
The schema is created at connect under a transaction-scoped advisory lock, since two gateways starting at once would
otherwise race in CREATE TABLE IF NOT EXISTS (it is not safe against a concurrent creator).
"""
from __future__ import annotations

import functools
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from gateway.jobs.store import StoreUnavailable, redact_dsn
from gateway.jobs.store_sql import SCHEMA, SqlJobStore

POOL_SIZE = 4
CONNECT_TIMEOUT_S = 10.0
COMMAND_TIMEOUT_S = 30.0  # a statement stuck longer (a hung server, a lock never released) fails the call
TYPES = {"seq": "BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY", "blob": "BYTEA", "real": "DOUBLE PRECISION",
         "bool": "BOOLEAN"}
SCHEMA_LOCK = 0x676C6D696D6A6F62  # "glmimjob": the advisory lock the schema's creators take in turn

# Errors that say the server cannot answer now, not that a statement is wrong: connection lost or refused, the
# server shutting down or out of resources, a statement timing out, a deadlock or serialisation failure.
UNAVAILABLE = (OSError, TimeoutError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError,
               asyncpg.exceptions.OperatorInterventionError, asyncpg.exceptions.InsufficientResourcesError,
               asyncpg.exceptions.TransactionRollbackError, asyncpg.exceptions.QueryCanceledError)

_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


@functools.lru_cache(maxsize=256)
def numbered(sql: str) -> tuple[str, tuple[str, ...]]:
    """``:name`` parameters as Postgres's ``$n``, and the names in order (one number per name, however often it
    is used). ``::type`` casts are left alone."""
    names: list[str] = []

    def number(m: re.Match[str]) -> str:
        if m.group(1) not in names:
            names.append(m.group(1))
        return f"${names.index(m.group(1)) + 1}"

    return _PARAM.sub(number, sql), tuple(names)


class _Tx:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn

    async def fetch(self, sql: str, params: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
        text, names = numbered(sql)
        return await self._conn.fetch(text, *(params[n] for n in names))

    async def execute(self, sql: str, params: Mapping[str, Any]) -> int:
        text, names = numbered(sql)
        status = await self._conn.execute(text, *(params[n] for n in names))  # "UPDATE 3", "INSERT 0 1"
        return int(status.rsplit(" ", 1)[-1]) if status[-1:].isdigit() else 0


class PostgresJobStore(SqlJobStore):
    skip_locked = "FOR UPDATE SKIP LOCKED"
    skip_locked_c = "FOR UPDATE OF c SKIP LOCKED"
    lock_row = "FOR UPDATE"

    def __init__(self, dsn: str, pool_size: int = POOL_SIZE, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 command_timeout_s: float = COMMAND_TIMEOUT_S) -> None:
        self._dsn = dsn
        self.url_for_logs = redact_dsn(dsn)
        self._pool_size = pool_size
        self._connect_timeout_s = connect_timeout_s
        self._command_timeout_s = command_timeout_s
        self._pool: asyncpg.Pool | None = None

    async def connect(self) -> None:
        if self._pool is not None:
            return
        try:
            pool = await asyncpg.create_pool(self._dsn, min_size=1, max_size=self._pool_size,
                                             timeout=self._connect_timeout_s,
                                             command_timeout=self._command_timeout_s)
        except UNAVAILABLE as e:
            raise StoreUnavailable(f"{self.url_for_logs}: {_describe(e)}") from e
        try:
            async with pool.acquire(timeout=self._connect_timeout_s) as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", SCHEMA_LOCK)
                await conn.execute(SCHEMA.format(**TYPES))
        except BaseException as e:
            pool.terminate()
            if isinstance(e, UNAVAILABLE):
                raise StoreUnavailable(f"{self.url_for_logs}: {_describe(e)}") from e
            raise
        self._pool = pool

    async def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            try:
                await pool.close()
            except Exception:
                pool.terminate()

    @asynccontextmanager
    async def _tx(self, write: bool) -> AsyncIterator[_Tx]:
        pool = self._pool
        if pool is None:
            raise StoreUnavailable(f"{self.url_for_logs}: the job store is not connected")
        try:
            async with pool.acquire(timeout=self._connect_timeout_s) as conn, conn.transaction(readonly=not write):
                yield _Tx(conn)
        except UNAVAILABLE as e:
            raise StoreUnavailable(f"{self.url_for_logs}: {_describe(e)}") from e


def _describe(e: BaseException) -> str:
    return str(e) or type(e).__name__  # a timeout's message is empty
