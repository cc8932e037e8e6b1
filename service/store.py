"""The job store: one SQLAlchemy 2 table of jobs (SQLite by default, PostgreSQL by URL).

Every state change goes through :func:`transition`, a conditional ``UPDATE ... WHERE state IN
(<legal predecessors>)``: an illegal change raises, and two schedulers racing to start the same
QUEUED job cannot both win, so no job runs twice.
"""

from __future__ import annotations

import enum
import functools
import uuid
from datetime import datetime, timezone
from typing import Any, cast

from sqlalchemy import (
    JSON,
    DateTime,
    Index,
    Integer,
    Select,
    String,
    Table,
    Text,
    UniqueConstraint,
    bindparam,
    create_engine,
    event,
    func,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.engine import Connection, CursorResult, Engine, Row
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker


class JobState(str, enum.Enum):
    QUEUED = "QUEUED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    CANCELLING = "CANCELLING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
ACTIVE_STATES = frozenset({JobState.STARTING, JobState.RUNNING, JobState.CANCELLING})

# to_state -> the states it may be reached from.
LEGAL_PREDECESSORS: dict[JobState, frozenset[JobState]] = {
    JobState.STARTING: frozenset({JobState.QUEUED}),
    JobState.RUNNING: frozenset({JobState.STARTING}),
    JobState.CANCELLING: frozenset({JobState.STARTING, JobState.RUNNING}),
    JobState.SUCCEEDED: frozenset({JobState.RUNNING, JobState.CANCELLING}),
    JobState.FAILED: frozenset({JobState.STARTING, JobState.RUNNING, JobState.CANCELLING}),
    JobState.CANCELLED: frozenset({JobState.QUEUED, JobState.CANCELLING}),
}


class IllegalTransition(RuntimeError):
    """The job is not in a state from which the requested state can be reached."""


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    pass


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("owner", "idempotency_key", name="uq_jobs_owner_idempotency_key"),
        # The list's pages, newest first: everyone's (admins), one owner's, one state's, one owner's in one
        # state (also the queue quota's count); the scheduler's queue order.
        Index("ix_jobs_created_id", "created_at", "id"),
        Index("ix_jobs_owner_created_id", "owner", "created_at", "id"),
        Index("ix_jobs_state_created_id", "state", "created_at", "id"),
        Index("ix_jobs_owner_state_created_id", "owner", "state", "created_at", "id"),
        Index("ix_jobs_state_priority_created", "state", "priority", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=lambda: str(uuid.uuid4()))
    name: Mapped[str] = mapped_column(String(200))
    owner: Mapped[str] = mapped_column(String(200), index=True)
    state: Mapped[str] = mapped_column(String(16), index=True, default=JobState.QUEUED.value)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    overrides: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    # ResolvedPlan.to_dict() of the config, resolved at submission; the launcher uses it instead of resolving
    # again. Null: a row from before, or a model that cannot be planned on the meta device.
    resolved_plan: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    world_size: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    cancel_requested_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    mlflow_experiment_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    executor: Mapped[str | None] = mapped_column(String(32), nullable=True)  # null: a row from before executors (local)
    executor_ref: Mapped[str | None] = mapped_column(String(200), nullable=True)  # the executor's handle on the job
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)  # local jobs: the process-group leader
    pid_start_time: Mapped[int | None] = mapped_column(Integer, nullable=True)
    idempotency_key: Mapped[str | None] = mapped_column(String(200), nullable=True)
    request_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    workdir: Mapped[str] = mapped_column(Text)

    @property
    def job_state(self) -> JobState:
        return JobState(self.state)


def make_engine(url: str, *, pool_size: int = 20, max_overflow: int = 10, pool_timeout: float = 10.0) -> Engine:
    """An engine for ``url`` with an explicit pool; SQLite gets WAL and a busy timeout so the scheduler
    and handlers share it."""
    pool = {"pool_size": pool_size, "max_overflow": max_overflow, "pool_timeout": pool_timeout}
    if url.startswith("sqlite"):
        in_memory = url in ("sqlite://", "sqlite:///:memory:")  # one shared connection, no pool to size
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30},
                               **({} if in_memory else pool))

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA busy_timeout=30000")
            _set_wal(cursor)
            cursor.close()
    else:
        engine = create_engine(url, pool_pre_ping=True, **pool)
    create_tables(engine)
    return engine


