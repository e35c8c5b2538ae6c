#!/bin/sh
# What `make test` and `make run` need from the operating system, checked before anything else: as root the missing
# Debian packages are installed (one line says which), otherwise the exact `sudo apt-get install` line is printed and
# the command stops, so a missing tool never surfaces later as a test failure or a traceback.
#
# Usage: deploy/system-packages.sh test|run [--list]
#   test: the broker and its clients, the network namespace tools (iproute2, nftables, iptables), faketime for the
#         clock-skew fault, Chromium for the dashboard's browser test, npm for the Compose schema (tests/test_deploy.py)
#   run:  a Python that can make a virtual environment; Mosquitto when root (without it `make run` uses the embedded
#         amqtt broker)
#   --list: print the packages of the purpose and exit
# PYTHON names the interpreter the virtual environment is made from (python3); SBIN_DIRS where else to look for
# the tools (Debian puts daemons and network tools in sbin, which a user's PATH may lack).
set -eu

purpose=${1:-}
PYTHON=${PYTHON:-python3}
PATH="$PATH:${SBIN_DIRS-/usr/local/sbin:/usr/sbin:/sbin}"

case $purpose in
test) packages="mosquitto mosquitto-clients iproute2 nftables iptables faketime chromium npm" ;;
run) packages="mosquitto" ;;
*) echo "usage: $0 test|run [--list]" >&2; exit 2 ;;
esac
if [ "${2:-}" = "--list" ]; then
    echo "$packages python3-venv"
    exit 0
fi

# The command by which each package is recognised.
command_of() {
    case $1 in
    mosquitto-clients) echo mosquitto_sub ;;
    iproute2) echo ip ;;
    nftables) echo nft ;;
    *) echo "$1" ;;
    esac
}

missing=""
for package in $packages; do
    command -v "$(command_of "$package")" >/dev/null 2>&1 || missing="$missing $package"
done
# Debian's own python3 makes no virtual environment without python3-venv (ensurepip).
"$PYTHON" -c "import venv, ensurepip" >/dev/null 2>&1 || missing="$missing python3-venv"
missing=${missing# }
[ -z "$missing" ] && exit 0

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    if [ "$purpose" = run ] && [ "$missing" = mosquitto ]; then
        exit 0  # optional for run: the embedded broker stands in, and `edgeswarm up` says which it used
    fi
    echo "make $purpose needs Debian packages this machine lacks: sudo apt-get install -y $missing" >&2
    exit 1
fi

echo "installing the Debian packages make $purpose needs: $missing"
log=$(mktemp)
if ! { DEBIAN_FRONTEND=noninteractive apt-get update -q && \
       DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing; } >"$log" 2>&1; then
    tail -n 20 "$log" >&2
    echo "apt-get could not install: $missing (the lines above say why)" >&2
    rm -f "$log"
    exit 1
fi
rm -f "$log"
