"""Servers a deployment test owns from start to end: a PostgreSQL cluster (initdb and pg_ctl from
Debian's /usr/lib/postgresql/<major>/bin) and a redis-server, each on a port of its own on the
loopback, with TLS when given certificates, and removed afterwards.

initdb refuses to run as root: as root, the cluster is made and run by the `postgres` user (which
Debian's postgresql package creates), in a directory of its own under /tmp that it can enter."""

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psycopg
import redis as redis_py
from redis import exceptions as redis_errors

from tests.deploy.certs import Certificates
from tests.deploy.tools import missing, postgres_bin, tool
from tests.processes import free_port, wait_until


@dataclass
class PostgresCluster:
    directory: Path
    port: int
    owner: str | None  # the user the server runs as when the test runs as root

    def as_owner(self, *argv: str) -> list[str]:
        return ["runuser", "-u", self.owner, "--", *argv] if self.owner else list(argv)

    def url(self, dbname: str, **params: str) -> str:
        query = "&".join(f"{key}={value}" for key, value in params.items())
        return f"postgres://postgres@127.0.0.1:{self.port}/{dbname}" + (f"?{query}" if query else "")

    def connect(self, dbname: str = "postgres", **params: str) -> psycopg.Connection:
        return psycopg.connect(
            host="127.0.0.1", port=self.port, user="postgres", dbname=dbname, autocommit=True, **params
        )

    def stop(self) -> None:
        if (self.directory / "data/postmaster.pid").exists():
            subprocess.run(
                self.as_owner(postgres_bin("pg_ctl"), "-D", str(self.directory / "data"), "-m", "immediate", "stop"),
                capture_output=True,
            )
        shutil.rmtree(self.directory, ignore_errors=True)


def postgres_start(*, certs: Certificates | None = None) -> PostgresCluster:
    """A new cluster, started. With `certs`: ssl on with that certificate, and its pg_hba.conf
    lets TCP clients in only over TLS (`hostssl`), so a connection without it is refused."""
    initdb, pg_ctl = postgres_bin("initdb"), postgres_bin("pg_ctl")
    owner = None
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            missing("needs runuser (Debian: util-linux) to run PostgreSQL as the postgres user")
        owner = "postgres"
    directory = Path(tempfile.mkdtemp(prefix="telemachus-pg-"))
    cluster = PostgresCluster(directory=directory, port=free_port(), owner=owner)
    try:
        directory.chmod(0o755)
        if owner:
            shutil.chown(directory, owner, owner)
        data = directory / "data"
        run = dict(check=True, capture_output=True, text=True)
        subprocess.run(
            cluster.as_owner(initdb, "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"),
            **run,  # type: ignore[arg-type]
        )
        settings = [
            f"port = {cluster.port}",
            "listen_addresses = '127.0.0.1'",
            f"unix_socket_directories = '{directory}'",
            "fsync = off",  # a test's cluster: nothing to keep across a crash
            "max_connections = 60",
        ]
        hba = ["local all all trust"]
        if certs is not None:
            for source, name in ((certs.cert, "server.pem"), (certs.key, "server.key"), (certs.ca, "ca.pem")):
                shutil.copyfile(source, directory / name)
                if owner:
                    shutil.chown(directory / name, owner, owner)
            (directory / "server.key").chmod(0o600)  # the server refuses a key others may read
            settings += [
                "ssl = on",
                f"ssl_cert_file = '{directory / 'server.pem'}'",
                f"ssl_key_file = '{directory / 'server.key'}'",
            ]
            hba.append("hostssl all all 127.0.0.1/32 trust")
        else:
            hba.append("host all all 127.0.0.1/32 trust")
        with open(data / "postgresql.conf", "a") as conf:
            conf.write("\n".join(settings) + "\n")
        (data / "pg_hba.conf").write_text("\n".join(hba) + "\n")
        subprocess.run(
            cluster.as_owner(pg_ctl, "-D", str(data), "-l", str(directory / "server.log"), "-w", "-t", "60", "start"),
            **run,  # type: ignore[arg-type]
        )
    except BaseException:
        log = directory / "server.log"
        print(log.read_text() if log.exists() else "(no server log)")
        cluster.stop()
        raise
    return cluster


@dataclass
class Redis:
    process: subprocess.Popen
    port: int
    directory: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)


def redis_tls_start(*, certs: Certificates) -> Redis:
    """redis-server listening with TLS only (`--port 0`: no plain-text port at all)."""
    server = tool("redis-server", package="redis-server")
    directory = Path(tempfile.mkdtemp(prefix="telemachus-redis-"))
    port = free_port()
    log = open(directory / "redis.log", "w")
    process = subprocess.Popen(
        [
            server,
            "--port", "0",
            "--tls-port", str(port),
            "--bind", "127.0.0.1",
            "--tls-cert-file", str(certs.cert),
            "--tls-key-file", str(certs.key),
            "--tls-ca-cert-file", str(certs.ca),
            # Clients prove nothing (no client certificates); they check the server's.
            "--tls-auth-clients", "no",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(directory),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    redis = Redis(process=process, port=port, directory=directory)

    def listening() -> bool:
        assert process.poll() is None, (directory / "redis.log").read_text()[-2000:]
        try:
            return bool(redis_client(port, certs).ping())
        except redis_errors.ConnectionError:
            return False

    try:
        wait_until(listening, timeout=20, what="redis-server to listen with TLS")
    except BaseException:
        redis.stop()
        raise
    return redis


def redis_client(port: int, certs: Certificates) -> redis_py.Redis:
    """A client of the TLS-only redis-server that verifies its certificate."""
    return redis_py.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(certs.ca), socket_connect_timeout=2)