def _set_wal(cursor, attempts: int = 100) -> None:
    """``PRAGMA journal_mode=WAL``, retried: on a new database file, servers starting together race
    to switch its journal mode, and SQLite answers the loser "database is locked" at once (the
    switch takes an exclusive lock the busy handler does not wait for)."""
    import sqlite3
    import time

    for attempt in range(attempts):
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as err:
            if "locked" not in str(err) or attempt == attempts - 1:
                raise
            time.sleep(0.05)


# pg_advisory_xact_lock key held while the tables are created: "mesh" in ASCII.
SCHEMA_LOCK_KEY = 0x6D657368


def create_tables(engine: Engine) -> None:
    """Create the missing tables, one server at a time.

    Servers starting together on a new database (replicas, or a restart while another server
    starts) would otherwise all see no table and all create it; the losers fail ("table jobs
    already exists" on SQLite, a unique violation in pg_type on PostgreSQL). So the check and the
    creation run in one transaction under a lock: PostgreSQL's transaction-scoped advisory lock,
    SQLite's write lock (``BEGIN IMMEDIATE``; others wait up to the busy timeout). Both databases
    have transactional DDL, so the waiting servers then find the tables.
    """
    with engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEMA_LOCK_KEY})
        elif engine.dialect.name == "sqlite":
            connection.exec_driver_sql("BEGIN IMMEDIATE")
        Base.metadata.create_all(connection)
        add_missing_columns(connection)  # under the same lock: one server adds them
        for index in jobs_table().indexes:  # a store made by an older version has the table but not every index
            index.create(connection, checkfirst=True)


# pg_advisory_xact_lock(namespace, hashtext(owner)) serialises one owner's submissions: "queu".
QUEUE_LOCK_NAMESPACE = 0x71756575


def lock_owner_queue(session: Session, owner: str) -> None:
    """Hold ``owner``'s submission lock until the session's transaction ends (commit or rollback).

    A quota is a count followed by an insert; two submissions of one owner counting at once would
    both see room. Under this lock the count and the insert are one step: on PostgreSQL an advisory
    lock per owner (other owners are not held up), on SQLite the database's write lock
    (``BEGIN IMMEDIATE``, unless the transaction already wrote and so holds it).
    """
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:namespace, hashtext(:owner))"),
                        {"namespace": QUEUE_LOCK_NAMESPACE, "owner": owner})
    elif dialect == "sqlite":
        connection = session.connection()
        dbapi_connection = connection.connection.dbapi_connection
        if dbapi_connection is None:  # only a connection invalidated after an error has none
            raise RuntimeError("job store: the session's SQLite connection was invalidated; retry the submission")
        if not dbapi_connection.in_transaction:
            connection.exec_driver_sql("BEGIN IMMEDIATE")


def jobs_table() -> Table:
    """The jobs table (``Job.__table__``, as the Table it is; the mapping types it as any FROM clause)."""
    return Base.metadata.tables[Job.__tablename__]


