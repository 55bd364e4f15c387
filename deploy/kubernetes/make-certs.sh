#!/usr/bin/env bash
# Make the certificates of elasticd's etcd with openssl: a CA, one server/peer certificate
# for the etcd members, and client certificates for the agents and the submitters. etcd
# runs with --client-cert-auth, so only holders of a client certificate from this CA get in.
#
#   deploy/kubernetes/make-certs.sh DIR [NAMESPACE]     (NAMESPACE default: elasticd)
#   kubectl -n elasticd create secret generic etcd-server-tls \
#       --from-file=ca.crt=DIR/ca.crt --from-file=tls.crt=DIR/etcd.crt --from-file=tls.key=DIR/etcd.key
#   kubectl -n elasticd create secret generic etcd-client-agent \
#       --from-file=ca.crt=DIR/ca.crt --from-file=tls.crt=DIR/agent.crt --from-file=tls.key=DIR/agent.key
#   kubectl -n elasticd create secret generic etcd-client-submit \
#       --from-file=ca.crt=DIR/ca.crt --from-file=tls.crt=DIR/submit.crt --from-file=tls.key=DIR/submit.key
#
# Keep DIR/ca.key offline: it signs new client certificates. Tested by
# tests/test_deploy_k8s.py (a real etcd serves with these files; a client without a
# certificate is refused).
set -euo pipefail
dir=${1:?usage: make-certs.sh DIR [NAMESPACE]}
ns=${2:-elasticd}
days=${DAYS:-825}
mkdir -p "$dir"
cd "$dir"
umask 077

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

# issue NAME CN EXTENDED_USAGE [SAN]
issue() {
  local name=$1 cn=$2 usage=$3 san=${4:-}
  key "$name.key"
  openssl req -new -key "$name.key" -subj "/CN=$cn" -out "$name.csr"
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$usage"
    if [ -n "$san" ]; then echo "subjectAltName=$san"; fi
  } > "$name.ext"
  openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial \
    -days "$days" -sha256 -extfile "$name.ext" -out "$name.crt" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
}

if [ ! -f ca.crt ]; then
  key ca.key
  openssl req -x509 -new -key ca.key -subj "/CN=elasticd-etcd-ca" -days 3650 -sha256 \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out ca.crt
fi

# One certificate for every member, as server (clients) and as peer (members) both.
sans="DNS:etcd-client,DNS:etcd-client.$ns.svc,DNS:etcd-client.$ns.svc.cluster.local"
for i in 0 1 2 3 4; do
  sans="$sans,DNS:etcd-$i.etcd.$ns.svc,DNS:etcd-$i.etcd.$ns.svc.cluster.local"
done
sans="$sans,DNS:localhost,IP:127.0.0.1"
issue etcd etcd serverAuth,clientAuth "$sans"
issue agent elasticd-agent clientAuth
issue submit elasticd-submit clientAuth
rm -f ca.srl
chmod 600 ./*.key
chmod 644 ./*.crt
echo "certificates in $(pwd): ca.crt, etcd.crt/.key, agent.crt/.key, submit.crt/.key"
