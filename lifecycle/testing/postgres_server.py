"""A private, throwaway PostgreSQL cluster for tests and demos (no mocks).

``PostgresServer`` runs ``initdb`` into a fresh directory and starts a real
server that listens only on 127.0.0.1, on a free TCP port, with its unix
socket in a private directory and settings suited to tests (two-phase commit
enabled, no fsync). It serves TLS with a test CA of its own
(:mod:`lifecycle.testing.postgres_tls`; ``tls=False`` for none):
:meth:`PostgresServer.dsn` says ``sslmode=disable`` (a TLS handshake costs
about 4 ms a connection, which every test and benchmark would pay), a client
that checks the certificate uses
:meth:`PostgresServer.tls_dsn`, and roles made by
:func:`~lifecycle.testing.postgres_tls.create_role` may connect only that way.
``stop()`` followed by ``start()`` reuses the same data directory and port, so
prepared transactions survive a restart.

PostgreSQL refuses to run as root.  When this process is root, the working
directories are handed to the ``postgres`` system user and every PostgreSQL
binary is run as that user; otherwise they run as the current user.

The binaries are taken from ``$TWOPHASE_PG_BIN`` if set, else from
``pg_config --bindir``, else from the newest ``/usr/lib/postgresql/*/bin``.

Run as a program (``python -m lifecycle.testing.postgres_server [--datadir DIR]
[--port N]``) it
starts a server, prints its DSN and waits for Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import pwd
import shlex
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Literal
from urllib.parse import quote

from lifecycle.testing.postgres_tls import ServerTls, hba, make_tls
from lifecycle.testing.services import NativeService, free_port, serve

StopMode = Literal["smart", "fast", "immediate"]

PG_USER = "postgres"  # system user the server runs as when we are root
SUPERUSER = "postgres"  # database superuser created by initdb
SERVER_SETTINGS: dict[str, str] = {
    "listen_addresses": "127.0.0.1",
    "max_prepared_transactions": "64",
    "max_connections": "200",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
}


class PostgresServerError(RuntimeError):
    """A PostgreSQL command failed; the message carries its output and log tail."""


def find_pg_bindir() -> Path:
    """Return the directory holding ``initdb`` and ``pg_ctl``."""
    override = os.environ.get("TWOPHASE_PG_BIN")
    if override:
        path = Path(override)
        if not (path / "initdb").is_file():
            raise PostgresServerError(f"TWOPHASE_PG_BIN={override} has no initdb")
        return path
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        if out.returncode == 0:
            candidates.append(Path(out.stdout.strip()))

    def version(p: Path) -> tuple[int, ...]:
        parts = p.parent.name.split(".")
        return tuple(int(x) for x in parts) if all(x.isdigit() for x in parts) else ()

    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version, reverse=True)
    for path in candidates:
        if (path / "initdb").is_file() and (path / "pg_ctl").is_file():
            return path
    raise PostgresServerError(
        "no PostgreSQL server binaries found (install the 'postgresql' package "
        "or set TWOPHASE_PG_BIN)"
    )


def _others_can_traverse(path: Path) -> bool:
    """True if every directory from ``path`` up to ``/`` is world-searchable."""
    return all(os.stat(p).st_mode & stat.S_IXOTH for p in (path, *path.parents))


class PostgresServer(NativeService):
    """A throwaway PostgreSQL cluster, started and stopped with ``pg_ctl``.

    ``datadir`` defaults to a fresh temporary directory that ``cleanup()``
    deletes; a given ``datadir`` is initialised if empty, reused if it already
    holds a cluster, and kept by ``cleanup()``.  ``port`` defaults to a free
    port picked at the first ``start()`` and kept for later starts.
    """

    def __init__(
        self,
        datadir: str | Path | None = None,
        port: int | None = None,
        settings: dict[str, str] | None = None,
        tls: bool = True,
    ) -> None:
        """``settings`` override or extend ``SERVER_SETTINGS``; ``tls``: serve
        TLS (module docstring)."""
        self.settings = {**SERVER_SETTINGS, **(settings or {})}
        self.bindir: Path = find_pg_bindir()
        self.port: int | None = port
        self._as_root = os.geteuid() == 0
        self._pg_ids: tuple[int, int] | None = None
        if self._as_root:
            try:
                pw = pwd.getpwnam(PG_USER)
            except KeyError:
                raise PostgresServerError(
                    f"running as root but there is no '{PG_USER}' system user"
                ) from None
            self._pg_ids = (pw.pw_uid, pw.pw_gid)
        # Private work dir for the socket and log (short path: unix socket
        # paths are limited to ~107 bytes).  As root it must be reachable
        # by the postgres user, so fall back to /tmp if $TMPDIR is not.
        base = Path(tempfile.gettempdir())
        if self._as_root and not _others_can_traverse(base):
            base = Path("/tmp")
        self.workdir: Path = Path(tempfile.mkdtemp(prefix="pgserver-", dir=base))
        self.sockdir: Path = self.workdir / "sock"
        self.logfile: Path = self.workdir / "server.log"
        self.sockdir.mkdir(mode=0o700)
        self._own_datadir = datadir is None
        self.datadir: Path = self.workdir / "data" if datadir is None else Path(datadir).resolve()
        self._chown(self.workdir, self.sockdir)
        self._initialized = (self.datadir / "PG_VERSION").is_file()
        self.tls: ServerTls | None = None
        """the server's TLS files (None: ``tls=False``)"""
        if tls:
            self.tls = make_tls(self.workdir / "tls", lambda p: self._chown(p))
        self.hba_file: Path = self.workdir / "pg_hba.conf"
        self.hba_file.write_text(hba(tls))
        self._chown(self.hba_file)

    # -- helpers ---------------------------------------------------------

    def _chown(self, *paths: Path) -> None:
        if self._pg_ids is not None:
            for p in paths:
                os.chown(p, *self._pg_ids)

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a PostgreSQL binary, as the postgres user when we are root."""
        cmd = [str(self.bindir / args[0]), *args[1:]]
        env = {**os.environ, "LC_ALL": "C"}
        for var in ("PGDATA", "PGPORT", "PGHOST", "PGUSER", "PGDATABASE"):
            env.pop(var, None)
        uid = gid = None
        if self._pg_ids is not None:
            uid, gid = self._pg_ids
            pw = pwd.getpwuid(uid)
            env.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name)
        proc = subprocess.run(
            cmd,
            cwd="/",  # our cwd may not be readable by the postgres user
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            user=uid,
            group=gid,
            extra_groups=None if uid is None else [],
        )
        if check and proc.returncode != 0:
            raise PostgresServerError(
                f"{shlex.join(cmd)} exited with {proc.returncode}\n"
                f"{proc.stdout}{proc.stderr}{self.log_tail()}"
            )
        return proc

    def _initdb(self) -> None:
        if not self.datadir.exists():
            self.datadir.mkdir(mode=0o700, parents=True)
        self._chown(self.datadir)
        self._run(
            "initdb",
            "-D",
            str(self.datadir),
            f"--username={SUPERUSER}",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        )
        self._initialized = True

    # -- public API ------------------------------------------------------

    def start(self) -> None:
        """initdb on first use, then start the server and wait until it is up."""
        if not self._initialized:
            self._initdb()
        if self.is_running():
            return
        if self.port is None:
            self.port = free_port()
        opts = [f"-p {self.port}", f"-k {shlex.quote(str(self.sockdir))}"]
        settings = {**self.settings, "hba_file": str(self.hba_file)}
        settings.update(self.tls.settings() if self.tls is not None else {})
        opts += [f"-c {k}={shlex.quote(v)}" for k, v in settings.items()]
        self._run(
            "pg_ctl",
            "-D",
            str(self.datadir),
            "-l",
            str(self.logfile),
            "-w",
            "-t",
            "60",
            "-o",
            " ".join(opts),
            "start",
        )

    def stop(self, mode: StopMode = "fast") -> None:
        """Stop the server (no-op if it is not running); data and port are kept."""
        if self.is_running():
            self._run("pg_ctl", "-D", str(self.datadir), "-m", mode, "-w", "-t", "60", "stop")

    def restart(self) -> None:
        """Stop then start the server on the same data dir and port."""
        self.stop()
        self.start()

    def is_running(self) -> bool:
        """True if a postmaster is running on ``datadir``."""
        if not self._initialized:
            return False
        return self._run("pg_ctl", "-D", str(self.datadir), "status", check=False).returncode == 0

    def dsn(self, dbname: str = "postgres") -> str:
        """libpq URI for ``dbname`` over TCP without TLS, e.g.
        postgresql://postgres@127.0.0.1:5432/postgres?sslmode=disable: the tests'
        and benchmarks' connections cost what they cost before the server served
        TLS (about 4 ms less each); :meth:`tls_dsn` for TLS."""
        if self.port is None:
            raise PostgresServerError("server has not been started yet")
        db = quote(dbname, safe="")
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{db}?sslmode=disable"

    def tls_dsn(self, user: str = SUPERUSER, dbname: str = "postgres") -> str:
        """libpq URI of ``user`` on ``dbname`` over TLS, checking the server's
        certificate and name (``sslmode=verify-full``, the test CA as
        ``sslrootcert``); no password (the caller adds it)."""
        if self.port is None or self.tls is None:
            raise PostgresServerError("the server has not been started, or serves no TLS")
        params = "&".join(f"{k}={quote(v, safe='')}" for k, v in self.tls.client_params().items())
        return (
            f"postgresql://{quote(user, safe='')}@127.0.0.1:{self.port}/"
            f"{quote(dbname, safe='')}?{params}"
        )

    def create_database(self, name: str) -> str:
        """Create database ``name`` and return its DSN."""
        import psycopg  # lazy: the CLI below needs only the standard library
        from psycopg import sql

        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.dsn(name)

    def cleanup(self) -> None:
        """Stop the server and delete its temporary directories.

        A ``datadir`` passed to the constructor is kept.
        """
        try:
            self.stop()
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)
            if self._own_datadir:
                shutil.rmtree(self.datadir, ignore_errors=True)

    def why_stopped(self) -> None:
        """Raise: the server stopped without being asked to."""
        raise PostgresServerError(f"the server stopped on its own\n{self.log_tail()}")


def main(argv: list[str] | None = None) -> None:
    """Start a server, print its DSN, wait for Ctrl-C or SIGTERM, clean up."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datadir", help="keep the cluster in DIR (kept on exit)")
    parser.add_argument("--port", type=int, help="TCP port (default: a free one)")
    args = parser.parse_args(argv)

    server = PostgresServer(datadir=args.datadir, port=args.port)
    serve(server, server.dsn, server.why_stopped)


if __name__ == "__main__":
    main()
