"""The client commands speak TLS with a client certificate: submit and status against an
etcd that requires one (certificates from test_etcd_tls's fixture)."""

from __future__ import annotations

import json

from test_etcd_tls import tls_etcd  # noqa: F401 - the fixture

from elasticd.cli import main


def test_submit_and_status_over_tls_with_a_client_certificate(tls_etcd, tmp_path, capsys):  # noqa: F811
    etcd, _, files = tls_etcd
    (tmp_path / "job.yaml").write_text("name: tls-job\n")
    tls = ["--etcd", etcd.endpoint, "--etcd-cacert", files["ca"], "--etcd-cert", files["client"],
           "--etcd-key", files["client_key"]]  # fmt: skip
    assert main(["submit", str(tmp_path / "job.yaml"), *tls]) == 0
    capsys.readouterr()
    assert main(["status", "tls-job", "--json", *tls]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "pending"
    # Without the client certificate the same server refuses, in one line, in time.
    code = main(["list", "--etcd", etcd.endpoint, "--etcd-cacert", files["ca"],
                 "--etcd-timeout", "1.5"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "did not answer" in err and err.count("\n") == 1


def test_a_client_cert_without_its_key_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "job.yaml").write_text("name: t\n")
    code = main(["list", "--etcd", "127.0.0.1:1", "--etcd-cert", str(tmp_path / "c.pem")])
    assert code == 2 and "a client cert needs its key" in capsys.readouterr().err
