#!/usr/bin/env bash
# A private CA and one certificate per ttserve service, with openssl, plus the gateway's API key.
#
#   deploy/make-certs.sh DIR [SERVICE[=HOST,HOST...] ...]
#
# Default services: worker, control, gateway. Each certificate's subject CN is the service name
# (the worker's --control-identity names the control plane's), and its SANs are the name itself,
# localhost, 127.0.0.1 and any HOST given (host names or IP addresses the others dial it by), e.g.
#
#   deploy/make-certs.sh /etc/ttserve/tls worker=10.0.0.5 control=10.0.0.4 gateway=api.example.com
#
# Writes DIR/ca.crt, DIR/ca.key (keep it offline once the certificates exist), DIR/NAME.crt and
# DIR/NAME.key, and DIR/api-key (one random key, if DIR/api-key does not exist yet). Keys are
# mode 0600: hand each one to the user its service runs as (systemd: root-only files under
# /etc/ttserve/tls are read via LoadCredential=; compose: see deploy/README.md). An existing CA
# in DIR is reused, so running it again with a new service adds that service's certificate.
# Certificates are valid for DAYS days (environment, default 825).
set -euo pipefail

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
dir=$1
shift
services=("$@")
[[ ${#services[@]} -gt 0 ]] || services=(worker control gateway)
days=${DAYS:-825}

umask 077
mkdir -p "$dir"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [[ ! -f $dir/ca.key ]]; then
  openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -sha256 \
    -keyout "$dir/ca.key" -out "$dir/ca.crt" -days "$days" -subj "/CN=ttserve CA" \
    -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  chmod 0644 "$dir/ca.crt"
  echo "made the CA: $dir/ca.crt"
fi

for spec in "${services[@]}"; do
  name=${spec%%=*}
  hosts=()
  [[ $spec == *=* ]] && IFS=, read -r -a hosts <<< "${spec#*=}"
  san="DNS:$name,DNS:localhost,IP:127.0.0.1"
  for host in "${hosts[@]}"; do
    if [[ $host =~ ^[0-9.]+$ || $host == *:* ]]; then san+=",IP:$host"; else san+=",DNS:$host"; fi
  done
  cat > "$work/$name.ext" <<EOF
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=$san
EOF
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -sha256 \
    -keyout "$dir/$name.key" -out "$work/$name.csr" -subj "/CN=$name" 2>/dev/null
  openssl x509 -req -in "$work/$name.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial \
    -CAserial "$work/ca.srl" -out "$dir/$name.crt" -days "$days" -sha256 -extfile "$work/$name.ext" 2>/dev/null
  chmod 0644 "$dir/$name.crt"
  openssl verify -CAfile "$dir/ca.crt" "$dir/$name.crt" > /dev/null
  echo "made $dir/$name.crt ($san)"
done

if [[ ! -f $dir/api-key ]]; then
  openssl rand -hex 32 > "$dir/api-key"
  echo "made the API key: $dir/api-key (clients send 'Authorization: Bearer <its content>')"
fi