def add_missing_columns(connection: Connection) -> list[str]:
    """``ALTER TABLE jobs ADD COLUMN`` for every (nullable) column a store made by an older version
    lacks: ``create_all`` creates missing tables, never missing columns. Returns the names added."""
    table = jobs_table()
    present = {column["name"] for column in inspect(connection).get_columns(table.name)}
    missing = [column for column in table.columns if column.name not in present]
    for column in missing:
        if not column.nullable:
            raise RuntimeError(f"job store {connection.engine.url!r}: table {table.name} lacks the required column "
                               f"{column.name}; migrate it by hand or start with a new database")
        kind = column.type.compile(dialect=connection.dialect)
        connection.execute(text(f'ALTER TABLE {table.name} ADD COLUMN "{column.name}" {kind}'))
    return [column.name for column in missing]


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def transition(session: Session, job_id: str, to_state: JobState, **fields: Any) -> bool:
    """Move job ``job_id`` to ``to_state`` if it is in a legal predecessor state; commit.

    Returns False when the job is not (any longer) in such a state, e.g. another thread got
    there first; raises :class:`IllegalTransition` if no state could ever lead there.
    """
    sources = LEGAL_PREDECESSORS.get(to_state)
    if not sources:
        raise IllegalTransition(f"no state leads to {to_state.value}")
    values = {"state": to_state.value, **fields}
    if to_state in TERMINAL_STATES and "finished_at" not in fields:
        values["finished_at"] = utcnow()
    # An UPDATE's result is a cursor's, with the rowcount (Session.execute is typed for any statement).
    result = cast(CursorResult[Any], session.execute(
        update(Job).where(Job.id == job_id, Job.state.in_([s.value for s in sources])).values(**values)
    ))
    session.commit()
    return result.rowcount == 1


def require_transition(session: Session, job_id: str, to_state: JobState, **fields: Any) -> None:
    """Like :func:`transition`, but a job in the wrong state raises :class:`IllegalTransition`."""
    if not transition(session, job_id, to_state, **fields):
        job = session.get(Job, job_id)
        current = job.state if job else "missing"
        raise IllegalTransition(f"job {job_id} is {current}; it cannot become {to_state.value}")


def jobs_in(session: Session, states: frozenset[JobState] | set[JobState]) -> list[Job]:
    """Jobs in any of ``states``, oldest first."""
    rows = session.scalars(select(Job).where(Job.state.in_([s.value for s in states])).order_by(Job.created_at))
    return list(rows)


def queued_in_order(session: Session) -> list[Job]:
    """QUEUED jobs in the order they may start: higher priority first, FIFO within a priority."""
    query = select(Job).where(Job.state == JobState.QUEUED.value).order_by(Job.priority.desc(), Job.created_at, Job.id)
    return list(session.scalars(query))


# What a page of the job list shows: every column but the config document (kilobytes per job).
SUMMARY_COLUMNS = tuple(column for column in Job.__table__.columns if column.name != "config")
SUMMARY_KEYS = tuple(column.name for column in SUMMARY_COLUMNS)


@functools.cache
def _page_statements(by_owner: bool, by_state: bool) -> tuple[Select, Select]:
    """The count and the page query of a job list filtered by owner and / or state, built once:
    the values come as bound parameters (``owner``, ``state``, ``limit``, ``offset``), so the busiest
    endpoint neither rebuilds the statements nor misses SQLAlchemy's compiled-statement cache."""
    where = ([Job.owner == bindparam("owner")] if by_owner else []) + ([Job.state == bindparam("state")]
                                                                       if by_state else [])
    count = select(func.count()).select_from(Job).where(*where)
    page = (select(*SUMMARY_COLUMNS).where(*where).order_by(Job.created_at.desc(), Job.id.desc())
            .limit(bindparam("limit", type_=Integer)).offset(bindparam("offset", type_=Integer)))
    return count, page


def list_page(db: Session | Connection, *, owner: str | None, state: JobState | None, limit: int,
              offset: int) -> tuple[list[Row], int]:
    """One page of jobs, newest first, as rows of :data:`SUMMARY_COLUMNS`, and how many match.

    Two indexed queries whatever the page (``ix_jobs_*_created_id`` serve the filter and the
    order, so SQLite walks only the page's rows); the config column is never read. ``db`` is a
    session or a plain connection (the list endpoint's: no ORM unit of work for a read).
    """
    count, page = _page_statements(owner is not None, state is not None)
    params: dict[str, Any] = {"limit": limit, "offset": offset}
    if owner is not None:
        params["owner"] = owner
    if state is not None:
        params["state"] = state.value
    total = db.execute(count, params).scalar() or 0
    return list(db.execute(page, params)), total
