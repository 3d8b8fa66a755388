"""Debian's nginx, run by a test in front of the app with deploy/nginx/telemachus.conf: the file as
shipped, with only what a deployer edits changed (the listen addresses, the upstream's ports, the
certificate, the log), inside a main configuration like Debian's /etc/nginx/nginx.conf, as a
foreground process (`daemon off`) on the loopback with ports of its own."""

import os
import re
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.deploy.certs import Certificates
from tests.deploy.tools import tool
from tests.processes import ROOT, free_port, wait_until

SHIPPED = ROOT / "deploy/nginx/telemachus.conf"

# Debian's nginx.conf, the parts that apply to an http-context file (bookworm's, as installed),
# with its paths moved into the test's directory.
MAIN = """\
{user}
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log info;
events {{
    worker_connections 768;
}}
http {{
    sendfile on;
    tcp_nopush on;
    types_hash_max_size 2048;
    include /etc/nginx/mime.types;
    default_type application/octet-stream;
    ssl_protocols TLSv1 TLSv1.1 TLSv1.2 TLSv1.3;
    ssl_prefer_server_ciphers on;
    access_log {dir}/access.log;
    gzip on;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    include {dir}/sites-enabled/telemachus.conf;
}}
"""


def replaced(text: str, old: str, new: str, *, count: int) -> str:
    """`old` replaced by `new`, where `old` must occur exactly `count` times: the shipped file
    changing under the test fails it here, rather than leaving a line the test never meant to keep."""
    found = len(re.findall(re.escape(old), text))
    assert found == count, f"deploy/nginx/telemachus.conf: expected {count} of {old!r}, found {found}"
    return text.replace(old, new)


def site_config(*, https_port: int, http_port: int, upstreams: list[int], certs: Certificates, log: Path) -> str:
    """deploy/nginx/telemachus.conf as a deployer edits it for this host: here, loopback only."""
    text = SHIPPED.read_text()
    text = replaced(text, "listen [::]:80;\n", "", count=1)
    text = replaced(text, "listen [::]:443 ssl http2;\n", "", count=1)
    text = replaced(text, "listen 80;", f"listen 127.0.0.1:{http_port};", count=1)
    text = replaced(text, "listen 443 ssl http2;", f"listen 127.0.0.1:{https_port} ssl http2;", count=1)
    text = replaced(text, "server 127.0.0.1:8001;", f"server 127.0.0.1:{upstreams[0]};", count=1)
    text = replaced(text, "server 127.0.0.1:8002;", f"server 127.0.0.1:{upstreams[1]};", count=1)
    text = replaced(text, "/etc/ssl/telemachus/fullchain.pem", str(certs.cert), count=1)
    text = replaced(text, "/etc/ssl/telemachus/privkey.pem", str(certs.key), count=1)
    return replaced(text, "/var/log/nginx/telemachus.access.log", str(log), count=2)


@dataclass
class Nginx:
    process: subprocess.Popen
    directory: Path
    https_port: int
    http_port: int

    @property
    def base(self) -> str:
        return f"https://127.0.0.1:{self.https_port}"

    @property
    def access_log(self) -> Path:
        return self.directory / "telemachus.access.log"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # nginx's fast shutdown
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)


def nginx_start(*, upstreams: list[int], certs: Certificates) -> Nginx:
    """nginx in the foreground with the shipped site, checked with `nginx -t` first; returned once
    it accepts connections. Run as root, its workers run as Debian's www-data (as installed), so
    its directory is one they can enter and its temporary directories ones they can write."""
    nginx = tool("nginx", package="nginx")
    directory = Path(tempfile.mkdtemp(prefix="telemachus-nginx-"))
    directory.chmod(0o755)
    for temporary in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (directory / temporary).mkdir(mode=0o777)
        (directory / temporary).chmod(0o777)
    (directory / "sites-enabled").mkdir()
    https_port, http_port = free_port(), free_port()
    site = site_config(
        https_port=https_port,
        http_port=http_port,
        upstreams=upstreams,
        certs=certs,
        log=directory / "telemachus.access.log",
    )
    (directory / "sites-enabled/telemachus.conf").write_text(site)
    user = "user www-data;" if os.geteuid() == 0 else ""
    main = directory / "nginx.conf"
    main.write_text(MAIN.format(user=user, dir=directory))
    checked = subprocess.run([nginx, "-t", "-c", str(main)], capture_output=True, text=True)
    assert checked.returncode == 0, f"nginx -t refused the configuration:\n{checked.stderr}"
    log = open(directory / "stdout.log", "w")
    process = subprocess.Popen([nginx, "-c", str(main)], stdout=log, stderr=subprocess.STDOUT)
    started = Nginx(process=process, directory=directory, https_port=https_port, http_port=http_port)

    def listening() -> bool:
        assert process.poll() is None, f"nginx exited: {(directory / 'error.log').read_text()[-2000:]}"
        try:
            socket.create_connection(("127.0.0.1", https_port), timeout=1).close()
            return True
        except OSError:
            return False

    try:
        wait_until(listening, timeout=20, what="nginx to listen")
    except BaseException:
        started.stop()
        raise
    return started
