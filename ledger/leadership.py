"""`Leadership`: which of several workers on one database does a job that any of them may do and
one suffices for (the distributed mode's lease sweeper).

It saves work, never guards correctness: the job must stay safe when two do it at once (a lease
expiry is decided on the request stream's version, so two sweepers expire nothing twice). On
PostgreSQL it is a session advisory lock held on a connection of its own: the server frees it
the moment that session ends, so a worker killed with -9 hands the job over at the others' next
try. SQLite is one machine's embedded store with one worker: there the caller always leads.
"""

from __future__ import annotations

import logging

import sqlalchemy as sa

log = logging.getLogger("tollgate.leadership")

# The key names the schema too: advisory locks are per database, and two deployments (or two
# test runs) in schemas of one database must not take each other's job.
_TRY = sa.text("SELECT pg_try_advisory_lock(hashtextextended(current_schema() || ':' || :job, 0))")


class Leadership:
    def __init__(self, engine: sa.Engine, job: str) -> None:
        self.engine = engine
        self.job = job
        self._pg = engine.dialect.name == "postgresql"
        self._conn: sa.Connection | None = None

    def held(self) -> bool:
        """Whether this process leads now: takes the lock when it is free, and checks that the
        session holding it is still alive when it is ours (a lost session lost the lock)."""
        if not self._pg:
            return True
        try:
            if self._conn is None:
                conn = self.engine.connect()
                try:
                    taken = bool(conn.execute(_TRY, {"job": self.job}).scalar())
                    conn.commit()  # the lock is the session's; end the read transaction
                except BaseException:
                    conn.close()
                    raise
                if not taken:
                    conn.close()
                    return False
                self._conn = conn
                log.info("leading %s", self.job)
            else:
                self._conn.execute(sa.text("SELECT 1"))
                self._conn.commit()
            return True
        except sa.exc.DBAPIError:
            log.warning("lost the lead of %s (its session failed)", self.job, exc_info=True)
            self.release()
            return False

    def release(self) -> None:
        """Hand the job over (closing the session frees the lock)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.invalidate()  # never back to the pool with the lock
            finally:
                conn.close()
